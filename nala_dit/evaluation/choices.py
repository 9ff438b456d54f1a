"""The evaluator's names, as plain data: importing this module costs no torch (the CLIs'
``--help`` reads it)."""

from __future__ import annotations

# The features FID-type scores are computed on (``features.py``): the Inception network's, or
# the digits classifier's for the embedded digits.
FEATURE_CHOICES = ("inception", "digits")
# The embedded data a reference can be made of (``evaluate_fid.py ref --dataset``).
DATASETS = ("digits-train", "digits-heldout")
# torch-fidelity's file of the 2015-12-05 Inception network (``features.py`` checks its sha256).
INCEPTION_WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"
