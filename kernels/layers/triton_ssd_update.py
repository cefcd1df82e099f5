"""Triton Mamba-2 state update (SSD's recurrence for one token: decode in Granite 4.0 hybrid, Bamba, Nemotron-H,
Zamba2, Falcon-H1). One program per (sequence, head, block of BP head-dim rows) updates its BP x N slice of the
state in place and writes those rows of the output::

    dt <- softplus(dt + dt_bias);   S <- exp(dt A) S + (dt x) B^T;   y = S C + D x;   y <- y silu(z)

in fp32 whatever the state's dtype (stored back in it). B and C are the head's group's (heads // groups consecutive
heads share one), read once per program; dt, A, D and dt_bias are per head (Mamba-2 ties them over the head dim)."""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.host_math import cdiv, next_pow2


@triton.jit
def softplus(x):
    """torch's softplus, log1p(exp(x)), and x itself past 20; log1p as log(u) e / (u - 1), u = 1 + e (exact where
    u rounds to 1, and to fp32 rounding elsewhere: log(1 + e) alone loses e's low bits from x below ~ -5, where
    Mamba-2's dt_bias starts)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    tiny = u == 1.0
    return tl.where(x > 20.0, x, tl.where(tiny, e, tl.log(u) * (e / tl.where(tiny, 1.0, u - 1.0))))


@triton.jit
def head_params(a_ptr, bias_ptr, d_ptr, h, HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr):
    """Head h's A, dt bias and D in fp32 (0 for the bias and D a call does not give)."""
    a_h = tl.load(a_ptr + h).to(tl.float32)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h).to(tl.float32)
    d_h = 0.0
    if HAS_D:
        d_h = tl.load(d_ptr + h).to(tl.float32)
    return a_h, bias, d_h


@triton.jit
def _ssd_update_kernel(
    s_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, bias_ptr, z_ptr, y_ptr,
    H, GROUP, P, N,
    ss_b, ss_h, ss_p, sx_b, sx_h, sdt_b, sdt_h, sb_b, sb_g, sc_b, sc_g, sz_b, sz_h, sy_b, sy_h,
    BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_Z: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    grp = h // GROUP
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    ok_p, ok_n = rp < P, rn < N
    ok = ok_p[:, None] & ok_n[None, :]
    dt = tl.load(dt_ptr + b * sdt_b + h * sdt_h).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)
    decay = tl.exp(dt * tl.load(a_ptr + h).to(tl.float32))
    s_off = b * ss_b + h * ss_h + rp[:, None] * ss_p + rn[None, :]
    s = tl.load(s_ptr + s_off, mask=ok, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b * sx_b + h * sx_h + rp, mask=ok_p, other=0.0).to(tl.float32)
    bv = tl.load(b_ptr + b * sb_b + grp * sb_g + rn, mask=ok_n, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + b * sc_b + grp * sc_g + rn, mask=ok_n, other=0.0).to(tl.float32)
    s = s * decay + (dt * x)[:, None] * bv[None, :]
    tl.store(s_ptr + s_off, s.to(s_ptr.dtype.element_ty), mask=ok)
    y = tl.sum(s * cv[None, :], 1)
    if HAS_D:
        y += x * tl.load(d_ptr + h).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + b * sz_b + h * sz_h + rp, mask=ok_p, other=0.0).to(tl.float32)
        y = y * z / (1.0 + tl.exp(-z))
    tl.store(y_ptr + b * sy_b + h * sy_h + rp, y.to(y_ptr.dtype.element_ty), mask=ok_p)


def block_p(p: int, n: int) -> int:
    """Head-dim rows a program holds: a 16 x 128 fp32 tile is 16 registers a thread over 4 warps; fewer rows for
    wider states."""
    return max(1, min(next_pow2(p), 2048 // next_pow2(n)))


def ssd_update_triton(state, x, dt, A, B, C, D, dt_bias, z, y, softplus: bool) -> None:
    """state `[Bt, H, P, N]` (updated in place; N contiguous), x, z and y `[Bt, H, P]`, dt `[Bt, H]`, A, D and
    dt_bias `[H]` (contiguous), B and C `[Bt, G, N]` (last dims contiguous; validated by `state_ops`)."""
    batch, heads, p, n = state.shape
    if batch == 0 or heads == 0 or p == 0:
        return
    bp = block_p(p, n)
    zz = y if z is None else z
    _ssd_update_kernel[(batch * heads, cdiv(p, bp))](
        state, x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, zz, y,
        heads, heads // B.shape[1], p, n,
        *state.stride()[:3], *x.stride()[:2], *dt.stride(), *B.stride()[:2], *C.stride()[:2], *zz.stride()[:2],
        *y.stride()[:2],
        BP=bp, BN=next_pow2(n), HAS_D=D is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus,
        HAS_Z=z is not None, num_warps=4,
    )  # fmt: skip
