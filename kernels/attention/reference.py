"""The CPU implementation of every attention op, in plain torch (fp32): the torch backend and the tests'
reference path. A quantized cache is dequantized first (by its cache type, `attention.quantized`), then
read like a plain one: `paged_attention_torch` gathers each sequence's blocks, `attention_per_sequence` does
the attention with the options of `attention.options` (window, soft cap, ALiBi, tree masks, lse).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from codesign.kernels.attention.options import AttentionBatch, AttentionOptions, alloc_lse


def attention_per_sequence(
    q: torch.Tensor,
    gather: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    batch: AttentionBatch,
    opts: AttentionOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference-style attention in fp32, sequence by sequence: `gather(b, n)` returns sequence b's first
    n keys and values `[n, kv_heads, head_dim]` (batch.block_tables is not read: gather owns the layout)."""
    _, hq, dim = q.shape
    return_lse = opts.return_lse
    out, lse = torch.empty_like(q), alloc_lse(q, return_lse)
    cu = batch.cu_seqlens_q.tolist()
    lens = batch.context_lens.tolist()
    tree_mask, mask_indptr, alibi_slopes = batch.tree_mask, batch.mask_indptr, opts.alibi_slopes
    softcap, window = opts.softcap, opts.window
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
        s = torch.einsum("qhgd,khd->hgqk", qg, k).reshape(hq, ql, kl) * opts.sm_scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        kpos = torch.arange(kl, device=q.device)
        if tree_mask is not None:
            qpos = batch.positions[q0:q1].long()
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
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, opts: AttentionOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of every attention op over a paged cache `[blocks, block_size, kv_heads, head_dim]`
    (a dequantized one is cast to q's dtype first, as the kernel casts each tile): gather each
    sequence's blocks, then `attention_per_sequence`."""
    bs = k_cache.shape[1]
    k_cache, v_cache = k_cache.to(q.dtype), v_cache.to(q.dtype)

    def gather(b: int, kl: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = batch.block_tables[b, : -(-kl // bs)].long()
        return tuple(c[blocks].reshape(-1, *c.shape[2:])[:kl] for c in (k_cache, v_cache))

    return attention_per_sequence(q, gather, batch, opts)
