"""What the command lines share, none of it importing torch: every option and choice as
plain data and ``TrainConfig`` (``options.py``), YAML configs whose keys are the flags
(``config.py``), the forgiving parser (``parse.py``), progress bars, the venv check."""
