"""Triton Mamba-1 state update (the selective scan's recurrence for one token: decode in Jamba, Falcon-Mamba, Mamba
and Zamba). Mamba-1 has no heads: each of the D inner channels has its own time step and its own N decay rates
(A `[D, N]`), and B and C are one per sequence. One program a (sequence, block of BD channels) updates its BD x N
slice of the state in place::

    dt <- softplus(dt + dt_bias);   S <- exp(dt A) S + (dt x) B^T;   y = S C + D x;   y <- y silu(z)

in fp32 whatever the state's dtype (stored back in it)."""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.host_math import cdiv, next_pow2
from codesign.kernels.layers.triton_ssd_update import softplus


@triton.jit
def _selective_update_kernel(
    s_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, bias_ptr, z_ptr, y_ptr,
    DIM, N,
    ss_b, ss_d, sx_b, sdt_b, sa_d, sb_b, sc_b, sz_b, sy_b,
    BD: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_Z: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    rn = tl.arange(0, BN)
    ok_d, ok_n = rd < DIM, rn < N
    ok = ok_d[:, None] & ok_n[None, :]
    dt = tl.load(dt_ptr + b * sdt_b + rd, mask=ok_d, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + rd, mask=ok_d, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)
    a = tl.load(a_ptr + rd[:, None] * sa_d + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    s_off = b * ss_b + rd[:, None] * ss_d + rn[None, :]
    s = tl.load(s_ptr + s_off, mask=ok, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b * sx_b + rd, mask=ok_d, other=0.0).to(tl.float32)
    bv = tl.load(b_ptr + b * sb_b + rn, mask=ok_n, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + b * sc_b + rn, mask=ok_n, other=0.0).to(tl.float32)
    s = s * tl.exp(dt[:, None] * a) + (dt * x)[:, None] * bv[None, :]
    tl.store(s_ptr + s_off, s.to(s_ptr.dtype.element_ty), mask=ok)
    y = tl.sum(s * cv[None, :], 1)
    if HAS_D:
        y += x * tl.load(d_ptr + rd, mask=ok_d, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + b * sz_b + rd, mask=ok_d, other=0.0).to(tl.float32)
        y = y * z / (1.0 + tl.exp(-z))
    tl.store(y_ptr + b * sy_b + rd, y.to(y_ptr.dtype.element_ty), mask=ok_d)


def block_d(n: int) -> int:
    """Channels a program holds: 2048 fp32 state values (16 x 128) over 4 warps, 16 registers a thread."""
    return max(1, 2048 // next_pow2(n))


def selective_update_triton(state, x, dt, A, B, C, D, dt_bias, z, y, softplus_dt: bool) -> None:
    """state `[Bt, D, N]` (updated in place; N contiguous), x, dt, z and y `[Bt, D]`, A `[D, N]`, D and dt_bias `[D]`
    (contiguous), B and C `[Bt, N]` (the last dims contiguous; validated by `state_ops.selective_state_update`)."""
    batch, dim, n = state.shape
    if batch == 0 or dim == 0:
        return
    bd = block_d(n)
    zz = y if z is None else z
    _selective_update_kernel[(batch, cdiv(dim, bd))](
        state, x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, zz, y,
        dim, n, state.stride(0), state.stride(1), x.stride(0), dt.stride(0), A.stride(0), B.stride(0), C.stride(0),
        zz.stride(0), y.stride(0),
        BD=bd, BN=next_pow2(n), HAS_D=D is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus_dt,
        HAS_Z=z is not None, num_warps=4,
    )  # fmt: skip
