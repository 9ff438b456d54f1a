"""NaLa's Triton path (see ``nala/__init__.py`` for the map): ``features.py``, ``blocks.py``,
``forward.py``, ``backward.py`` (the ``@triton.jit`` code), ``launch.py`` (configs, grids,
launches, the autograd function), ``gated.py`` (the gated layer's middle). Importing a
module here imports Triton; set ``TRITON_INTERPRET=1`` before it to run the kernels on CPU
tensors in Triton's interpreter."""
