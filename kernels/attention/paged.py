"""Paged attention over a plain cache: decode, extend (chunked prefill) and tree verification, and `attend`,
the one body every attention entry point shares (plain or quantized cache, decode, extend or tree).

One kernel covers every kind (`triton_attention` has the formula): q `[T, Hq, D]` holds the new tokens of
all sequences back to back (cu_seqlens_q int32 `[B+1]`), whose K/V are already in the paged cache, so
context_lens counts them. Decode is the case of one token per sequence. CUDA tensors run the Triton kernel,
CPU tensors plain torch (`reference`); `codesign.backend.use_backend("triton")` forces the kernel (the
interpreter on CPU).

Every check that raises CodesignError runs before a launch. The data checks (block ids inside the pool, rows
long enough, lengths) need one host sync: functional calls do them by default (`check_data=True`); the
plan()/run() wrappers (`attention.wrappers`) do them once in `plan()` so that `run()` never syncs.
"""

from __future__ import annotations

from typing import Any

import torch

from codesign.kernels.attention.ops import PLAIN, AttentionFormat
from codesign.kernels.attention.options import AttentionOptions, prepare, to_op_args
from codesign.kernels.attention.tree import TreeBatch, check_tree_batch
from codesign.kernels.kvcache.checks import geometry_probe
from codesign.specs import CodesignError


def attend(
    fmt: AttentionFormat,
    q: torch.Tensor,
    cache: Any,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    tree: TreeBatch | None,
    options: AttentionOptions | dict,
    expect: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Every attention entry point's body: validate the cache (`fmt.check`; plain caches: the pair
    (k_cache, v_cache), checked with the rest), run every check and resolve the options
    (`options.prepare`), then call the format's op; out, or (out, lse) with `return_lse`.

    cu_seqlens_q None means decode; `tree` (a TreeBatch) replaces context_lens and cu_seqlens_q; `options`:
    the typed options, or an entry point's keywords (unknown ones raise); `expect`: the cache format a
    QuantPagedKV must hold.
    """
    check_data = options.check_data if isinstance(options, AttentionOptions) else options.get("check_data", True)
    if fmt is PLAIN:
        k_like, v_like = cache
        tensors, params = cache, ()
    else:
        shape = fmt.check(cache, block_tables, check_data, expect)
        if not isinstance(q, torch.Tensor):
            raise CodesignError(f"q must be a tensor, got {type(q).__name__}")
        k_like = v_like = geometry_probe(shape, q.dtype, fmt.op_tensors(cache)[0].device)
        tensors, params = fmt.op_tensors(cache), fmt.params(cache)
    tree_args = None
    if tree is not None:
        if not isinstance(tree, TreeBatch):
            raise CodesignError(f"tree must be a TreeBatch (build_tree_batch), got {type(tree).__name__}")
        check_tree_batch(tree, q, block_tables, check_data)
        context_lens, cu_seqlens_q, tree_args = tree.context_lens, tree.cu_seqlens_q, tree.mask_args
    opts = options if isinstance(options, AttentionOptions) else AttentionOptions.from_keywords(options)
    batch, opts = prepare(q, k_like, v_like, block_tables, context_lens, cu_seqlens_q, tree_args, opts)
    out, lse = fmt.op(q, *tensors, *to_op_args(batch, opts), *params)
    return (out, lse) if opts.return_lse else out


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention: q `[batch, q_heads, head_dim]`, one token per sequence, the last of its context.

    out[b, h] = softmax_j(softcap(scale q.k_j) + alibi_h (j - ctx_b + 1)) over the ctx_b cached tokens
    j (the last `window` only, if set); sm_scale defaults to 1/sqrt(head_dim); sinks fp32 `[q_heads]`: a logit
    per head that joins the softmax's denominator (`attention.sinks`). Returns out, or (out, lse) with lse fp32
    `[batch, q_heads]` (natural log, over the scores and the sink) when `return_lse`.
    """
    opts = AttentionOptions(sm_scale, window, softcap, alibi_slopes, return_lse, num_splits, check_data, sinks)
    return attend(PLAIN, q, (k_cache, v_cache), block_tables, context_lens, None, None, opts)


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Extend / chunked prefill: q `[total_new_tokens, q_heads, head_dim]`, sequence b's new tokens
    q[cu[b]:cu[b+1]] at positions ctx_b - q_len_b + i, each attending causally to the cached prefix
    and to the new tokens up to itself. Their K/V must already be in the cache (`kvcache.write.kv_write`)."""
    opts = AttentionOptions(sm_scale, window, softcap, alibi_slopes, return_lse, num_splits, check_data, sinks)
    return attend(PLAIN, q, (k_cache, v_cache), block_tables, context_lens, cu_seqlens_q, None, opts)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    tree: TreeBatch,
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    check_data: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Tree verification attention: q `[sum tree sizes, q_heads, head_dim]` in node order per request
    (`tree`: `attention.tree.build_tree_batch`).

    out_i = softmax over the visible j of softcap(scale q_i.k_j) + alibi_h (pos_j - pos_i), positions
    prefix + depth (tree tokens) or the cache index (prefix tokens). Returns out (and lse if asked).
    """
    opts = AttentionOptions(sm_scale, window, softcap, alibi_slopes, return_lse, num_splits, check_data, sinks)
    return attend(PLAIN, q, (k_cache, v_cache), block_tables, None, None, tree, opts)
