"""codesign: hardware-software co-design toolkit for LLM inference.

Subpackages: `codesign.specs` (operator specs and formats), `codesign.catalog`
(models and GPUs), `codesign.kernels` (Triton/CuPy torch ops),
`codesign.autotune`, `codesign.accel_model`, `codesign.dataflow`.
Importing `codesign` is cheap: torch and triton load only with the kernels.
"""

from codesign.specs import CodesignError

__version__ = "0.1.0"
__all__ = ["CodesignError", "__version__"]
