"""Triton rotary position embedding of q and k in one launch: one program a token, which reads its cos and sin rows
once and rotates every head of q and then of k as `[heads, D / 2]` tiles (Hugging Face's rotate_half convention:
the first half of each head pairs with the second), in fp32, rounded once to the inputs' dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.kernels.host_math import next_pow2


@triton.jit
def _rotate(x_ptr, o_ptr, x_off, o_off, stride_xh, stride_oh, heads, c1, c2, s1, s2, d, d_ok, HALF,
            HEADS: tl.constexpr):  # fmt: skip
    """Every head of one token: out = x * cos + rotate_half(x) * sin."""
    h = tl.arange(0, HEADS)
    ok = (h < heads)[:, None] & d_ok[None, :]
    xp = x_ptr + x_off + h[:, None].to(tl.int64) * stride_xh + d[None, :]
    x1 = tl.load(xp, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=ok, other=0.0).to(tl.float32)
    op = o_ptr + o_off + h[:, None].to(tl.int64) * stride_oh + d[None, :]
    ty = o_ptr.dtype.element_ty
    tl.store(op, (x1 * c1[None, :] - x2 * s1[None, :]).to(ty), mask=ok)
    tl.store(op + HALF, (x2 * c2[None, :] + x1 * s2[None, :]).to(ty), mask=ok)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, seq, hq, hk, half,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sc_b, sc_s, sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s,
    HQ: tl.constexpr, HK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    b, s = t // seq, t % seq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < half
    c = cos_ptr + b * sc_b + s * sc_s + d
    n = sin_ptr + b * sc_b + s * sc_s + d
    c1 = tl.load(c, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(c + half, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(n, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(n + half, mask=d_ok, other=0.0).to(tl.float32)
    _rotate(q_ptr, qo_ptr, b * sq_b + s * sq_s, b * sqo_b + s * sqo_s, sq_h, sqo_h, hq, c1, c2, s1, s2, d, d_ok, half,
            HQ)  # fmt: skip
    _rotate(k_ptr, ko_ptr, b * sk_b + s * sk_s, b * sko_b + s * sko_s, sk_h, sko_h, hk, c1, c2, s1, s2, d, d_ok, half,
            HK)  # fmt: skip


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor,
                k_out: torch.Tensor) -> None:  # fmt: skip
    """q `[B, Hq, S, D]`, k `[B, Hk, S, D]`, cos and sin `[B, S, D]` (batch stride 0 to share one row of positions),
    last dims contiguous, into q_out / k_out of q's / k's shapes (validated by `ops.rope`)."""
    b, hq, s, dim = q.shape
    if b * s == 0:
        return
    hk = k.shape[1]
    _rope_kernel[(b * s,)](
        q, k, cos, sin, q_out, k_out, s, hq, hk, dim // 2,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos.stride(0), cos.stride(1),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        HQ=next_pow2(max(hq, 1)), HK=next_pow2(max(hk, 1)), BLOCK_D=next_pow2(dim // 2),  # (0 heads: all masked)
        num_warps=4 if (hq + hk) * dim <= 8192 else 8,  # (sm_90, 128 q heads of 128 on 4 warps: 158 registers)
    )  # fmt: skip
