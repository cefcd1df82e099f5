"""Operator specs and number formats: the vocabulary every part of codesign shares.

This package imports nothing else of codesign, so kernels, accelerator models,
the dataflow mapper and tests can all depend on it.
"""

from codesign.specs.errors import (
    CodesignError,
    check_choice,
    check_integer,
    check_nonneg_int,
    check_positive_int,
    check_positive_ints,
)
from codesign.specs.formats import (
    DTYPE_BITS,
    KVFormat,
    WeightFormat,
    dtype_bits,
    dtype_bytes,
    peak_key,
)
from codesign.specs.ops import (
    ALL_SPECS,
    AllReduce,
    Elementwise,
    Embedding,
    Gemm,
    KVDequantize,
    KVWrite,
    MoERouter,
    Norm,
    OpSpec,
    PagedDecodeAttention,
    PagedExtendAttention,
    PrefillAttention,
    RoPE,
    Sampling,
    Softmax,
    TreeAttention,
)

__all__ = [
    "ALL_SPECS",
    "DTYPE_BITS",
    "AllReduce",
    "CodesignError",
    "Elementwise",
    "Embedding",
    "Gemm",
    "KVDequantize",
    "KVFormat",
    "KVWrite",
    "MoERouter",
    "Norm",
    "OpSpec",
    "PagedDecodeAttention",
    "PagedExtendAttention",
    "PrefillAttention",
    "RoPE",
    "Sampling",
    "Softmax",
    "TreeAttention",
    "WeightFormat",
    "check_choice",
    "check_integer",
    "check_nonneg_int",
    "check_positive_int",
    "check_positive_ints",
    "dtype_bits",
    "dtype_bytes",
    "peak_key",
]
