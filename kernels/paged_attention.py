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
"""

from __future__ import annotations

import math

import torch

from codesign.backend import interpreter_enabled, resolve_backend
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


def check_backend_dtype(backend: str, q: torch.Tensor) -> None:
    """bf16 Triton kernels only on a GPU: the interpreter computes bf16 on raw bits."""
    if (
        backend == "triton"
        and q.dtype == torch.bfloat16
        and (q.device.type != "cuda" or interpreter_enabled())
    ):
        raise CodesignError(
            "bf16 paged attention with the Triton backend needs a GPU (the interpreter mishandles bf16)"
        )


# --- CPU implementation (plain torch) --------------------------------------------------------------
def paged_attention_torch(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    cu_seqlens_q,
    positions,
    tree_mask,
    mask_indptr,
    alibi_slopes,
    sm_scale,
    window,
    softcap,
    return_lse,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference-style implementation in fp32: gather each sequence's blocks, mask, softmax."""
    t, hq, dim = q.shape
    _, bs, hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    lse = torch.empty(t if return_lse else 0, hq, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b, kl in enumerate(lens):
        q0, q1 = cu[b], cu[b + 1]
        ql = q1 - q0
        if ql == 0:
            continue
        prefix = kl - ql
        blocks = block_tables[b, : -(-kl // bs)].long()
        k = k_cache[blocks].reshape(-1, hkv, dim)[:kl].float()
        v = v_cache[blocks].reshape(-1, hkv, dim)[:kl].float()
        # Query head h reads kv head h // group: view q as [tokens, kv_heads, group, dim] (no K/V copies).
        qg = q[q0:q1].float().view(ql, hkv, hq // hkv, dim)
        s = torch.einsum("qhgd,khd->hgqk", qg, k).reshape(hq, ql, kl) * sm_scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        kpos = torch.arange(kl, device=q.device)
        if tree_mask is not None:
            qpos = positions[q0:q1].long()
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
    # Backend checks live here, not in the Python wrappers, so torch.compile traces those
    # (the backend choice reads a ContextVar, which dynamo cannot trace).
    backend = resolve_backend(OP, q.device)
    check_backend_dtype(backend, q)
    if backend == "torch":
        return paged_attention_torch(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            cu_seqlens_q,
            positions,
            tree_mask,
            mask_indptr,
            alibi_slopes,
            sm_scale,
            window,
            softcap,
            return_lse,
        )
    from codesign.kernels.paged_attention_triton import paged_attention_triton

    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0] if return_lse else 0, q.shape[1], dtype=torch.float32, device=q.device)
    paged_attention_triton(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        cu_seqlens_q,
        out,
        lse if return_lse else None,
        sm_scale=sm_scale,
        num_splits=num_splits,
        is_decode=is_decode,
        positions=positions,
        tree_mask=tree_mask,
        mask_indptr=mask_indptr,
        alibi_slopes=alibi_slopes,
        window=window,
        softcap=softcap,
    )
    return out, lse


@_paged_attention_op.register_fake
def _(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    cu_seqlens_q,
    positions,
    tree_mask,
    mask_indptr,
    alibi_slopes,
    sm_scale,
    window,
    softcap,
    num_splits,
    is_decode,
    return_lse,
):
    lse = q.new_empty(q.shape[0] if return_lse else 0, q.shape[1], dtype=torch.float32)
    return torch.empty_like(q), lse


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


def _resolve_common(q, sm_scale, num_splits, k_cache, block_tables, is_decode) -> tuple[float, int]:
    scale = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else float(sm_scale)
    if num_splits is None:
        num_splits = auto_num_splits(q, k_cache, block_tables, is_decode)
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= 64:
        raise CodesignError(f"num_splits must be an int in [1, 64] or None, got {num_splits!r}")
    return scale, num_splits


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
    check_attention_inputs(
        q, k_cache, v_cache, block_tables, context_lens, None, alibi_slopes, window, softcap, check_data
    )
    scale, splits = _resolve_common(q, sm_scale, num_splits, k_cache, block_tables, True)
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    out, lse = _paged_attention_op(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        cu,
        None,
        None,
        None,
        alibi_slopes,
        scale,
        window or 0,
        float(softcap or 0.0),
        splits,
        True,
        return_lse,
    )
    return (out, lse) if return_lse else out


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
    check_attention_inputs(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        cu_seqlens_q,
        alibi_slopes,
        window,
        softcap,
        check_data,
    )
    scale, splits = _resolve_common(q, sm_scale, num_splits, k_cache, block_tables, False)
    out, lse = _paged_attention_op(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        cu_seqlens_q,
        None,
        None,
        None,
        alibi_slopes,
        scale,
        window or 0,
        float(softcap or 0.0),
        splits,
        False,
        return_lse,
    )
    return (out, lse) if return_lse else out


# --- FlashInfer-style wrappers ------------------------------------------------------------------------
class _PlannedAttention:
    """plan(): validate and stage metadata once per batch shape; run(): launch only.

    run() allocates nothing whose size depends on data and never syncs with the host, so it can be
    captured in a CUDA graph (pass `out`/`lse` buffers to reuse memory across replays).
    """

    is_decode = False

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
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

    def _stage(self, k_cache, block_tables, context_lens, cu, q_tokens, q_heads, num_splits, extra) -> None:
        from codesign.kernels import kv_quant_dispatch as kqd

        quant = None
        if kqd.is_quant_cache(k_cache):
            quant = kqd.describe(k_cache)
            feats = (extra.get(n) for n in ("alibi_slopes", "window", "softcap"))
            kqd.check_plan(quant, k_cache, block_tables, *feats)
            q_dtype = extra.get("q_dtype") or torch.float16
            if q_dtype not in Q_DTYPES:
                raise CodesignError(f"q_dtype must be one of {Q_DTYPES}, got {q_dtype}")
            nb, bs, hkv, dim = quant.shape
            # A zero-stride stand-in of the cache's geometry in q's dtype for the shared checks.
            k_cache = torch.empty(dim, dtype=q_dtype, device=self.device).as_strided(
                (nb, bs, hkv, dim), (0, 0, 0, 1)
            )
        elif extra.get("q_dtype") not in (None, getattr(k_cache, "dtype", None)):
            raise CodesignError(f"q_dtype {extra['q_dtype']} != cache dtype {k_cache.dtype}")
        nb, bs, hkv, dim = k_cache.shape
        probe = torch.empty(q_tokens, q_heads, dim, dtype=k_cache.dtype, device=self.device)
        check_attention_inputs(
            probe,
            k_cache,
            k_cache,
            block_tables,
            context_lens,
            None if self.is_decode else cu,
            extra.get("alibi_slopes"),
            extra.get("window"),
            extra.get("softcap"),
            check_data=True,
        )
        scale, splits = _resolve_common(
            probe, extra.get("sm_scale"), num_splits, k_cache, block_tables, self.is_decode
        )
        from codesign.kernels.paged_attention_triton import dim_pad, launch_config

        ws = None
        if splits > 1 and quant is None:  # the quantized-cache ops allocate their own workspace
            shape = (q_tokens, q_heads, splits)
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
        )
        self._plan = dict(
            quant=quant,  # None for a plain cache
            # Host copies (plan already synced for its checks) for spec(): the roofline bookkeeping.
            host_ctx=tuple(context_lens.tolist()),
            host_cu=tuple(cu.tolist()),
            window_opt=extra.get("window"),
            cache_shape=tuple(k_cache.shape),
            dtype=k_cache.dtype,
            q_shape=(q_tokens, q_heads, dim),
            block_tables=self._persist("block_tables", block_tables),
            context_lens=self._persist("context_lens", context_lens),
            cu=self._persist("cu", cu),
            sm_scale=scale,
            num_splits=splits,
            workspace=ws,
            config=config,
            window=extra.get("window") or 0,
            softcap=float(extra.get("softcap") or 0.0),
            alibi_slopes=self._persist("alibi_slopes", extra.get("alibi_slopes")),
            positions=self._persist("positions", extra.get("positions")),
            tree_mask=self._persist("tree_mask", extra.get("tree_mask")),
            mask_indptr=self._persist("mask_indptr", extra.get("mask_indptr")),
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
        (a plain k_cache and v_cache, or the planned kind of quantized cache as k_cache alone)."""
        p = self._plan
        if p is None:
            raise CodesignError("run() called before plan()")
        if tuple(q.shape) != p["q_shape"] or q.dtype != p["dtype"] or q.device != self.device:
            raise CodesignError(
                f"q {tuple(q.shape)} {q.dtype} {q.device} does not match the plan "
                f"{p['q_shape']} {p['dtype']} {self.device}"
            )
        if p["quant"] is not None or not isinstance(k_cache, torch.Tensor):
            return self._run_quant(q, k_cache, v_cache, out, lse, return_lse)
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
        out = torch.empty_like(q) if out is None else out
        want_lse = return_lse or lse is not None
        if want_lse and lse is None:
            lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        backend = resolve_backend(OP, q.device)
        check_backend_dtype(backend, q)
        if backend == "torch":
            o, l_ = paged_attention_torch(
                q,
                k_cache,
                v_cache,
                p["block_tables"],
                p["context_lens"],
                p["cu"],
                p["positions"],
                p["tree_mask"],
                p["mask_indptr"],
                p["alibi_slopes"],
                p["sm_scale"],
                p["window"],
                p["softcap"],
                want_lse,
            )
            out.copy_(o)
            if want_lse:
                lse.copy_(l_)
        else:
            from codesign.kernels.paged_attention_triton import paged_attention_triton

            paged_attention_triton(
                q,
                k_cache,
                v_cache,
                p["block_tables"],
                p["context_lens"],
                p["cu"],
                out,
                lse,
                sm_scale=p["sm_scale"],
                num_splits=p["num_splits"],
                is_decode=self.is_decode,
                positions=p["positions"],
                tree_mask=p["tree_mask"],
                mask_indptr=p["mask_indptr"],
                alibi_slopes=p["alibi_slopes"],
                window=p["window"],
                softcap=p["softcap"],
                workspace=p["workspace"],
                config=p["config"],
            )
        return (out, lse) if want_lse else out

    def _run_quant(self, q, cache, v_cache, out, lse, return_lse):
        """run() over a quantized cache: host-side checks against the plan, then the entry point's op."""
        from codesign.kernels import kv_quant_dispatch as kqd

        p = self._plan
        info = p["quant"]
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
        want_lse = return_lse or lse is not None
        o, l_ = kqd.launch(info, q, cache, p, self.is_decode, want_lse)
        if out is None:
            out = o
        else:
            out.copy_(o)
        if want_lse:
            if lse is None:
                lse = l_
            else:
                lse.copy_(l_)
        return (out, lse) if want_lse else out


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
        cu = torch.arange(block_tables.shape[0] + 1, dtype=torch.int32, device=self.device)
        extra = dict(
            sm_scale=sm_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes, q_dtype=q_dtype
        )
        self._stage(
            k_cache, block_tables, context_lens, cu, block_tables.shape[0], num_q_heads, num_splits, extra
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
        extra = dict(
            sm_scale=sm_scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes, q_dtype=q_dtype
        )
        self._stage(k_cache, block_tables, context_lens, cu_seqlens_q, tokens, num_q_heads, num_splits, extra)
