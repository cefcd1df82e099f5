"""Triton kernel of multi-head latent attention decode (DeepSeek-V2/V3 with kv_b_proj absorbed, as FlashMLA).

Each token caches one vector of LATENT + ROPE channels; the keys are the whole vector, the values its first
LATENT channels, so a tile of the cache is loaded once and serves both dots. A program takes one sequence, a
block of BLOCK_H query heads (all of them share the one kv head: they fill the dot's M dimension) and one split
of the sequence's tokens; it writes its split's output, normalised, and its log2-sum-exp, which the launcher
merges (`triton_attention.reduce_splits`, the paged kernels' merge). The rotary part is a second, narrower dot, so
both widths stay powers of two. An e4m3 cache (one scale for the tensor, as vLLM's) is decoded exactly to the
queries' dtype; its scale multiplies the scores' factor and the output once, not each element.
"""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.attention.triton_tiles import _fp8_e4m3_f16


@triton.jit
def _load_latent(ptrs, mask, DTYPE: tl.constexpr, FP8: tl.constexpr, HW_FP8: tl.constexpr):
    """A tile of the cache in the queries' dtype: as stored, or e4m3 bytes decoded exactly (the cache's one scale
    stays out: the launcher folds it into the scores' factor and the output)."""
    if FP8:
        raw = tl.load(ptrs, mask=mask, other=0)
        if HW_FP8:  # sm_89+: the hardware's conversion
            x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16).to(DTYPE)
        else:
            x = _fp8_e4m3_f16(raw.to(tl.int32)).to(DTYPE)  # e4m3 values are exact in fp16, bf16 and fp32
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _latent_decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, lse_ptr,
    qk_scale,  # sm_scale * log2(e) (* the fp8 cache's scale): the softmax runs in base 2
    out_scale,  # the fp8 cache's scale on the values (1.0 for a cache stored in the queries' dtype)
    num_heads, num_splits,
    stride_qb, stride_qh,
    stride_cb, stride_cs,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, HW_FP8: tl.constexpr, DOT_PREC: tl.constexpr,
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
    if FP8 and q_c.dtype == tl.bfloat16:  # e4m3 decodes to fp16 in one instruction a pair: dot in fp16, not bf16
        q_c = q_c.to(tl.float16)
        q_r = q_r.to(tl.float16)

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
        k_c = _load_latent(row[:, None] + c[None, :], valid[:, None], q_c.dtype, FP8, HW_FP8)
        k_r = _load_latent(row[:, None] + LATENT + r[None, :], valid[:, None], q_c.dtype, FP8, HW_FP8)
        s = tl.dot(q_c, tl.trans(k_c), input_precision=DOT_PREC)
        s = tl.dot(q_r, tl.trans(k_r), s, input_precision=DOT_PREC)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        # the values: the latent part of the same tile
        acc = tl.dot(p.to(k_c.dtype), k_c, acc * alpha[:, None], input_precision=DOT_PREC)
        m = m_new

    empty = l_sum == 0.0  # a split past the sequence's end: weight 0 in the merge
    out = acc * (out_scale / tl.where(empty, 1.0, l_sum))[:, None]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + c[None, :]
    tl.store(o_ptrs, out, mask=head_ok[:, None])
    # A sequence with no tokens: its first split weighs 1 with output 0, so the merge gives zeros, not 0 / 0.
    zero = tl.where((ctx == 0) & (split == 0), 0.0, float("-inf"))
    lse = tl.where(empty, zero, m + tl.log2(tl.where(empty, 1.0, l_sum)))
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=head_ok)
