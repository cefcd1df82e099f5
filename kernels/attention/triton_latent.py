"""Triton kernel of multi-head latent attention decode (DeepSeek-V2/V3 with kv_b_proj absorbed, as FlashMLA).

Each token caches one vector of LATENT + ROPE channels; the keys are the whole vector, the values its first
LATENT channels, so a tile of the cache is loaded once and serves both dots. A program takes one sequence, a
block of BLOCK_H query heads (all of them share the one kv head: they fill the dot's M dimension) and one split
of the sequence's tokens; it writes its split's output, normalised, and its log2-sum-exp, which the launcher
merges (`latent.merge_splits`). The rotary part is a second, narrower dot, so both widths stay powers of two.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _latent_decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, lse_ptr,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    num_heads, num_splits,
    stride_qb, stride_qh,
    stride_cb, stride_cs,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    c = tl.arange(0, LATENT)
    r = tl.arange(0, ROPE)
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + c[None, :], mask=head_ok[:, None], other=0.0)
    q_r = tl.load(q_row + LATENT + r[None, :], mask=head_ok[:, None], other=0.0)

    ctx = tl.load(context_lens_ptr + b)
    # Each split takes a whole number of tiles; the last splits of a short sequence may take none.
    per_split = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        valid = tok < end
        blk = tl.load(block_tables_ptr + b * stride_tb + tok // BLOCK_SIZE, mask=valid, other=0)
        row = cache_ptr + blk.to(tl.int64) * stride_cb + (tok % BLOCK_SIZE) * stride_cs
        k_c = tl.load(row[:, None] + c[None, :], mask=valid[:, None], other=0.0)
        k_r = tl.load(row[:, None] + LATENT + r[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q_c, tl.trans(k_c)) + tl.dot(q_r, tl.trans(k_r))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c)  # the values: the latent part of the same tile
        m = m_new

    empty = l_sum == 0.0  # a split past the sequence's end: weight 0 in the merge
    out = acc / tl.where(empty, 1.0, l_sum)[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + c[None, :]
    tl.store(o_ptrs, out, mask=head_ok[:, None])
    lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, l_sum)))
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=head_ok)
