"""Attention over the quantized KV caches of `codesign.kernels.kvcache`: one torch op per cache type reading
its codes in the attention kernel (dequantization fused in the inner loop), its entry points, and what the
plan()/run() wrappers need of each type (a description plan() validates once, a launch run() calls).

Cache types: `QuantPagedKV` (per-token INT8/4/2, FP8 per head; `codesign::paged_attention_kvq`),
`KiviPagedKV` (`_kivi`), `OakenPagedKV` (both metadata variants; `_oaken`), `MixedPagedKV` (`_mixed`);
every type takes ALiBi, a window, softcap and returns lse on request. CPU tensors run the torch path
(dequantize, then `paged_attention_torch`), CUDA tensors (or `use_backend("triton")`) the kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from codesign.kernels.attention.paged import (
    NO_TREE,
    AttnMeta,
    alloc_lse,
    attention_backend,
    attention_per_sequence,
    paged_attention_torch,
    prepare_launch,
    triton_attention,
)
from codesign.kernels.attention.tree import TreeBatch, check_tree_batch
from codesign.kernels.kvcache.checks import geometry_probe
from codesign.kernels.kvcache.formats import (
    KV_FORMAT_KIVI,
    KV_FORMAT_MIXED,
    KV_FORMAT_OAKEN,
    KV_FORMAT_OAKEN_OFFLINE,
)
from codesign.kernels.kvcache.kivi import KiviPagedKV, check_rings
from codesign.kernels.kvcache.kvq import FORMATS, QuantPagedKV, check_quant_cache, dequantize_codes
from codesign.kernels.kvcache.mixed import MixedPagedKV
from codesign.kernels.kvcache.oaken import OakenPagedKV, dequantize_pool
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
    kv_format: KVFormat
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
        return QuantCacheInfo("mixed", shape, cache.kv_format, signature(cache))
    raise CodesignError(
        f"the cache must be a tensor or one of {QUANT_CACHE_TYPES}, got {type(cache).__name__}"
    )


def check_plan(info: QuantCacheInfo, cache, block_tables: torch.Tensor) -> None:
    """Plan-time checks beyond the geometry: a KIVI cache needs a residual ring per block-table row."""
    if info.kind == "kivi":
        check_rings(cache, block_tables)


def launch(info: QuantCacheInfo, q: torch.Tensor, cache, meta, want_lse: bool):
    """The functional entry point's op over the planned metadata `meta` (an `attention.paged.AttnMeta`,
    in the wrapper's buffers); returns (out, lse or None)."""
    launcher = {"kvq": launch_kvq, "kivi": launch_kivi, "oaken": launch_oaken, "mixed": launch_mixed}
    return launcher[info.kind](q, cache, meta, want_lse)


