"""Every kernel internal the Hugging Face integration uses, imported in this one place, plus the two
functions that read or rebuild the kernels' linear modules by their attributes (a checkpoint's layouts).

The kernel modules are being regrouped into families (gemm, df11, kvcache, attention); when their paths
move, only this file changes.
"""

from __future__ import annotations

import torch
from torch import nn

from codesign.kernels.attention.latent import latent_decode_attention, latent_decode_body
from codesign.kernels.attention.paged import paged_decode_attention, paged_extend_attention, tree_attention
from codesign.kernels.attention.quantized import (
    format_of,
    kivi_decode_attention,
    kivi_extend_attention,
    kivi_tree_attention,
    kvq_decode_attention,
    kvq_extend_attention,
    kvq_tree_attention,
    mixed_attention,
    oaken_attention,
)
from codesign.kernels.attention.tree import (
    TreeBatch,
    build_tree_batch,
    check_parents,
    tree_depths,
    verify_tree,
)
from codesign.kernels.attention.wrappers import PagedDecodeWrapper, PagedExtendWrapper, TreeAttentionWrapper
from codesign.kernels.df11.linear import (
    DecodeWorkspace,
    LosslessBF16Config,
    LosslessBF16Linear,
    PackedDF11,
    compress_model_,
    model_weight_format,
)
from codesign.kernels.gemm.checkpoints import from_awq, from_gptq
from codesign.kernels.gemm.formats import GROUP_SIZES, QuantizedWeight
from codesign.kernels.gemm.formats import unpack_codes as unpack_weight_codes
from codesign.kernels.gemm.linear import (
    FP8Config,
    QuantLinear,
    W4A16Config,
    W8A8Config,
    W8A16Config,
    quantize_,
)
from codesign.kernels.gemm.merged import cat_tensors as cat_merged
from codesign.kernels.gemm.merged import merge_linears, stored_tensors
from codesign.kernels.gemm.merged import split_tensors as split_merged
from codesign.kernels.gemm.merged import why_not as why_not_merged
from codesign.kernels.kvcache import quantizers as kvq
from codesign.kernels.kvcache.accuracy import (
    KIVI_GROUP,
    KIVI_RESIDUAL,
    MIXED_RECENT,
    OAKEN_FRACTION,
    OAKEN_OFFLINE_CAP,
    OAKEN_OFFLINE_FRACTION,
    OAKEN_SLOTS,
)
from codesign.kernels.kvcache.blocks import MAX_BLOCK_SIZE, BlockAllocator, PagedKVCache
from codesign.kernels.kvcache.checks import check_positive_real
from codesign.kernels.kvcache.host_ints import device_ints, device_rows
from codesign.kernels.kvcache.kivi import KiviPagedKV
from codesign.kernels.kvcache.kvq import QuantPagedKV, kvq_write
from codesign.kernels.kvcache.latent import latent_write, latent_write_body
from codesign.kernels.kvcache.mixed import MIXED_BITS, MixedPagedKV, cocktail_bits, mixed_write
from codesign.kernels.kvcache.oaken import OakenPagedKV
from codesign.kernels.kvcache.write import kv_write

__all__ = [
    "GROUP_SIZES",
    "BlockAllocator",
    "DecodeWorkspace", "PackedDF11", "model_weight_format", "is_codesign_linear", "layout_of", "module_from_layout",
    "FP8Config", "KIVI_GROUP", "KIVI_RESIDUAL", "KiviPagedKV", "LosslessBF16Config", "LosslessBF16Linear",
    "MAX_BLOCK_SIZE", "MIXED_BITS", "MIXED_RECENT", "MixedPagedKV", "OAKEN_FRACTION", "OAKEN_OFFLINE_CAP",
    "OAKEN_OFFLINE_FRACTION", "OAKEN_SLOTS", "OakenPagedKV", "PagedDecodeWrapper", "PagedExtendWrapper",
    "PagedKVCache", "QuantLinear", "TreeAttentionWrapper",
    "QuantPagedKV", "QuantizedWeight", "TreeBatch", "W4A16Config", "W8A8Config", "W8A16Config", "build_tree_batch",
    "cat_merged", "merge_linears", "split_merged", "stored_tensors", "why_not_merged",
    "check_parents", "cocktail_bits", "compress_model_", "device_ints", "device_rows", "format_of", "from_awq",
    "from_gptq", "kivi_decode_attention",
    "kivi_extend_attention", "kivi_tree_attention", "kv_write", "kvq", "kvq_decode_attention",
    "kvq_extend_attention", "kvq_tree_attention", "kvq_write", "mixed_attention", "mixed_write",
    "oaken_attention", "paged_decode_attention", "paged_extend_attention", "quantize_", "tree_attention",
    "tree_depths", "unpack_weight_codes", "verify_tree",
    "check_positive_real", "latent_decode_attention", "latent_decode_body", "latent_write", "latent_write_body",
]  # fmt: skip


