"""Quantized KV caches behind the plan()/run() wrappers of `codesign.kernels.paged_attention`: one
description per cache type (what plan() validates once) and one launch per type (what run() does, with
no host sync), each calling the same torch op as the functional entry point, so a wrapper's output is
bit-identical to `kvq_*_attention`, `kivi_*_attention`, `oaken_attention` and `mixed_attention`.

Cache types: `QuantPagedKV` (per-token INT8/4/2, FP8 per head), `KiviPagedKV`, `OakenPagedKV` (both
metadata variants), `MixedPagedKV`; every type takes ALiBi, a window, softcap and returns lse on request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from codesign.specs import CodesignError, KVFormat

# Per cache type: the tensors and the scalar parameters its signature records.
_CODES = ("k_codes", "v_codes", "k_meta", "v_meta")
_LAYOUTS = {
    "QuantPagedKV": (_CODES, ("fmt",)),
    "KiviPagedKV": ((*_CODES, "k_res", "v_res"), ("bits", "group", "residual")),
    "OakenPagedKV": ((*_CODES, "k_out", "v_out", "grid"), ("bits",)),
    "MixedPagedKV": ((*_CODES, "block_bits"), ()),
}
QUANT_CACHE_TYPES = tuple(_LAYOUTS)


@dataclass(frozen=True)
class QuantCacheInfo:
    """What plan() learns about a quantized cache: its geometry, its format for the spec and a signature
    (every tensor's shape, dtype and device plus the scalar parameters) that run() compares without
    touching the data."""

    kind: str  # "kvq", "kivi", "oaken", "mixed"
    shape: tuple[int, int, int, int]  # (num_blocks, block_size, kv_heads, head_dim)
    kv_format: KVFormat | None  # None: mixed precision (varies per block)
    signature: tuple


def is_quant_cache(cache) -> bool:
    """True for any of the quantized cache dataclasses (by type, no import cycle)."""
    return type(cache).__name__ in QUANT_CACHE_TYPES


def signature(cache) -> tuple:
    """The cache's type, scalar parameters and every tensor's (name, shape, dtype, device, stride): what
    run() compares against the plan, from host-side attributes only."""
    layout = _LAYOUTS.get(type(cache).__name__)
    if layout is None:
        raise CodesignError(f"the cache must be one of {QUANT_CACHE_TYPES}, got {type(cache).__name__}")
    tens = []
    for n in layout[0]:
        t = getattr(cache, n)
        tens.append(None if t is None else (n, tuple(t.shape), t.dtype, t.device, t.stride()))
    return (type(cache).__name__, *(getattr(cache, s) for s in layout[1]), *tens)


def describe(cache, check_data: bool = True) -> QuantCacheInfo:
    """Validate a quantized cache (plan time; mixed precision checks block_bits with one host sync)."""
    from codesign.kernels.kv_quant_kivi import KiviPagedKV
    from codesign.kernels.kv_quant_mixed import MixedPagedKV
    from codesign.kernels.kv_quant_oaken import OakenPagedKV
    from codesign.kernels.kv_quant_paged import QuantPagedKV, check_quant_cache

    if isinstance(cache, QuantPagedKV):
        return QuantCacheInfo("kvq", check_quant_cache(cache), cache.kv_format, signature(cache))
    if isinstance(cache, KiviPagedKV):
        return QuantCacheInfo("kivi", cache.check(), cache.kv_format, signature(cache))
    if isinstance(cache, OakenPagedKV):
        return QuantCacheInfo("oaken", cache.check(), cache.kv_format, signature(cache))
    if isinstance(cache, MixedPagedKV):
        shape = cache.check()
        if check_data:
            cache.check_block_bits()
        return QuantCacheInfo("mixed", shape, None, signature(cache))
    raise CodesignError(
        f"the cache must be a tensor or one of {QUANT_CACHE_TYPES}, got {type(cache).__name__}"
    )


def check_plan(info: QuantCacheInfo, cache, block_tables: torch.Tensor) -> None:
    """Plan-time checks beyond the geometry: a KIVI cache needs a residual ring per block-table row."""
    if info.kind == "kivi":
        from codesign.kernels.kv_quant_kivi import check_rings

        check_rings(cache, block_tables)


def launch(info: QuantCacheInfo, q: torch.Tensor, cache, meta, want_lse: bool):
    """The functional entry point's op over the planned metadata `meta` (a `paged_attention.AttnMeta`,
    in the wrapper's buffers); returns (out, lse or None)."""
    from codesign.kernels.kv_quant_kivi import launch_kivi
    from codesign.kernels.kv_quant_mixed import launch_mixed
    from codesign.kernels.kv_quant_oaken import launch_oaken
    from codesign.kernels.kv_quant_paged import launch_kvq

    launcher = {"kvq": launch_kvq, "kivi": launch_kivi, "oaken": launch_oaken, "mixed": launch_mixed}
    return launcher[info.kind](q, cache, meta, want_lse)
