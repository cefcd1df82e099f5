"""Paged attention as torch ops: decode, extend (chunked prefill) and the shared core used by tree
attention; a plain-torch CPU implementation; FlashInfer-style `plan()` / `run()` wrappers.

One op, `codesign::paged_attention`, covers every kind (see `paged_attention_triton` for the
formula): q `[T, Hq, D]` holds the new tokens of all sequences back to back (cu_seqlens_q int32
`[B+1]`), whose K/V are already in the paged cache, so context_lens counts them. Decode is the
case of one token per sequence. CUDA tensors run the Triton kernel, CPU tensors plain torch;
`codesign.backend.use_backend("triton")` forces the kernel (the interpreter on CPU).

Every check that raises CodesignError runs before a launch. The data checks (block ids inside the
pool, rows long enough, lengths) need one host sync: functional calls do them by default
(`check_data=True`); the wrappers do them once in `plan()` so that `run()` never syncs.

The wrappers also take the quantized caches of `kv_quant_paged` / `kv_quant_kivi` / `kv_quant_oaken` /
`kv_quant_mixed` in place of `k_cache` (v_cache None): plan() validates the cache once (`plan(...,
q_dtype=)` says q's dtype), run() checks only host-side attributes and calls the same op as the
functional entry point (`kv_quant_dispatch`), so the outputs are bit-identical.

Shared with the quantized caches' entry points and ops: `prepare_launch` (every check and launch choice,
returning an `AttnMeta`, the launch metadata in the ops' argument order), `attention_backend`,
`paged_attention_torch` / `attention_per_sequence` (the torch path) and `triton_attention` (the kernel path).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from codesign.backend import device_view, resolve_backend
from codesign.kernels.kvcache.checks import check_block_tables, check_int_tensor, check_kv_cache
from codesign.specs import CodesignError

OP = "paged_attention"
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SPEC_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


# --- validation ------------------------------------------------------------------------------------
def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    window: int | None,
    softcap: float | None,
    check_data: bool,
) -> None:
    """Shape, dtype and device checks; with `check_data` also the data checks (one host sync)."""
    nb, bs, hkv, dim = check_kv_cache(k_cache, v_cache)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise CodesignError(
            f"q must be a 3-D tensor [tokens, q_heads, head_dim], got {getattr(q, 'shape', q)}"
        )
    if q.dtype not in Q_DTYPES:
        raise CodesignError(f"q dtype must be one of {Q_DTYPES}, got {q.dtype}")
    if q.dtype != k_cache.dtype:
        raise CodesignError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    if q.device != k_cache.device:
        raise CodesignError(f"q is on {q.device} but the cache is on {k_cache.device}")
    if q.shape[2] != dim:
        raise CodesignError(f"q head_dim {q.shape[2]} != cache head_dim {dim}")
    if q.stride(-1) != 1:
        raise CodesignError("q must be contiguous along head_dim")
    hq = q.shape[1]
    if hq == 0 or hq % hkv:
        raise CodesignError(f"q_heads={hq} must be a positive multiple of kv_heads={hkv}")
    check_int_tensor("block_tables", block_tables, 2, k_cache.device)
    check_int_tensor("context_lens", context_lens, 1, k_cache.device)
    b = block_tables.shape[0]
    if context_lens.shape[0] != b:
        raise CodesignError(f"context_lens has {context_lens.shape[0]} entries, block_tables {b} rows")
    if cu_seqlens_q is not None:
        check_int_tensor("cu_seqlens_q", cu_seqlens_q, 1, k_cache.device)
        if cu_seqlens_q.shape[0] != b + 1:
            raise CodesignError(
                f"cu_seqlens_q must have batch + 1 = {b + 1} entries, got {cu_seqlens_q.shape[0]}"
            )
    elif q.shape[0] != b:
        raise CodesignError(
            f"decode takes one query per sequence: q has {q.shape[0]} tokens for {b} sequences"
        )
    if alibi_slopes is not None:
        if alibi_slopes.dtype != torch.float32 or tuple(alibi_slopes.shape) != (hq,):
            raise CodesignError(
                f"alibi_slopes must be float32 of shape ({hq},), got {alibi_slopes.dtype} "
                f"{tuple(alibi_slopes.shape)}"
            )
        if alibi_slopes.device != q.device:
            raise CodesignError(f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise CodesignError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and not (
        isinstance(softcap, int | float) and math.isfinite(softcap) and softcap > 0
    ):
        raise CodesignError(f"softcap must be a positive finite number or None, got {softcap!r}")
    if check_data:
        check_block_tables(block_tables, context_lens, nb, bs)
        lens = context_lens.cpu()
        if cu_seqlens_q is None:
            short = lens < 1
            if short.any():
                i = int(torch.nonzero(short)[0])
                raise CodesignError(
                    f"context_lens[{i}]={int(lens[i])}: decode needs >= 1 (the query's own token)"
                )
        else:
            cu = cu_seqlens_q.cpu()
            ql = cu[1:] - cu[:-1]
            if cu[0] != 0 or (ql < 0).any() or cu[-1] != q.shape[0]:
                raise CodesignError(
                    f"cu_seqlens_q must start at 0, not decrease and end at {q.shape[0]} "
                    f"(the tokens in q), got {cu.tolist()}"
                )
            bad = lens < ql
            if bad.any():
                i = int(torch.nonzero(bad)[0])
                raise CodesignError(
                    f"context_lens[{i}]={int(lens[i])} < its {int(ql[i])} new tokens "
                    "(context_lens counts the new tokens, already written to the cache)"
                )


def check_backend_dtype(backend: str, q: torch.Tensor) -> None:
    """bf16 Triton kernels only on a GPU: the interpreter computes bf16 on raw bits."""
    if backend == "triton" and q.dtype == torch.bfloat16 and not device_view(q.device).compiled:
        raise CodesignError(
            "bf16 paged attention with the Triton backend needs a GPU (the interpreter mishandles bf16)"
        )


def attention_backend(q: torch.Tensor) -> str:
    """The backend ("torch" or "triton") every attention op runs on for q, after `check_backend_dtype`.

    Called inside the ops, not in the Python entry points, so torch.compile traces those (the backend
    choice reads a ContextVar, which dynamo cannot trace)."""
    backend = resolve_backend(OP, q.device)
    check_backend_dtype(backend, q)
    return backend


# --- launch metadata --------------------------------------------------------------------------------
class AttnMeta(NamedTuple):
    """One launch's batch metadata and options, in the order every attention op takes them after its
    cache tensors: `op(q, <cache tensors>, *meta, return_lse, <format scalars>)`."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor  # decode: 0, 1, ..., B (one query per sequence)
    positions: torch.Tensor | None  # positions, tree_mask, mask_indptr: tree verification only
    tree_mask: torch.Tensor | None
    mask_indptr: torch.Tensor | None
    alibi_slopes: torch.Tensor | None
    sm_scale: float
    window: int  # 0: no window
    softcap: float  # 0.0: no soft cap
    num_splits: int
    is_decode: bool