# --- checkpoint layouts of the kernels' linear modules -------------------------------------------------------
# A pre-quantized checkpoint holds the modules' buffers; rebuilding the modules before loading needs their
# shapes and scalar attributes. PackedDF11 has no constructor from those (only from a DF11Tensor), so its
# skeleton is assembled from its attributes here.
_DF11_SCALARS = ("shape", "numel", "total_bits", "max_codes", "chunk_bytes", "chunks_per_group", "levels",
                 "nbytes", "segment")  # fmt: skip


def is_codesign_linear(m: nn.Module) -> bool:
    return isinstance(m, QuantLinear | LosslessBF16Linear)


def _dt(t: torch.Tensor | None) -> str | None:
    return None if t is None else str(t.dtype).removeprefix("torch.")


def layout_of(m: nn.Module) -> dict:
    """A JSON-serializable description of a QuantLinear / LosslessBF16Linear, enough to rebuild it empty."""
    if isinstance(m, QuantLinear):
        signed = m.qweight.dtype == torch.int8 and m.dtype_name == "int8"  # W8A8's signed [N, K] codes
        return {"kind": "quant", "dtype": m.dtype_name, "group_size": m.group_size, "N": m.out_features,
                "K": m.in_features, "scales": _dt(m.scales), "zeros": m.zeros is not None, "perm": m.perm is not None,
                "bias": _dt(m.bias), "act_quant": m.act_quant,
                **({"w8a8_codes": "signed"} if signed else {})}  # fmt: skip
    p = m.weight_packed
    bufs = {n: [list(b.shape), _dt(b)] for n, b in p.named_buffers()}
    return {"kind": "df11", **{a: getattr(p, a) for a in _DF11_SCALARS}, "buffers": bufs,
            "bias": _dt(m.bias), "check": m.check, "exact": m.exact}  # fmt: skip


def module_from_layout(layout: dict, workspace: DecodeWorkspace | None = None) -> nn.Module:
    """An empty module of `layout` for a checkpoint's buffers to fill: CPU zeros (ones for scales, which must
    be > 0), on the CPU even inside transformers' meta-device context (the kernels validate values)."""
    dt = lambda name: getattr(torch, name)  # noqa: E731
    n = layout.get("N")
    bias = (
        None
        if layout["bias"] is None
        else torch.zeros(n or layout["shape"][0], dtype=dt(layout["bias"]), device="cpu")
    )
    if layout["kind"] == "quant":
        k, g = layout["K"], layout["group_size"]
        sd = dt(layout["scales"])
        if layout["dtype"] == "fp8_e4m3":
            qw = torch.zeros(k, n, dtype=torch.float8_e4m3fn, device="cpu")
            scales, zeros = torch.ones(1, n if g is None else 1, dtype=sd, device="cpu"), None
        else:
            per = 32 // (4 if layout["dtype"] == "int4" else 8)
            groups = 1 if g is None else k // g
            qw = torch.zeros(k // per, n, dtype=torch.int32, device="cpu")
            scales = torch.ones(groups, n, dtype=sd, device="cpu")
            zeros = torch.zeros(groups, n, dtype=sd, device="cpu") if layout["zeros"] else None
        perm = torch.arange(k, device="cpu") if layout["perm"] else None
        w = QuantizedWeight(qw, scales, zeros, layout["dtype"], g, n, k, perm)
        q = QuantLinear(w, bias, layout["act_quant"])
        if q.qweight.dtype == torch.int8 and layout["dtype"] == "int8" and layout.get("w8a8_codes") != "signed":
            q.qweight = qw  # saved before W8A8's signed layout: the packed words (`QuantLinear.signed_codes_` after)
        return q
    p = PackedDF11.__new__(PackedDF11)
    nn.Module.__init__(p)
    for a in _DF11_SCALARS:
        setattr(p, a, tuple(layout[a]) if a == "shape" else layout[a])
    for name, (shape, dtype) in layout["buffers"].items():
        p.register_buffer(name, torch.zeros(shape, dtype=dt(dtype), device="cpu"))
    if "seg_bits" not in layout["buffers"]:
        p.register_buffer("seg_bits", None)
    return LosslessBF16Linear(p, bias, workspace, layout["check"], layout["exact"])
