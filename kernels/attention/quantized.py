"""Attention over the quantized KV caches of `codesign.kernels.kvcache`: one `AttentionFormat` (and so one
torch op) per cache type, reading its codes in the attention kernel (dequantization fused in the inner loop,
no dequantized copy), and the entry points.

    QuantPagedKV (per-token INT8/4/2, FP8 per head)  codesign::paged_attention_kvq    kvq_*_attention
    KiviPagedKV                                       codesign::paged_attention_kivi   kivi_*_attention
    OakenPagedKV (both metadata variants)             codesign::paged_attention_oaken  oaken_attention
    MixedPagedKV (per-chunk INT8/4/2)                 codesign::paged_attention_mixed  mixed_attention

Every type takes the options of `paged_decode_attention` (ALiBi, a window, softcap, lse, splits); the
plan()/run() wrappers take each type through `format_of`. CPU tensors run the torch path (dequantize, then
`reference.paged_attention_torch`), CUDA tensors (or `use_backend("triton")`) the kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from codesign.kernels.attention.ops import PLAIN, AttentionFormat
from codesign.kernels.attention.paged import attend
from codesign.kernels.attention.reference import attention_per_sequence, paged_attention_torch
from codesign.kernels.attention.tree import TreeBatch
from codesign.kernels.attention.triton_attention import KernelKV
from codesign.kernels.kvcache.formats import (
    KV_FORMAT_KIVI,
    KV_FORMAT_OAKEN,
    KV_FORMAT_OAKEN_OFFLINE,
    kernel_format,
)
from codesign.kernels.kvcache.kivi import KiviPagedKV, check_rings
from codesign.kernels.kvcache.kvq import FORMATS, QuantPagedKV, check_quant_cache, dequantize_codes
from codesign.kernels.kvcache.mixed import MixedPagedKV
from codesign.kernels.kvcache.oaken import (
    OakenPagedKV,
    dense_zeros,
    dequantize_pool,
    index_width,
    outlier_index,
)
from codesign.specs import CodesignError, KVFormat

_CODES = ("k_codes", "v_codes", "k_meta", "v_meta")


def _require(cache: Any, cls: type, what: str) -> None:
    if not isinstance(cache, cls):
        raise CodesignError(f"cache must be {what}, got {type(cache).__name__}")


# --- per-token INT8/4/2 and FP8 (kvcache.kvq) -----------------------------------------------------------
def _kvq_torch(q, tensors, params, batch, opts):
    k_codes, v_codes, k_meta, v_meta = tensors
    fmt = next(n for n, v in FORMATS.items() if v == tuple(params))
    k, v = dequantize_codes(k_codes, k_meta, fmt), dequantize_codes(v_codes, v_meta, fmt)
    return paged_attention_torch(q, k, v, batch, opts)


KVQ = AttentionFormat(
    "paged_attention_kvq",
    _CODES,
    "SymInt kind, SymInt bits",
    lambda cache: FORMATS[cache.fmt],
    _kvq_torch,
    lambda q, t, params: KernelKV(t[0], t[1], params[0], params[1], t[2], t[3]),
    lambda cache, block_tables, check_data, expect=None: check_quant_cache(cache, expect, check_data),
    signature_fields=("fmt",),
)


# --- KIVI (kvcache.kivi) ------------------------------------------------------------------------------
def _kivi_check(cache, block_tables, check_data, expect=None):
    _require(cache, KiviPagedKV, "a KiviPagedKV")
    shape = cache.check()
    check_rings(cache, block_tables)
    return shape


def _kivi_torch(q, tensors, params, batch, opts):
    # Per sequence, its tokens (codes + ring) dequantized to q's dtype (as the kernel's tiles).
    cache = KiviPagedKV(*params, q.shape[2], *tensors)

    def gather(b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(x.to(q.dtype) for x in cache.dequantize_seq(b, batch.block_tables[b], n))

    return attention_per_sequence(q, gather, batch, opts)


def _kivi_kernel(q, tensors, params):
    bits, group, residual = params
    kivi = (group, min(group, q.shape[2]), residual)
    return KernelKV(tensors[0], tensors[1], KV_FORMAT_KIVI, bits, tensors[2], tensors[3], tensors[4], tensors[5],
                    kivi=kivi)  # fmt: skip


KIVI = AttentionFormat(
    "paged_attention_kivi",
    (*_CODES, "k_res", "v_res"),
    "SymInt bits, SymInt group, SymInt residual",
    lambda cache: (cache.bits, cache.group, cache.residual),
    _kivi_torch,
    _kivi_kernel,
    _kivi_check,
    signature_fields=("bits", "group", "residual"),
)


# --- Oaken (kvcache.oaken) -----------------------------------------------------------------------------
def _oaken_check(cache, block_tables, check_data, expect=None):
    _require(cache, OakenPagedKV, "an OakenPagedKV")
    shape = cache.check(values=check_data)
    cache.ensure_index()  # allocated before a plan records its signature
    return shape


def _oaken_params(cache):
    """The op's parameters: bits, the grid and the kept outlier index, brought up to date first (host-side:
    rebuilt whole only when not current, `OakenPagedKV.ensure_index`)."""
    return (cache.bits, cache.grid, *cache.ensure_index())


def _oaken_torch(q, tensors, params, batch, opts):
    bits, grid = (*params, None)[:2]  # the op's grid defaults to None; the torch path reads the slots
    k_codes, v_codes, k_meta, v_meta, k_out, v_out = tensors
    kg, vg = (None, None) if grid is None else (grid[0], grid[1])
    # each outlier as the kernel's index holds it (`oaken.index_delta`), so both backends compute one function
    k = dequantize_pool(k_codes, k_meta, k_out, bits, kg, as_read=True)
    v = dequantize_pool(v_codes, v_meta, v_out, bits, vg, as_read=True)
    return paged_attention_torch(q, k, v, batch, opts)


def _oaken_kernel(q, tensors, params):
    """The kernel reads the outlier index (k_side, v_side), not the slots: the cache's kept one, or, for a
    caller of the op that passes none, one built here from the slots."""
    bits, grid, kix, vix = (*params, None, None, None)[:4]
    code = KV_FORMAT_OAKEN if grid is None else KV_FORMAT_OAKEN_OFFLINE
    k_codes, v_codes, k_meta, v_meta, k_out, v_out = tensors
    bs, d = k_codes.shape[1], q.shape[2]
    for name, ix, slots in (("k_index", kix, k_out), ("v_index", vix, v_out)):
        want = (*slots.shape[:2], index_width(slots.shape[2], bs, d))
        if ix is not None and (tuple(ix.shape) != want or ix.dtype != torch.int32 or not ix.is_contiguous()):
            raise CodesignError(f"{name} must be a contiguous int32 tensor of shape {want} (the slots' outlier "
                                f"index), got {ix.dtype} {tuple(ix.shape)}")  # fmt: skip
    kg, vg = (None, None) if grid is None else (grid[0], grid[1])
    kix = outlier_index(k_out, bs, d, "token", zeros=dense_zeros(k_meta, kg)) if kix is None else kix
    vix = outlier_index(v_out, bs, d, "channel", zeros=dense_zeros(v_meta, vg)) if vix is None else vix
    return KernelKV(k_codes, v_codes, code, bits, k_meta, v_meta, kix, vix, block_bits=grid)


OAKEN = AttentionFormat(
    "paged_attention_oaken",
    (*_CODES, "k_out", "v_out"),
    "SymInt bits, Tensor? grid=None, Tensor? k_index=None, Tensor? v_index=None",
    _oaken_params,
    _oaken_torch,
    _oaken_kernel,
    _oaken_check,
    signature_fields=("bits",),
    signature_tensors=(*_CODES, "k_out", "v_out", "grid", "k_index", "v_index"),
)


# --- mixed precision (kvcache.mixed) -------------------------------------------------------------------
def _mixed_check(cache, block_tables, check_data, expect=None):
    _require(cache, MixedPagedKV, "a MixedPagedKV")
    shape = cache.check()
    if check_data:
        cache.check_block_bits()
    return shape


def _mixed_torch(q, tensors, params, batch, opts):
    k, v = MixedPagedKV(q.shape[2], *tensors).dequantize()
    return paged_attention_torch(q, k, v, batch, opts)


MIXED = AttentionFormat(
    "paged_attention_mixed",
    (*_CODES, "block_bits"),
    "",
    lambda cache: (),
    _mixed_torch,
    lambda q, t, params: KernelKV(t[0], t[1], *kernel_format(KVFormat.parse("mixed")), t[2], t[3], block_bits=t[4]),
    _mixed_check,
)

_BY_TYPE = {QuantPagedKV: KVQ, KiviPagedKV: KIVI, OakenPagedKV: OAKEN, MixedPagedKV: MIXED}
QUANT_CACHE_TYPES = tuple(_BY_TYPE)


def format_of(cache: Any) -> AttentionFormat:
    """The attention format of a cache: `ops.PLAIN` for a tensor, else its quantized cache type's."""
    if isinstance(cache, torch.Tensor):
        return PLAIN
    fmt = _BY_TYPE.get(type(cache))
    if fmt is None:
        names = tuple(t.__name__ for t in QUANT_CACHE_TYPES)
        raise CodesignError(f"the cache must be a tensor or one of {names}, got {type(cache).__name__}")
    return fmt