NO_TREE = (None, None, None)  # tree_args outside tree verification


def alloc_lse(q: torch.Tensor, return_lse: bool) -> torch.Tensor:
    """Every attention op's second output: lse fp32 `[tokens, q_heads]`, or `[0, q_heads]` when not asked."""
    return torch.empty(q.shape[0] if return_lse else 0, q.shape[1], dtype=torch.float32, device=q.device)


# --- CPU implementation (plain torch) --------------------------------------------------------------
def attention_per_sequence(
    q: torch.Tensor,
    gather: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    meta: AttnMeta,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference-style attention in fp32, sequence by sequence: `gather(b, n)` returns sequence b's first
    n keys and values `[n, kv_heads, head_dim]` (meta.block_tables is not read: gather owns the layout)."""
    _, hq, dim = q.shape
    out, lse = torch.empty_like(q), alloc_lse(q, return_lse)
    cu = meta.cu_seqlens_q.tolist()
    lens = meta.context_lens.tolist()
    tree_mask, mask_indptr, alibi_slopes = meta.tree_mask, meta.mask_indptr, meta.alibi_slopes
    softcap, window = meta.softcap, meta.window
    for b, kl in enumerate(lens):
        q0, q1 = cu[b], cu[b + 1]
        ql = q1 - q0
        if ql == 0:
            continue
        prefix = kl - ql
        k, v = (x.float() for x in gather(b, kl))
        hkv = k.shape[1]
        # Query head h reads kv head h // group: view q as [tokens, kv_heads, group, dim] (no K/V copies).
        qg = q[q0:q1].float().view(ql, hkv, hq // hkv, dim)
        s = torch.einsum("qhgd,khd->hgqk", qg, k).reshape(hq, ql, kl) * meta.sm_scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        kpos = torch.arange(kl, device=q.device)
        if tree_mask is not None:
            qpos = meta.positions[q0:q1].long()
            kpos = torch.cat([kpos[:prefix], qpos])
            m = tree_mask[int(mask_indptr[b]) : int(mask_indptr[b + 1])].view(ql, ql).bool()
            vis = torch.cat([torch.ones(ql, prefix, dtype=torch.bool, device=q.device), m], dim=1)
        else:
            qpos = prefix + torch.arange(ql, device=q.device)
            vis = kpos[None, :] <= qpos[:, None]
        if window:
            vis = vis & ((qpos[:, None] - kpos[None, :]) < window)
        if alibi_slopes is not None:
            s = s + alibi_slopes[:, None, None] * (kpos[None, :] - qpos[:, None]).float()
        s = s.masked_fill(~vis, float("-inf"))
        p = torch.softmax(s, dim=-1).view(hkv, hq // hkv, ql, kl)
        out[q0:q1] = torch.einsum("hgqk,khd->qhgd", p, v).reshape(ql, hq, dim).to(q.dtype)
        if return_lse:
            lse[q0:q1] = torch.logsumexp(s, dim=-1).transpose(0, 1)
    return out, lse


def paged_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of every attention op over a paged cache `[blocks, block_size, kv_heads, head_dim]`
    (a dequantized one is cast to q's dtype first, as the kernel casts each tile): gather each
    sequence's blocks, then `attention_per_sequence`."""
    bs = k_cache.shape[1]
    k_cache, v_cache = k_cache.to(q.dtype), v_cache.to(q.dtype)

    def gather(b: int, kl: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = meta.block_tables[b, : -(-kl // bs)].long()
        return tuple(c[blocks].reshape(-1, *c.shape[2:])[:kl] for c in (k_cache, v_cache))

    return attention_per_sequence(q, gather, meta, return_lse)


def triton_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMeta,
    return_lse: bool,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    **kernel_kw,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of every attention op: `paged_attention_triton` into out / lse (allocated when
    None); kernel_kw: the cache format's arguments, or the wrapper's planned workspace and config."""
    from codesign.kernels.attention.triton_attention import paged_attention_triton

    out = torch.empty_like(q) if out is None else out
    lse = alloc_lse(q, return_lse) if lse is None else lse
    m = meta
    paged_attention_triton(
        q,
        k_cache,
        v_cache,
        m.block_tables,
        m.context_lens,
        m.cu_seqlens_q,
        out,
        lse if return_lse else None,
        sm_scale=m.sm_scale,
        num_splits=m.num_splits,
        is_decode=m.is_decode,
        positions=m.positions,
        tree_mask=m.tree_mask,
        mask_indptr=m.mask_indptr,
        alibi_slopes=m.alibi_slopes,
        window=m.window,
        softcap=m.softcap,
        **kernel_kw,
    )
    return out, lse


# --- the torch op ------------------------------------------------------------------------------------
@torch.library.custom_op("codesign::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
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
        return paged_attention_torch(q, k_cache, v_cache, meta, return_lse)
    return triton_attention(q, k_cache, v_cache, meta, return_lse)


@_paged_attention_op.register_fake
def _(q, *rest):
    return torch.empty_like(q), alloc_lse(q, rest[-1])  # rest[-1]: return_lse


# --- launch choices ------------------------------------------------------------------------------------
def auto_num_splits(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, is_decode: bool
) -> int:
    """Host-only inputs to `choose_num_splits`: programs from the shapes, the longest possible context
    from the block-table width (no sync)."""
    from codesign.kernels.attention.triton_attention import DEFAULT_CONFIG, choose_num_splits, rows_layout

    view = device_view(q.device)
    hkv = k_cache.shape[2]
    _, bq = rows_layout(q.shape[1] // hkv, DEFAULT_CONFIG["BLOCK_M"], is_decode, view.min_dot_rows)
    b = block_tables.shape[0]
    programs = (b if is_decode else -(-q.shape[0] // bq) + b) * hkv
    return choose_num_splits(programs, block_tables.shape[1] * k_cache.shape[1], view.sms)


# Keywords an attention entry point or plan() may pass to `prepare_launch`.
ATTENTION_OPTIONS = frozenset(
    {"sm_scale", "window", "softcap", "alibi_slopes", "num_splits", "check_data", "return_lse", "q_dtype"}
)


def prepare_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    tree_args: tuple,
    opts: dict,
) -> AttnMeta:
    """Every check (all before any launch) and launch choice of an attention entry point, plain cache
    or quantized (then k_cache = v_cache = a `geometry_probe` of it).

    cu_seqlens_q None means decode (the op gets offsets 0..B); tree_args: (positions, tree_mask,
    mask_indptr) or NO_TREE; opts: the entry point's keywords sm_scale (default 1/sqrt(head_dim)),
    window, softcap, alibi_slopes, num_splits (default `auto_num_splits`), check_data (default True).
    """
    unknown = sorted(set(opts) - ATTENTION_OPTIONS)
    if unknown:  # entry points taking **kw (the quantized caches') must not ignore a misspelt keyword
        raise CodesignError(
            f"unknown attention keyword(s) {unknown}; expected some of {sorted(ATTENTION_OPTIONS)}"
        )
    is_decode = cu_seqlens_q is None
    alibi, window, softcap = opts.get("alibi_slopes"), opts.get("window"), opts.get("softcap")
    check_data = opts.get("check_data", True)
    check_attention_inputs(
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, alibi, window, softcap, check_data
    )
    sm_scale, num_splits = opts.get("sm_scale"), opts.get("num_splits")
    scale = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else float(sm_scale)
    if num_splits is None:
        num_splits = auto_num_splits(q, k_cache, block_tables, is_decode)
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= 64:
        raise CodesignError(f"num_splits must be an int in [1, 64] or None, got {num_splits!r}")
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device) if is_decode else cu_seqlens_q
    return AttnMeta(block_tables, context_lens, cu, *tree_args, alibi, scale, window or 0,
                    float(softcap or 0.0), num_splits, is_decode)  # fmt: skip


# --- functional entry points -----------------------------------------------------------------------------
def attend_plain(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    tree_args: tuple,
    opts: dict,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The plain-cache entry points' shared body: `prepare_launch`, then the op; out, or (out, lse) when
    opts["return_lse"]."""
    meta = prepare_launch(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, tree_args, opts)
    return_lse = bool(opts.get("return_lse", False))
    out, lse = _paged_attention_op(q, k_cache, v_cache, *meta, return_lse)
    return (out, lse) if return_lse else out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    check_data: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention: q `[batch, q_heads, head_dim]`, one token per sequence, the last of its context.

    out[b, h] = softmax_j(softcap(scale q.k_j) + alibi_h (j - ctx_b + 1)) over the ctx_b cached tokens
    j (the last `window` only, if set); sm_scale defaults to 1/sqrt(head_dim). Returns out, or
    (out, lse) with lse fp32 `[batch, q_heads]` (natural log) when `return_lse`.
    """
    opts = dict(sm_scale=sm_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                return_lse=return_lse, num_splits=num_splits, check_data=check_data)  # fmt: skip
    return attend_plain(q, k_cache, v_cache, block_tables, context_lens, None, NO_TREE, opts)


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    check_data: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Extend / chunked prefill: q `[total_new_tokens, q_heads, head_dim]`, sequence b's new tokens
    q[cu[b]:cu[b+1]] at positions ctx_b - q_len_b + i, each attending causally to the cached prefix
    and to the new tokens up to itself. Their K/V must already be in the cache (`kv_write`)."""
    opts = dict(sm_scale=sm_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                return_lse=return_lse, num_splits=num_splits, check_data=check_data)  # fmt: skip
    return attend_plain(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, NO_TREE, opts)