# --- per-token INT8/4/2 and FP8 (kvcache.kvq) -----------------------------------------------------------
@torch.library.custom_op("codesign::paged_attention_kvq", mutates_args=())
def _attn_kvq_op(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_meta: torch.Tensor,
    v_meta: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    positions: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sm_scale: float,
    window: int,
    softcap: float,
    num_splits: int,
    is_decode: bool,
    return_lse: bool,
    kind: int,
    bits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    meta = AttnMeta(block_tables, context_lens, cu_seqlens_q, positions, tree_mask, mask_indptr,
                    alibi_slopes, sm_scale, window, softcap, num_splits, is_decode)  # fmt: skip
    if attention_backend(q) == "torch":
        # CPU reference path: dequantize the pool, then plain attention.
        fmt = next(n for n, v in FORMATS.items() if v == (kind, bits))
        k, v = dequantize_codes(k_codes, k_meta, fmt), dequantize_codes(v_codes, v_meta, fmt)
        return paged_attention_torch(q, k, v, meta, return_lse)
    return triton_attention(q, k_codes, v_codes, meta, return_lse, kv_format=kind, bits=bits,
                            k_scale=k_meta, v_scale=v_meta)  # fmt: skip


@_attn_kvq_op.register_fake
def _(q, *rest):
    return torch.empty_like(q), alloc_lse(q, rest[-3])  # rest[-3]: return_lse


def prepare_attention(
    q: torch.Tensor,
    cache_shape: tuple[int, int, int, int],
    device: torch.device,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    tree: TreeBatch | None,
    kw: dict,
) -> AttnMeta:
    """`prepare_launch` for a quantized cache of `cache_shape` on `device` (every format): its geometry is
    checked through a `geometry_probe`, so no dequantized copy is ever made.

    `tree` (a TreeBatch) replaces context_lens / cu_seqlens_q; otherwise cu_seqlens_q None means decode.
    kw: the entry point's keywords (`prepare_launch`'s opts).
    """
    if not isinstance(q, torch.Tensor):
        raise CodesignError(f"q must be a tensor, got {type(q).__name__}")
    probe = geometry_probe(cache_shape, q.dtype, device)
    tree_args = NO_TREE
    if tree is not None:
        if not isinstance(tree, TreeBatch):
            raise CodesignError(f"tree must be a TreeBatch (build_tree_batch), got {type(tree).__name__}")
        check_tree_batch(tree, q, block_tables)
        context_lens, cu_seqlens_q, tree_args = tree.context_lens, tree.cu_seqlens_q, tree.mask_args
    return prepare_launch(q, probe, probe, block_tables, context_lens, cu_seqlens_q, tree_args, kw)


def attend_quant(
    launch: Callable[[torch.Tensor, object, AttnMeta, bool], tuple[torch.Tensor, torch.Tensor | None]],
    q: torch.Tensor,
    cache,
    cache_shape: tuple[int, int, int, int],
    block_tables: torch.Tensor,
    context_lens: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    tree: TreeBatch | None,
    kw: dict,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The quantized-cache entry points' shared body (the cache already validated, `cache_shape` its
    geometry): `prepare_attention`, then `launch(q, cache, meta, return_lse)`, the format's op; out, or
    (out, lse) when kw["return_lse"]."""
    meta = prepare_attention(
        q, cache_shape, cache.k_codes.device, block_tables, context_lens, cu_seqlens_q, tree, kw
    )
    return_lse = bool(kw.get("return_lse", False))
    out, lse = launch(q, cache, meta, return_lse)
    return (out, lse) if return_lse else out


def launch_kvq(
    q: torch.Tensor, cache: QuantPagedKV, meta: AttnMeta, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op over a validated cache with a launch's metadata (entry points and plan()/run() wrappers)."""
    kind, bits = FORMATS[cache.fmt]
    return _attn_kvq_op(q, cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta, *meta, return_lse,
                        kind, bits)  # fmt: skip


def _attend_kvq(q, cache, block_tables, context_lens, cu, tree, kw) -> torch.Tensor | tuple:
    shape = check_quant_cache(cache, kw.pop("fmt", None))
    return attend_quant(launch_kvq, q, cache, shape, block_tables, context_lens, cu, tree, kw)


def kvq_decode_attention(
    q: torch.Tensor, cache: QuantPagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor, **kw
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`paged_decode_attention` over a quantized cache (same keywords, plus `fmt=` to assert the format)."""
    return _attend_kvq(q, cache, block_tables, context_lens, None, None, kw)


def kvq_extend_attention(
    q: torch.Tensor,
    cache: QuantPagedKV,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    **kw,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`paged_extend_attention` over a quantized cache."""
    return _attend_kvq(q, cache, block_tables, context_lens, cu_seqlens_q, None, kw)


def kvq_tree_attention(
    q: torch.Tensor, cache: QuantPagedKV, block_tables: torch.Tensor, tree: TreeBatch, **kw
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`tree_attention` over a quantized cache."""
    return _attend_kvq(q, cache, block_tables, None, None, tree, kw)


# --- KIVI (kvcache.kivi) ------------------------------------------------------------------------------
@torch.library.custom_op("codesign::paged_attention_kivi", mutates_args=())
def _attn_kivi_op(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_meta: torch.Tensor,
    v_meta: torch.Tensor,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    positions: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sm_scale: float,
    window: int,
    softcap: float,
    num_splits: int,
    is_decode: bool,
    return_lse: bool,
    bits: int,
    group: int,
    residual: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    meta = AttnMeta(block_tables, context_lens, cu_seqlens_q, positions, tree_mask, mask_indptr,
                    alibi_slopes, sm_scale, window, softcap, num_splits, is_decode)  # fmt: skip
    d = q.shape[2]
    if attention_backend(q) == "torch":
        # CPU path: per sequence, its tokens (codes + ring) dequantized to q's dtype (as the kernel's tiles).
        cache = KiviPagedKV(bits, group, residual, d, k_codes, v_codes, k_meta, v_meta, k_res, v_res)

        def gather(b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return tuple(x.to(q.dtype) for x in cache.dequantize_seq(b, block_tables[b], n))

        return attention_per_sequence(q, gather, meta, return_lse)
    kivi = (k_res, v_res, group, min(group, d), residual)
    return triton_attention(q, k_codes, v_codes, meta, return_lse, kv_format=KV_FORMAT_KIVI, bits=bits,
                            k_scale=k_meta, v_scale=v_meta, kivi=kivi)  # fmt: skip


@_attn_kivi_op.register_fake
def _(q, *rest):
    return torch.empty_like(q), alloc_lse(q, rest[-4])  # rest[-4]: return_lse


def launch_kivi(
    q: torch.Tensor, cache: KiviPagedKV, meta: AttnMeta, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op over a validated cache with a launch's metadata (entry points and plan()/run() wrappers)."""
    c = cache
    return _attn_kivi_op(q, c.k_codes, c.v_codes, c.k_meta, c.v_meta, c.k_res, c.v_res, *meta, return_lse,
                         c.bits, c.group, c.residual)  # fmt: skip


def _attend_kivi(q, cache, block_tables, context_lens, cu, tree, kw):
    if not isinstance(cache, KiviPagedKV):
        raise CodesignError(f"cache must be a KiviPagedKV, got {type(cache).__name__}")
    shape = cache.check()
    check_rings(cache, block_tables)
    return attend_quant(launch_kivi, q, cache, shape, block_tables, context_lens, cu, tree, kw)


def kivi_decode_attention(q, cache: KiviPagedKV, block_tables, context_lens, **kw):
    """`paged_decode_attention` over a KIVI cache (same keywords)."""
    return _attend_kivi(q, cache, block_tables, context_lens, None, None, kw)


def kivi_extend_attention(q, cache: KiviPagedKV, block_tables, context_lens, cu_seqlens_q, **kw):
    """`paged_extend_attention` over a KIVI cache."""
    return _attend_kivi(q, cache, block_tables, context_lens, cu_seqlens_q, None, kw)


def kivi_tree_attention(q, cache: KiviPagedKV, block_tables, tree: TreeBatch, **kw):
    """`tree_attention` over a KIVI cache."""
    return _attend_kivi(q, cache, block_tables, None, None, tree, kw)


# --- Oaken (kvcache.oaken) -----------------------------------------------------------------------------
@torch.library.custom_op("codesign::paged_attention_oaken", mutates_args=())
def _attn_oaken_op(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_meta: torch.Tensor,
    v_meta: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    positions: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sm_scale: float,
    window: int,
    softcap: float,
    num_splits: int,
    is_decode: bool,
    return_lse: bool,
    bits: int,
    grid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    meta = AttnMeta(block_tables, context_lens, cu_seqlens_q, positions, tree_mask, mask_indptr,
                    alibi_slopes, sm_scale, window, softcap, num_splits, is_decode)  # fmt: skip
    if attention_backend(q) == "torch":
        kg, vg = (None, None) if grid is None else (grid[0], grid[1])
        k = dequantize_pool(k_codes, k_meta, k_out, bits, kg)
        v = dequantize_pool(v_codes, v_meta, v_out, bits, vg)
        return paged_attention_torch(q, k, v, meta, return_lse)
    fmt = KV_FORMAT_OAKEN if grid is None else KV_FORMAT_OAKEN_OFFLINE
    return triton_attention(q, k_codes, v_codes, meta, return_lse, kv_format=fmt, bits=bits, k_scale=k_meta,
                            v_scale=v_meta, oaken=(k_out, v_out), block_bits=grid)  # fmt: skip


@_attn_oaken_op.register_fake
def _(q, k_codes, v_codes, k_meta, v_meta, k_out, v_out, block_tables, context_lens, cu_seqlens_q, positions,
      tree_mask, mask_indptr, alibi_slopes, sm_scale, window, softcap, num_splits, is_decode, return_lse, bits,
      grid=None):  # fmt: skip
    return torch.empty_like(q), alloc_lse(q, return_lse)


def launch_oaken(
    q: torch.Tensor, cache: OakenPagedKV, meta: AttnMeta, return_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op over a validated cache with a launch's metadata (entry point and plan()/run() wrappers)."""
    c = cache
    return _attn_oaken_op(q, c.k_codes, c.v_codes, c.k_meta, c.v_meta, c.k_out, c.v_out, *meta, return_lse,
                          c.bits, c.grid)  # fmt: skip


def oaken_attention(
    q: torch.Tensor,
    cache: OakenPagedKV,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    *,
    tree: TreeBatch | None = None,
    **kw,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode (cu_seqlens_q None), extend, or tree attention (`tree=`, a `build_tree_batch` result) over
    an Oaken cache, the sparse outliers applied in the kernel; the keywords of `paged_decode_attention`
    (sm_scale, alibi_slopes, window, softcap, num_splits, return_lse, check_data)."""
    if not isinstance(cache, OakenPagedKV):
        raise CodesignError(f"cache must be an OakenPagedKV, got {type(cache).__name__}")
    return attend_quant(
        launch_oaken, q, cache, cache.check(), block_tables, context_lens, cu_seqlens_q, tree, kw
    )


# --- mixed precision (kvcache.mixed) -------------------------------------------------------------------
@torch.library.custom_op("codesign::paged_attention_mixed", mutates_args=())
def _attn_mixed_op(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_meta: torch.Tensor,
    v_meta: torch.Tensor,
    block_bits: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    positions: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sm_scale: float,
    window: int,
    softcap: float,
    num_splits: int,
    is_decode: bool,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    meta = AttnMeta(block_tables, context_lens, cu_seqlens_q, positions, tree_mask, mask_indptr,
                    alibi_slopes, sm_scale, window, softcap, num_splits, is_decode)  # fmt: skip
    if attention_backend(q) == "torch":
        k, v = MixedPagedKV(q.shape[2], k_codes, v_codes, k_meta, v_meta, block_bits).dequantize()
        return paged_attention_torch(q, k, v, meta, return_lse)
    return triton_attention(q, k_codes, v_codes, meta, return_lse, kv_format=KV_FORMAT_MIXED, bits=8,
                            k_scale=k_meta, v_scale=v_meta, block_bits=block_bits)  # fmt: skip


@_attn_mixed_op.register_fake
def _(q, *rest):
    return torch.empty_like(q), alloc_lse(q, rest[-1])  # rest[-1]: return_lse


def launch_mixed(
    q: torch.Tensor, cache: MixedPagedKV, meta: AttnMeta, return_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op over a validated cache with a launch's metadata (entry point and plan()/run() wrappers)."""
    return _attn_mixed_op(q, cache.k_codes, cache.v_codes, cache.k_meta, cache.v_meta, cache.block_bits,
                          *meta, return_lse)  # fmt: skip


def mixed_attention(
    q: torch.Tensor,
    cache: MixedPagedKV,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    *,
    tree: TreeBatch | None = None,
    **kw,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode (cu_seqlens_q None: one query per sequence), extend, or tree attention (`tree=`, a
    `build_tree_batch` result; context_lens / cu_seqlens_q are then taken from it) over a mixed cache; the
    keywords of `paged_decode_attention` (sm_scale, alibi_slopes, window, softcap, num_splits, return_lse,
    check_data)."""
    if not isinstance(cache, MixedPagedKV):
        raise CodesignError(f"cache must be a MixedPagedKV, got {type(cache).__name__}")
    shape = cache.check()
    if kw.get("check_data", True):
        cache.check_block_bits()
    return attend_quant(launch_mixed, q, cache, shape, block_tables, context_lens, cu_seqlens_q, tree, kw)
