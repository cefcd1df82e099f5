"""codesign.kernels: Triton (and CuPy) kernels for LLM inference, exposed as torch ops, in five families.

    gemm/       quantized GEMM: W4A16 / W8A16 / W8A8 / FP8 ops, their Triton and CuPy kernels, QuantLinear
                and quantize_, GPTQ / AWQ checkpoint importers
    df11/       lossless BF16 (DFloat11-style) weights: codec, decode and fused GEMV / GEMM kernels, linear
    kvcache/    the paged KV cache: block allocator, the KV-format vocabulary, reference quantizers, writers,
                and the quantized cache types (per-token INT8/4/2 and FP8, KIVI, Oaken, mixed precision)
    attention/  paged decode / extend / tree attention over every cache type: options, the torch ops, the
                CPU reference, the Triton kernel, plan()/run() wrappers, verify_tree
    layers/     the per-layer ops between the GEMMs and attention, one launch each: RMSNorm, rotary
                embedding of q and k, the SiLU-gated product

Dependencies point one way: attention -> kvcache -> codesign.specs (a cache never imports attention).
The names below are importable from here; importing this package defines no kernel (each name is imported
on first use), so Triton's interpreter can still be switched on afterwards (see codesign.backend). The
module names from before the families (`codesign.kernels.paged_attention`, ...) still import, with a
DeprecationWarning naming the new place (`codesign.kernels._moved`).
"""

from __future__ import annotations

import importlib
from typing import Any

from codesign.kernels import _moved

_moved.install()

# public name -> the module (under codesign.kernels) that defines it
_EXPORTS = {
    **dict.fromkeys(("QuantizedWeight", "quantize_rtn", "dequantize"), "gemm.formats"),
    **dict.fromkeys(
        ("w4a16_gemm", "w8a16_gemm", "w8a8_gemm", "fp8_gemm", "quantize_per_token_int8",
         "quantize_per_token_fp8", "quant_matmul"), "gemm.ops"),  # fmt: skip
    **dict.fromkeys(
        ("QuantLinear", "quantize_", "W4A16Config", "W8A16Config", "W8A8Config", "FP8Config", "QuantConfig"),
        "gemm.linear",
    ),
    **dict.fromkeys(("merge_linears",), "gemm.merged"),
    **dict.fromkeys(("from_gptq", "from_awq"), "gemm.checkpoints"),
    **dict.fromkeys(("DF11Tensor", "compress", "decompress"), "df11.codec"),
    **dict.fromkeys(
        ("LosslessBF16Config", "LosslessBF16Linear", "PackedDF11", "DecodeWorkspace", "compress_model_",
         "df11_linear", "df11_gemv", "df11_gemm", "model_weight_format"), "df11.linear"),  # fmt: skip
    **dict.fromkeys(("DF11Rows", "compress_rows"), "df11.rows"),
    **dict.fromkeys(("PackedDF11Rows", "df11_rows_gemv"), "df11.packed_rows"),
    **dict.fromkeys(("BlockAllocator", "PagedKVCache"), "kvcache.blocks"),
    "kv_write": "kvcache.write",
    "latent_write": "kvcache.latent",
    **dict.fromkeys(("QuantPagedKV", "kvq_write"), "kvcache.kvq"),
    "KiviPagedKV": "kvcache.kivi",
    "OakenPagedKV": "kvcache.oaken",
    **dict.fromkeys(("MixedPagedKV", "mixed_write", "cocktail_bits"), "kvcache.mixed"),
    **dict.fromkeys(("paged_decode_attention", "paged_extend_attention"), "attention.paged"),
    **dict.fromkeys(("latent_decode_attention", "latent_decode_spec"), "attention.latent"),
    **dict.fromkeys(
        ("TreeBatch", "build_tree_batch", "tree_attention", "tree_mask", "verify_tree", "TreeVerifyResult"),
        "attention.tree",
    ),
    **dict.fromkeys(
        ("kvq_decode_attention", "kvq_extend_attention", "kvq_tree_attention", "kivi_decode_attention",
         "kivi_extend_attention", "kivi_tree_attention", "oaken_attention", "mixed_attention"),
        "attention.quantized",
    ),  # fmt: skip
    **dict.fromkeys(("PagedDecodeWrapper", "PagedExtendWrapper", "TreeAttentionWrapper"), "attention.wrappers"),
    **dict.fromkeys(("rms_norm", "add_rms_norm", "rope", "silu_mul"), "layers.ops"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'codesign.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"codesign.kernels.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
