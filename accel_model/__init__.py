"""codesign.accel_model: cycle-level accelerator models (systolic array, memories, PIM, vector, KV quant)."""

from codesign.accel_model import _moved  # noqa: F401  (old module paths: see _moved.py)
