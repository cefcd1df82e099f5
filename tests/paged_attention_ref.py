"""Test-side helpers for the paged-attention tests: a NaN-poisoned paged cache builder and the fp64
per-sequence reference (gather each token's slot, mask, softmax, weighted sum), written independently
of the code under test."""

from __future__ import annotations

import math

import torch


def make_paged_kv(
    ctx_lens: list[int],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    share_blocks: int = 0,
    spare_blocks: int = 3,
    extra_cols: int = 1,
):
    """Random K/V in a cache whose unused slots are NaN.

    Block ids are a random permutation of the pool (non-contiguous, shuffled); the first
    `share_blocks` blocks of every sequence long enough are those of sequence 0 (a shared prefix).
    Rows get `extra_cols` unused trailing entries pointing at a NaN-only block, so reading past a
    row's live blocks poisons the result. Returns (k_cache, v_cache, block_tables, context_lens).
    """
    need = [-(-c // block_size) for c in ctx_lens]
    width = max(need + [1]) + extra_cols
    num_blocks = sum(need) + spare_blocks + 1
    perm = torch.randperm(num_blocks).tolist()
    nan_block = perm.pop()
    tables = torch.full((len(ctx_lens), width), nan_block, dtype=torch.int32)
    for b, n in enumerate(need):
        for j in range(n):
            shared = (
                b > 0
                and j < share_blocks
                and j < need[0]
                and (j + 1) * block_size <= min(ctx_lens[0], ctx_lens[b])
            )
            tables[b, j] = tables[0, j] if shared else perm.pop()
    k = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v = torch.full_like(k, float("nan"))
    for b, c in enumerate(ctx_lens):
        for t in range(c):
            blk, off = int(tables[b, t // block_size]), t % block_size
            if torch.isnan(k[blk, off]).any():
                k[blk, off] = torch.randn(kv_heads, head_dim).to(dtype)
                v[blk, off] = torch.randn(kv_heads, head_dim).to(dtype)
    return k, v, tables, torch.tensor(ctx_lens, dtype=torch.int32)


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    q_lens: list[int],
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    alibi: torch.Tensor | None = None,
    parents: list[list[int]] | None = None,
    sinks: torch.Tensor | None = None,
):
    """fp64 attention of q [sum(q_lens), Hq, D] over the paged cache; returns (out fp64, lse fp64).

    Causal (the q_len new tokens are the last of the context) or, with `parents`, tree visibility:
    prefix tokens plus the node's ancestors and itself, positions prefix + depth. sinks [Hq]: each head's
    logit joins the softmax as one more column, of value 0 (GPT-OSS's eager attention).
    """
    hq, dim = q.shape[1], q.shape[2]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[0], hq, dtype=torch.float64)
    t0 = 0
    for b, ql in enumerate(q_lens):
        kl = int(context_lens[b])
        prefix = kl - ql
        j = torch.arange(kl)
        blk = block_tables[b, j // bs].long()
        k = k_cache[blk, j % bs].double()  # [kl, hkv, D]
        v = v_cache[blk, j % bs].double()
        if parents is not None:
            par = parents[b]
            depth = []
            for p in par:
                depth.append(0 if p == -1 else depth[p] + 1)
        for i in range(ql):
            if parents is None:
                qpos = prefix + i
                kpos = list(range(kl))
                vis = [jj <= qpos for jj in range(kl)]
            else:
                anc, a = set(), i
                while a != -1:
                    anc.add(a)
                    a = parents[b][a]
                qpos = prefix + depth[i]
                kpos = list(range(prefix)) + [prefix + d for d in depth]
                vis = [jj < prefix or (jj - prefix) in anc for jj in range(kl)]
            if window is not None:
                vis = [ok and qpos - kp < window for ok, kp in zip(vis, kpos)]
            idx = torch.tensor([jj for jj in range(kl) if vis[jj]], dtype=torch.long)
            kp = torch.tensor(kpos, dtype=torch.float64)[idx]
            for h in range(hq):
                s = (k[idx, h // g] @ q[t0 + i, h].double()) * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                if alibi is not None:
                    s = s + float(alibi[h]) * (kp - qpos)
                vh = v[idx, h // g]
                if sinks is not None:
                    s = torch.cat([s, sinks[h : h + 1].double()])
                    vh = torch.cat([vh, vh.new_zeros(1, dim)])
                lse[t0 + i, h] = torch.logsumexp(s, 0)
                out[t0 + i, h] = torch.softmax(s, 0) @ vh
        t0 += ql
    return out, lse
