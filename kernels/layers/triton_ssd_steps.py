"""Triton Mamba-2 scan over a few tokens, token by token (`state_ops.ssd_scan` below SCAN_CHUNKED_FROM tokens: a
speculative step's verified tokens, a tree's accepted path). One program a (sequence, head, block of BP head-dim
rows) holds its BP x N slice of the state in fp32 registers for all T tokens, so the state is read once and written
once however many tokens run (the chunked form, `triton_ssd_chunk`, runs 8 warps at 254 registers a program: one
program an SM, its walk's latency the step's time at a few tokens)::

    dt <- clamp(softplus(dt + dt_bias), dt_limit);   S <- exp(dt A) S + (dt x) B^T;   y = S C + D x

`triton_ssd_update`'s step in a loop over the tokens, the final state stored fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.host_math import cdiv, next_pow2
from codesign.kernels.layers.triton_ssd_update import block_p, head_params, softplus


@triton.jit
def _ssd_steps_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, bias_ptr, h0_ptr, y_ptr, ht_ptr,
    T, H, GROUP, P, N, dt_lo, dt_hi,
    sx_b, sx_t, sx_h, sdt_b, sdt_t, sdt_h, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g, sy_b, sy_t, sy_h,
    BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b, h = (pid // H).to(tl.int64), (pid % H).to(tl.int64)
    grp = h // GROUP
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    ok_p, ok_n = rp < P, rn < N
    s_off = (b * H + h) * P * N + rp[:, None] * N + rn[None, :]  # the states `[Bt, H, P, N]`, contiguous
    ok_s = ok_p[:, None] & ok_n[None, :]
    if HAS_H0:
        s = tl.load(h0_ptr + s_off, mask=ok_s, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BP, BN], tl.float32)
    a_h, bias, d_h = head_params(a_ptr, bias_ptr, d_ptr, h, HAS_BIAS, HAS_D)
    x_at, y_at = x_ptr + b * sx_b + h * sx_h + rp, y_ptr + b * sy_b + h * sy_h + rp
    dt_at = dt_ptr + b * sdt_b + h * sdt_h
    b_at, c_at = b_ptr + b * sb_b + grp * sb_g + rn, c_ptr + b * sc_b + grp * sc_g + rn
    for _ in range(T):  # (pointer steps: the token index never multiplies a stride)
        dt = tl.load(dt_at).to(tl.float32) + bias
        if SOFTPLUS:
            dt = softplus(dt)
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
        x = tl.load(x_at, mask=ok_p, other=0.0).to(tl.float32)
        bv = tl.load(b_at, mask=ok_n, other=0.0).to(tl.float32)
        cv = tl.load(c_at, mask=ok_n, other=0.0).to(tl.float32)
        s = s * tl.exp(dt * a_h) + (dt * x)[:, None] * bv[None, :]
        y = tl.sum(s * cv[None, :], 1) + x * d_h
        tl.store(y_at, y.to(y_ptr.dtype.element_ty), mask=ok_p)
        x_at += sx_t
        y_at += sy_t
        dt_at += sdt_t
        b_at += sb_t
        c_at += sc_t
    tl.store(ht_ptr + s_off, s, mask=ok_s)


def ssd_steps_triton(x, dt, A, B, C, D, dt_bias, h0, y, ht, softplus: bool, dt_limit: tuple[float, float]) -> None:
    """As `triton_ssd_chunk.ssd_scan_triton` (shapes there: x and y `[Bt, T, H, P]`, dt `[Bt, T, H]`, A, D, dt_bias
    `[H]` contiguous, B and C `[Bt, T, G, N]`, last dims contiguous, h0 or None and ht `[Bt, H, P, N]` contiguous, ht
    fp32), token by token."""
    batch, tokens, heads, p = x.shape
    n = B.shape[-1]
    if batch == 0 or heads == 0 or p == 0:
        return
    bp = block_p(p, n)
    _ssd_steps_kernel[(batch * heads, cdiv(p, bp))](
        x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, ht if h0 is None else h0, y, ht,
        tokens, heads, heads // B.shape[2], p, n, float(dt_limit[0]), float(dt_limit[1]),
        *x.stride()[:3], *dt.stride(), *B.stride()[:3], *C.stride()[:3], *y.stride()[:3],
        BP=bp, BN=next_pow2(n), HAS_D=D is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus,
        HAS_H0=h0 is not None, num_warps=4,
    )  # fmt: skip
