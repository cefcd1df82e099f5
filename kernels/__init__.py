"""codesign.kernels: Triton (and CuPy) kernels for LLM inference, exposed as torch ops.

Importing this package imports torch and defines the Triton kernels; to run them on CPU tensors through
Triton's interpreter, set TRITON_INTERPRET=1 first (see codesign.backend).
"""

from codesign.kernels.df11_linear import LosslessBF16Config
from codesign.kernels.quant_linear import (
    FP8Config,
    QuantLinear,
    W4A16Config,
    W8A8Config,
    W8A16Config,
    quantize_,
)

__all__ = [
    "LosslessBF16Config",
    "FP8Config",
    "QuantLinear",
    "W4A16Config",
    "W8A8Config",
    "W8A16Config",
    "quantize_",
]
