"""Quantized KV caches behind the plan()/run() wrappers of `codesign.kernels.paged_attention`: one
description per cache type (what plan() validates once) and one launch per type (what run() does, with
no host sync), each calling the same torch op as the functional entry point, so a wrapper's output is
bit-identical to `kvq_*_attention`, `kivi_*_attention`, `oaken_attention` and `mixed_attention`.

Cache types: `QuantPagedKV` (per-token INT8/4/2, FP8 per head), `KiviPagedKV`, `OakenPagedKV` (both
metadata variants), `MixedPagedKV`. Oaken and mixed attention have no ALiBi, window, softcap or lse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from codesign.specs import CodesignError, KVFormat

QUANT_CACHE_TYPES = ("QuantPagedKV", "KiviPagedKV", "OakenPagedKV", "MixedPagedKV")


@dataclass(frozen=True)
class QuantCacheInfo:
    """What plan() learns about a quantized cache: its geometry, its format for the spec, the features
    its attention supports, and a signature (every tensor's shape, dtype and device plus the scalar
    parameters) that run() compares without touching the data."""

    kind: str  # "kvq", "kivi", "oaken", "mixed"
    shape: tuple[int, int, int, int]  # (num_blocks, block_size, kv_heads, head_dim)
    kv_format: KVFormat | None  # None: mixed precision (varies per block)
    signature: tuple
    full_features: bool  # alibi / window / softcap / lse supported


def is_quant_cache(cache) -> bool:
    """True for any of the quantized cache dataclasses (by type, no import cycle)."""
    return type(cache).__name__ in QUANT_CACHE_TYPES


def _sig(cache, names: tuple[str, ...], scalars: tuple) -> tuple:
    tens = []
    for n in names:
        t = getattr(cache, n)
        tens.append(None if t is None else (n, tuple(t.shape), t.dtype, t.device, t.stride()))
    return (type(cache).__name__, *scalars, *tens)


def describe(cache, check_data: bool = True) -> QuantCacheInfo:
    """Validate a quantized cache (plan time; mixed precision checks block_bits with one host sync)."""
    from codesign.kernels.kv_quant_kivi import KiviPagedKV
    from codesign.kernels.kv_quant_mixed import MIXED_BITS, MixedPagedKV
    from codesign.kernels.kv_quant_oaken import OakenPagedKV
    from codesign.kernels.kv_quant_paged import QuantPagedKV, check_quant_cache

    base = ("k_codes", "v_codes", "k_meta", "v_meta")
    if isinstance(cache, QuantPagedKV):
        shape = check_quant_cache(cache)
        return QuantCacheInfo("kvq", shape, cache.kv_format, _sig(cache, base, (cache.fmt,)), True)
    if isinstance(cache, KiviPagedKV):
        shape = cache.check()
        sig = _sig(cache, base + ("k_res", "v_res"), (cache.bits, cache.group, cache.residual))
        return QuantCacheInfo("kivi", shape, cache.kv_format, sig, True)
    if isinstance(cache, OakenPagedKV):
        shape = cache.check()
        sig = _sig(cache, base + ("k_out", "v_out", "grid"), (cache.bits,))
        return QuantCacheInfo("oaken", shape, cache.kv_format, sig, False)
    if isinstance(cache, MixedPagedKV):
        shape = cache.check()
        if check_data:
            ok = torch.isin(
                cache.block_bits, torch.tensor(MIXED_BITS, dtype=torch.uint8).to(cache.block_bits.device)
            )
            if not bool(ok.all()):
                raise CodesignError(f"block_bits must all be in {MIXED_BITS}")
        return QuantCacheInfo("mixed", shape, None, _sig(cache, base + ("block_bits",), ()), False)
    raise CodesignError(
        f"the cache must be a tensor or one of {QUANT_CACHE_TYPES}, got {type(cache).__name__}"
    )


def check_plan(
    info: QuantCacheInfo, cache, block_tables: torch.Tensor, alibi_slopes, window, softcap
) -> None:
    """Plan-time checks beyond the geometry: Oaken and mixed attention take none of ALiBi, window and
    softcap; a KIVI cache needs a residual ring per block-table row."""
    if not info.full_features and (alibi_slopes is not None or window or softcap):
        raise CodesignError(f"{info.kind} caches support no alibi_slopes, window or softcap")
    if info.kind == "kivi" and block_tables.dim() == 2 and block_tables.shape[0] > cache.k_res.shape[0]:
        raise CodesignError(
            f"block_tables has {block_tables.shape[0]} rows but the cache {cache.k_res.shape[0]} residual rings"
        )


def signature(cache) -> tuple:
    """The run()-time signature (host-side attributes only)."""
    names = {
        "QuantPagedKV": (("k_codes", "v_codes", "k_meta", "v_meta"), ("fmt",)),
        "KiviPagedKV": (
            ("k_codes", "v_codes", "k_meta", "v_meta", "k_res", "v_res"),
            ("bits", "group", "residual"),
        ),
        "OakenPagedKV": (("k_codes", "v_codes", "k_meta", "v_meta", "k_out", "v_out", "grid"), ("bits",)),
        "MixedPagedKV": (("k_codes", "v_codes", "k_meta", "v_meta", "block_bits"), ()),
    }.get(type(cache).__name__)
    if names is None:
        raise CodesignError(f"the cache must be one of {QUANT_CACHE_TYPES}, got {type(cache).__name__}")
    return _sig(cache, names[0], tuple(getattr(cache, s) for s in names[1]))


def launch(info: QuantCacheInfo, q: torch.Tensor, cache, p: dict, is_decode: bool, want_lse: bool):
    """The functional entry point's op with the planned metadata `p`; returns (out, lse or None)."""
    tree = (p["positions"], p["tree_mask"], p["mask_indptr"])
    bt, cl, cu = p["block_tables"], p["context_lens"], p["cu"]
    common = (p["sm_scale"], p["window"], p["softcap"], p["num_splits"], is_decode, want_lse)
    if info.kind == "kvq":
        from codesign.kernels.kv_quant_paged import FORMATS, _attn_kvq_op

        kind, bits = FORMATS[cache.fmt]
        return _attn_kvq_op(q, cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta, bt, cl, cu, *tree,
                            p["alibi_slopes"], *common, kind, bits)  # fmt: skip
    if info.kind == "kivi":
        from codesign.kernels.kv_quant_kivi import _attn_kivi_op

        return _attn_kivi_op(q, cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta, cache.k_res,
                             cache.v_res, bt, cl, cu, *tree, p["alibi_slopes"], *common, cache.bits,
                             cache.group, cache.residual)  # fmt: skip
    if want_lse:
        raise CodesignError(f"{info.kind} cache attention returns no lse")
    if info.kind == "oaken":
        from codesign.kernels.kv_quant_oaken import _attn_oaken_op

        out = _attn_oaken_op(q, cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta, cache.k_out,
                             cache.v_out, bt, cl, cu, *tree, p["sm_scale"], p["num_splits"], is_decode,
                             cache.bits, cache.grid)  # fmt: skip
        return out, None
    from codesign.kernels.kv_quant_mixed import _attn_mixed_op

    out = _attn_mixed_op(q, cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta, cache.block_bits,
                         bt, cl, cu, *tree, p["sm_scale"], p["num_splits"], is_decode)  # fmt: skip
    return out, None
