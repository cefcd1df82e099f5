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

from codesign.backend import canonical_device, interpreter_enabled, resolve_backend
from codesign.kernels import kv_quant_dispatch as kqd
from codesign.kernels.paged_kv_cache import check_block_tables, check_int_tensor, check_kv_cache
from codesign.specs import CodesignError, KVFormat, PagedDecodeAttention, PagedExtendAttention

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


def on_gpu(t: torch.Tensor) -> bool:
    """True where Triton kernels run compiled (a CUDA tensor, interpreter off)."""
    return t.device.type == "cuda" and not interpreter_enabled()


def check_backend_dtype(backend: str, q: torch.Tensor) -> None:
    """bf16 Triton kernels only on a GPU: the interpreter computes bf16 on raw bits."""
    if backend == "triton" and q.dtype == torch.bfloat16 and not on_gpu(q):
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
    from codesign.kernels.paged_attention_triton import paged_attention_triton

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
    from codesign.kernels.paged_attention_triton import (
        DEFAULT_CONFIG,
        choose_num_splits,
        num_sms,
        rows_layout,
    )

    hkv = k_cache.shape[2]
    _, bq = rows_layout(q.shape[1] // hkv, DEFAULT_CONFIG["BLOCK_M"], is_decode, q.device.type == "cuda")
    b = block_tables.shape[0]
    programs = (b if is_decode else -(-q.shape[0] // bq) + b) * hkv
    return choose_num_splits(programs, block_tables.shape[1] * k_cache.shape[1], num_sms(q.device))


def geometry_probe(shape: tuple[int, int, int, int], dtype: torch.dtype, device) -> torch.Tensor:
    """A stand-in for a cache of `shape` (num_blocks, block_size, kv_heads, head_dim) in `dtype` for the
    shared shape checks: no memory (stride 0 except along head_dim), so no dequantized copy is made."""
    return torch.empty(shape[3], dtype=dtype, device=device).as_strided(tuple(shape), (0, 0, 0, 1))


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


# --- FlashInfer-style wrappers ------------------------------------------------------------------------
_PERSISTED = ("block_tables", "context_lens", "cu_seqlens_q", "positions", "tree_mask", "mask_indptr",
              "alibi_slopes")  # fmt: skip


def _into(buf: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """x, or x copied into the caller's buffer."""
    if buf is None or buf is x:
        return x
    return buf.copy_(x)


class _PlannedAttention:
    """plan(): validate and stage metadata once per batch shape; run(): launch only.

    run() allocates nothing whose size depends on data and never syncs with the host, so it can be
    captured in a CUDA graph (pass `out`/`lse` buffers to reuse memory across replays).
    """

    is_decode = False

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = canonical_device(device)
        self._plan: dict | None = None
        self._bufs: dict[str, torch.Tensor] = {}

    def _persist(self, name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        """Keep metadata in buffers the wrapper owns; a re-plan with the same shapes refills them in
        place, so a CUDA graph captured over run() replays with the new batch (FlashInfer's rule)."""
        if t is None:
            return None
        buf = self._bufs.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
            buf = self._bufs[name] = t.clone()
        else:
            buf.copy_(t)
        return buf

    def _stage(self, k_cache, block_tables, context_lens, cu, q_tokens, q_heads, tree_args, opts) -> None:
        """plan()'s shared body; cu None for decode, opts: plan()'s keywords."""
        quant = None
        if kqd.is_quant_cache(k_cache) or not isinstance(k_cache, torch.Tensor):
            quant = kqd.describe(k_cache)
            kqd.check_plan(quant, k_cache, block_tables)
            q_dtype = opts["q_dtype"] or torch.float16
            if q_dtype not in Q_DTYPES:
                raise CodesignError(f"q_dtype must be one of {Q_DTYPES}, got {q_dtype}")
            k_cache = geometry_probe(quant.shape, q_dtype, self.device)
        elif opts["q_dtype"] not in (None, k_cache.dtype):
            raise CodesignError(f"q_dtype {opts['q_dtype']} != cache dtype {k_cache.dtype}")
        nb, bs, hkv, dim = k_cache.shape
        probe = torch.empty(q_tokens, q_heads, dim, dtype=k_cache.dtype, device=self.device)
        meta = prepare_launch(probe, k_cache, k_cache, block_tables, context_lens, cu, tree_args, opts)
        from codesign.kernels.paged_attention_triton import dim_pad, launch_config

        ws = None
        if meta.num_splits > 1 and quant is None:  # the quantized-cache ops allocate their own workspace
            shape = (q_tokens, q_heads, meta.num_splits)
            old = self._plan["workspace"] if self._plan else None
            if old is not None and old[1].shape == shape and old[0].shape[-1] == dim_pad(dim):
                ws = old
            else:
                ws = (
                    torch.empty(*shape, dim_pad(dim), dtype=torch.float32, device=self.device),
                    torch.empty(*shape, dtype=torch.float32, device=self.device),
                )
        # Looked up once here, so run() does no table lookup.
        config = launch_config(
            q_heads, hkv, dim, bs, block_tables.shape[0], self.device, k_cache.element_size()
        )  # fmt: skip
        meta = meta._replace(**{f: self._persist(f, getattr(meta, f)) for f in _PERSISTED})
        self._plan = dict(
            meta._asdict(),  # the launch metadata, in buffers the wrapper owns
            quant=quant,  # None for a plain cache
            # Host copies (plan already synced for its checks) for spec(): the roofline bookkeeping.
            host_ctx=tuple(context_lens.tolist()),
            host_cu=tuple(meta.cu_seqlens_q.tolist()),
            window_opt=opts["window"],
            cache_shape=tuple(k_cache.shape),
            dtype=k_cache.dtype,
            q_shape=(q_tokens, q_heads, dim),
            workspace=ws,
            config=config,
        )

    def _spec_common(self) -> dict:
        p = self._plan
        if p is None:
            raise CodesignError("spec() called before plan()")
        _, bs, hkv, dim = p["cache_shape"]
        dt = SPEC_DTYPES[p["dtype"]]
        kv_format = KVFormat(dtype=dt)
        if p["quant"] is not None:
            # Mixed precision varies per block: count it as its widest (INT8 per token) chunks.
            kv_format = p["quant"].kv_format or KVFormat(dtype="int8", scheme="per_token")
        return dict(
            q_heads=p["q_shape"][1],
            kv_heads=hkv,
            head_dim=dim,
            block_size=bs,
            dtype=dt,
            kv_format=kv_format,
        )

    def run(
        self,
        q: torch.Tensor,
        k_cache,
        v_cache: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention for the planned batch; q must have the planned shape, the cache the planned layout
        (a plain k_cache and v_cache, or the planned kind of quantized cache as k_cache alone). The
        quantized caches run the functional entry point's op: outputs bit-identical to it."""
        p = self._plan
        if p is None:
            raise CodesignError("run() called before plan()")
        if tuple(q.shape) != p["q_shape"] or q.dtype != p["dtype"] or q.device != self.device:
            raise CodesignError(
                f"q {tuple(q.shape)} {q.dtype} {q.device} does not match the plan "
                f"{p['q_shape']} {p['dtype']} {self.device}"
            )
        want_lse = return_lse or lse is not None
        meta = AttnMeta(*(p[f] for f in AttnMeta._fields))
        if p["quant"] is not None or not isinstance(k_cache, torch.Tensor):
            self._check_quant_run(k_cache, v_cache)
            o, l_ = kqd.launch(p["quant"], q, k_cache, meta, want_lse)
        else:
            check_kv_cache(k_cache, v_cache)
            if (
                tuple(k_cache.shape) != p["cache_shape"]
                or k_cache.dtype != p["dtype"]
                or k_cache.device != q.device
            ):
                raise CodesignError(
                    f"cache {tuple(k_cache.shape)} {k_cache.dtype} does not match the plan "
                    f"{p['cache_shape']} {p['dtype']}"
                )
            if attention_backend(q) == "torch":
                o, l_ = paged_attention_torch(q, k_cache, v_cache, meta, want_lse)
            else:
                kw = dict(workspace=p["workspace"], config=p["config"])
                o, l_ = triton_attention(q, k_cache, v_cache, meta, want_lse, out, lse, **kw)
        out, lse = _into(out, o), _into(lse, l_)
        return (out, lse) if want_lse else out

    def _check_quant_run(self, cache, v_cache) -> None:
        """run() over a quantized cache: host-side checks against the plan (no sync)."""
        info = self._plan["quant"]
        if info is None or not kqd.is_quant_cache(cache):
            raise CodesignError(
                f"run() got a {type(cache).__name__} cache but the plan was made for "
                f"{'a plain cache' if info is None else info.signature[0]}"
            )
        if v_cache is not None:
            raise CodesignError("a quantized cache holds K and V: pass it as k_cache, with v_cache None")
        if kqd.signature(cache) != info.signature:
            raise CodesignError(
                "the quantized cache does not match the plan (tensor shapes, dtypes or format)"
            )


def _plan_opts(sm_scale, window, softcap, alibi_slopes, num_splits, q_dtype) -> dict:
    """plan()'s keywords, as `_stage` and `prepare_launch` read them."""
    return dict(sm_scale=sm_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                num_splits=num_splits, q_dtype=q_dtype)  # fmt: skip


class PagedDecodeWrapper(_PlannedAttention):
    """Decode attention, FlashInfer style: `plan(...)` once per batch shape, then `run(q, k, v)` per layer."""

    is_decode = True

    def spec(self) -> PagedDecodeAttention:
        """The operator spec of the planned batch (flops, min bytes) for roofline reports."""
        c = self._spec_common()
        return PagedDecodeAttention(context_lens=self._plan["host_ctx"], window=self._plan["window_opt"], **c)

    def plan(
        self,
        k_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        num_q_heads: int,
        *,
        sm_scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        num_splits: int | None = None,
        q_dtype: torch.dtype | None = None,
    ) -> None:
        """Validate the tables (one host sync) and choose splits and workspace for this batch.
        k_cache: a plain cache, or a quantized cache object (then q_dtype, default fp16, is q's dtype)."""
        opts = _plan_opts(sm_scale, window, softcap, alibi_slopes, num_splits, q_dtype)
        self._stage(
            k_cache, block_tables, context_lens, None, block_tables.shape[0], num_q_heads, NO_TREE, opts
        )


class PagedExtendWrapper(_PlannedAttention):
    """Extend / chunked-prefill attention with plan()/run()."""

    def spec(self) -> PagedExtendAttention:
        """The operator spec of the planned batch (sequences without new tokens left out)."""
        c = self._spec_common()
        cu, ctx = self._plan["host_cu"], self._plan["host_ctx"]
        ql = [cu[i + 1] - cu[i] for i in range(len(ctx))]
        keep = [i for i, n in enumerate(ql) if n > 0]
        return PagedExtendAttention(
            q_lens=tuple(ql[i] for i in keep),
            prefix_lens=tuple(ctx[i] - ql[i] for i in keep),
            window=self._plan["window_opt"],
            **c,
        )

    def plan(
        self,
        k_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        num_q_heads: int,
        *,
        sm_scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        num_splits: int | None = None,
        q_dtype: torch.dtype | None = None,
    ) -> None:
        """Validate tables and offsets (one host sync); q of run() has cu_seqlens_q[-1] tokens.
        k_cache: a plain cache, or a quantized cache object (then q_dtype, default fp16, is q's dtype)."""
        check_int_tensor("cu_seqlens_q", cu_seqlens_q, 1, self.device)
        tokens = int(cu_seqlens_q[-1]) if cu_seqlens_q.numel() else 0
        opts = _plan_opts(sm_scale, window, softcap, alibi_slopes, num_splits, q_dtype)
        self._stage(k_cache, block_tables, context_lens, cu_seqlens_q, tokens, num_q_heads, NO_TREE, opts)
