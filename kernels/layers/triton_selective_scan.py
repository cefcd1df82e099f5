"""Triton Mamba-1 selective scan over a prompt (Jamba, Falcon-Mamba, Mamba, Zamba; `selective_scan.py` is its
reference). One program a (sequence, block of BD channels) walks the prompt in chunks of BT tokens with its BD x N
slice of the state in fp32 registers. Within a chunk every token's state comes at once from an associative scan of the
pairs (decay, input) along the tokens, (a1, u1) . (a2, u2) = (a1 a2, a2 u1 + u2) with a = exp(dt A) and
u = dt x B (mamba_ssm's block scan; each (channel, state entry) has its own decay, so no matrix product stands in)::

    S_t = (a_1 ... a_t) S_in + scan(u)_t;   y_t = S_t C_t + D x_t;   y_t <- y_t silu(z_t)

dt after its bias and softplus; tokens past the prompt's end get dt = 0 (a = 1, u = 0), so the chunk's last row is
the state after its last real token. The tiles are tokens first, `[BT, BD, BN]`: Triton's default layout then gives
each thread one (channel, state entry) and all BT of its tokens, so the scan runs in registers and only the read-out
y = S C reduces across lanes (tokens last would spread them over the lanes: a shuffle round of two values per level
of the scan). The next chunk's tiles are loaded before this chunk's scan (a prefetch carried through the loop), so
their latency hides behind the arithmetic. x, dt and z `[Bt, D, T]`, B and C `[Bt, N, T]` in any strides
(transformers passes views of its projections); y `[Bt, D, T]` contiguous."""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.host_math import cdiv, next_pow2
from codesign.kernels.layers.triton_ssd_update import softplus

LOG2E = tl.constexpr(1.4426950408889634)
TILE = 4096  # state values a program scans a chunk (BT x BD x N): 32 fp32 registers a thread a tile at 4 warps


@triton.jit
def _combine(a1, u1, a2, u2):
    return a1 * a2, a2 * u1 + u2


