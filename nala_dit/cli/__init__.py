"""What the command lines share, none of it importing torch: every option and choice they
offer, gathered from the packages that own them (``options.py``; ``TrainConfig`` is
``training/config.py``'s), YAML configs whose keys are the flags (``config.py``), the
forgiving parser (``parse.py``), the sampling CLIs' size flags as the model layer's plain
values (``sizes.py``), the venv check (``requirements.py``). It sits at the top of
the import graph: no package imports it."""