# --- entry points ----------------------------------------------------------------------------------------
def kvq_decode_attention(
    q: torch.Tensor, cache: QuantPagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor, *,
    fmt: str | None = None, **options: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`paged_decode_attention` over a quantized cache (same keywords, plus `fmt=` to assert the format)."""
    return attend(KVQ, q, cache, block_tables, context_lens, None, None, options, fmt)


def kvq_extend_attention(
    q: torch.Tensor, cache: QuantPagedKV, block_tables: torch.Tensor, context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor, *, fmt: str | None = None, **options: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`paged_extend_attention` over a quantized cache."""
    return attend(KVQ, q, cache, block_tables, context_lens, cu_seqlens_q, None, options, fmt)


def kvq_tree_attention(
    q: torch.Tensor, cache: QuantPagedKV, block_tables: torch.Tensor, tree: TreeBatch, *,
    fmt: str | None = None, **options: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`tree_attention` over a quantized cache."""
    return attend(KVQ, q, cache, block_tables, None, None, tree, options, fmt)


def kivi_decode_attention(q, cache: KiviPagedKV, block_tables, context_lens, **options):
    """`paged_decode_attention` over a KIVI cache (same keywords)."""
    return attend(KIVI, q, cache, block_tables, context_lens, None, None, options)


def kivi_extend_attention(q, cache: KiviPagedKV, block_tables, context_lens, cu_seqlens_q, **options):
    """`paged_extend_attention` over a KIVI cache."""
    return attend(KIVI, q, cache, block_tables, context_lens, cu_seqlens_q, None, options)


def kivi_tree_attention(q, cache: KiviPagedKV, block_tables, tree: TreeBatch, **options):
    """`tree_attention` over a KIVI cache."""
    return attend(KIVI, q, cache, block_tables, None, None, tree, options)


def oaken_attention(
    q: torch.Tensor,
    cache: OakenPagedKV,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    *,
    tree: TreeBatch | None = None,
    **options: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode (cu_seqlens_q None), extend, or tree attention (`tree=`, a `build_tree_batch` result) over
    an Oaken cache, the sparse outliers applied in the kernel; the keywords of `paged_decode_attention`
    (sm_scale, alibi_slopes, window, softcap, num_splits, return_lse, check_data, sinks)."""
    return attend(OAKEN, q, cache, block_tables, context_lens, cu_seqlens_q, tree, options)


def mixed_attention(
    q: torch.Tensor,
    cache: MixedPagedKV,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    *,
    tree: TreeBatch | None = None,
    **options: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode (cu_seqlens_q None: one query per sequence), extend, or tree attention (`tree=`, a
    `build_tree_batch` result; context_lens / cu_seqlens_q are then taken from it) over a mixed cache; the
    keywords of `paged_decode_attention` (sm_scale, alibi_slopes, window, softcap, num_splits, return_lse,
    check_data, sinks)."""
    return attend(MIXED, q, cache, block_tables, context_lens, cu_seqlens_q, tree, options)