@triton.jit
def _load_chunk(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, bias, rd, rn, tt, ok_d, ok_n, T,
                sx_d, sx_t, sdt_d, sdt_t, sb_n, sb_t, sc_n, sc_t, sz_d, sz_t,
                HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_Z: tl.constexpr):  # fmt: skip
    """One chunk's tiles, tokens first: dt (biased, softplus, 0 past T) and x, z `[BT, BD]`; B and C `[BT, BN]`
    (fp32)."""
    ok_t = tt < T
    m_dt = ok_t[:, None] & ok_d[None, :]
    m_nt = ok_t[:, None] & ok_n[None, :]
    dt = tl.load(dt_ptr + tt[:, None] * sdt_t + rd[None, :] * sdt_d, mask=m_dt, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += bias[None, :]
    if SOFTPLUS:
        dt = softplus(dt)
    dt = tl.where(m_dt, dt, 0.0)
    x = tl.load(x_ptr + tt[:, None] * sx_t + rd[None, :] * sx_d, mask=m_dt, other=0.0).to(tl.float32)
    bm = tl.load(b_ptr + tt[:, None] * sb_t + rn[None, :] * sb_n, mask=m_nt, other=0.0).to(tl.float32)
    cm = tl.load(c_ptr + tt[:, None] * sc_t + rn[None, :] * sc_n, mask=m_nt, other=0.0).to(tl.float32)
    z = x
    if HAS_Z:
        z = tl.load(z_ptr + tt[:, None] * sz_t + rd[None, :] * sz_d, mask=m_dt, other=0.0).to(tl.float32)
    return dt, x, bm, cm, z


@triton.jit
def _selective_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, bias_ptr, z_ptr, h0_ptr, y_ptr, ht_ptr,
    DIM, N, T, D_BLOCKS,
    sx_b, sx_d, sx_t, sdt_b, sdt_d, sdt_t, sa_d, sa_n, sb_b, sb_n, sb_t, sc_b, sc_n, sc_t, sz_b, sz_d, sz_t,
    sh_b, sh_d, sh_n, sy_b, sy_d, st_b, st_d,
    BD: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr, HAS_Z: tl.constexpr, HAS_H0: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = (pid // D_BLOCKS).to(tl.int64)
    rd = ((pid % D_BLOCKS) * BD + tl.arange(0, BD)).to(tl.int64)
    rn = tl.arange(0, BN).to(tl.int64)
    rt = tl.arange(0, BT)
    ok_d, ok_n = rd < DIM, rn < N
    ok = ok_d[:, None] & ok_n[None, :]
    # the decay rates in log2 units, so each decay is one exp2; A = -inf (A_log past 88) as the most negative fp32,
    # so a token past the end (dt = 0) keeps a decay of 1, not 0 * -inf
    a2 = tl.load(a_ptr + rd[:, None] * sa_d + rn[None, :] * sa_n, mask=ok, other=0.0).to(tl.float32) * LOG2E
    a2 = tl.where(a2 == -float("inf"), -3.4028234663852886e38, a2)
    bias = tl.zeros([BD], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rd, mask=ok_d, other=0.0).to(tl.float32)
    dskip = tl.zeros([BD], tl.float32)
    if HAS_D:
        dskip = tl.load(d_ptr + rd, mask=ok_d, other=0.0).to(tl.float32)
    h = tl.zeros([BD, BN], tl.float32)
    if HAS_H0:
        h = tl.load(h0_ptr + b * sh_b + rd[:, None] * sh_d + rn[None, :] * sh_n, mask=ok, other=0.0).to(tl.float32)
    x_ptr += b * sx_b
    dt_ptr += b * sdt_b
    b_ptr += b * sb_b
    c_ptr += b * sc_b
    z_ptr += b * sz_b
    y_ptr += b * sy_b
    nxt = _load_chunk(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, bias, rd, rn, rt.to(tl.int64), ok_d, ok_n, T,
                      sx_d, sx_t, sdt_d, sdt_t, sb_n, sb_t, sc_n, sc_t, sz_d, sz_t,
                      HAS_BIAS, SOFTPLUS, HAS_Z)  # fmt: skip
    for t0 in range(0, T, BT):
        dt, x, bm, cm, z = nxt
        tt = rt.to(tl.int64) + t0
        # the next chunk's loads in flight while this one scans (past T they are masked off: no reads)
        nxt = _load_chunk(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, bias, rd, rn, tt + BT, ok_d, ok_n, T,
                          sx_d, sx_t, sdt_d, sdt_t, sb_n, sb_t, sc_n, sc_t, sz_d, sz_t,
                          HAS_BIAS, SOFTPLUS, HAS_Z)  # fmt: skip
        # tokens first: each thread holds a (channel, state entry)'s tokens, so the scan runs in its registers
        decay = tl.exp2(dt[:, :, None] * a2[None, :, :])  # [BT, BD, BN]
        inp = (dt * x)[:, :, None] * bm[:, None, :]
        carry, s = tl.associative_scan((decay, inp), 0, _combine)
        s += carry * h[None, :, :]
        y = tl.sum(s * cm[:, None, :], 2)  # [BT, BD]
        h = tl.sum(tl.where(rt[:, None, None] == BT - 1, s, 0.0), 0)
        if HAS_D:
            y += x * dskip[None, :]
        if HAS_Z:
            y = y * z / (1.0 + tl.exp(-z))
        m_dt = (tt < T)[:, None] & ok_d[None, :]
        tl.store(y_ptr + tt[:, None] + rd[None, :] * sy_d, y.to(y_ptr.dtype.element_ty), mask=m_dt)
    tl.store(ht_ptr + b * st_b + rd[:, None] * st_d + rn[None, :], h, mask=ok)


def launch_config(n: int) -> tuple[int, int]:
    """(BD channels, BT tokens) a program holds for a state of n: BT x BD x next_pow2(n) = TILE, chunks of 32 tokens
    up to a state of 32 (BD x N = 128, a (channel, state entry) a thread), 16 past it (two a thread, or more)."""
    bn = next_pow2(n)
    bt = 32 if bn <= 32 else 16
    return max(1, TILE // (bn * bt)), bt


def selective_scan_triton(x, dt, A, B, C, D, dt_bias, z, h0, y, ht, softplus_dt: bool) -> None:
    """x, dt, z `[Bt, D, T]`, A `[D, N]`, B and C `[Bt, N, T]` (any strides), D and dt_bias `[D]` (contiguous), h0
    `[Bt, D, N]` or None, y `[Bt, D, T]` and ht `[Bt, D, N]` (fp32) contiguous outputs (validated by
    `state_ops.selective_scan`)."""
    batch, dim, tokens = x.shape
    if batch == 0 or dim == 0:
        return
    n = A.shape[1]
    bd, bt = launch_config(n)
    blocks = cdiv(dim, bd)
    zz, hh = (x if z is None else z), (ht if h0 is None else h0)
    _selective_scan_kernel[(batch * blocks,)](
        x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, zz, hh, y, ht,
        dim, n, tokens, blocks,
        *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(), *zz.stride(), *hh.stride(),
        y.stride(0), y.stride(1), ht.stride(0), ht.stride(1),
        BD=bd, BN=next_pow2(n), BT=bt, HAS_D=D is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus_dt,
        HAS_Z=z is not None, HAS_H0=h0 is not None, num_warps=4,
    )  # fmt: skip
