"""Triton Mamba-2 scan over a prompt (SSD's chunked form: mamba_ssm's mamba_chunk_scan_combined, `ssd.ssd_chunked`
in plain torch), one launch. One program a (sequence, head, block of BP head-dim rows) walks the chunks of C tokens
in order with its BP x N slice of the state in fp32 registers; per chunk, with a = dt A (dt after its bias, softplus
and clamp) and cum its cumulative sum::

    y = ((C B^T) * exp(cum_i - cum_j), j <= i) (dt x) + (C S^T) exp(cum) + D x
    S <- exp(cum_last) S + ((dt x) exp(cum_last - cum))^T B

four `tl.dot`s a chunk (C B^T is the head's group's, recomputed by each of its heads' programs: C^2 N against the
C N P the others cost). Rows past the prompt's end load dt = 0 and x = B = C = 0: they add nothing and keep the last
row's decay. The result does not depend on the chunk size (the same sums, grouped otherwise): C = 32 here (16 for
states past 128) where the model's `chunk_size` is 256, to hold the tiles in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.host_math import cdiv, next_pow2
from codesign.kernels.layers.triton_ssd_update import head_params, softplus

# (chunk, rows a program, warps, stages) for states up to 128 and past it: no spills on sm_90 (lowering_report; at 128
# 4 warps spilled 16 bytes, at 256 every 32-token chunk spilled 0.5-4 KB)
CONFIG = {128: (32, 32, 8, 2), 256: (16, 16, 8, 2)}


@triton.jit
def _ssd_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, bias_ptr, h0_ptr, y_ptr, ht_ptr,
    T, H, GROUP, P, N, dt_lo, dt_hi,
    sx_b, sx_t, sx_h, sdt_b, sdt_t, sdt_h, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g, sy_b, sy_t, sy_h,
    C: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr, HAS_H0: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b, h = (pid // H).to(tl.int64), (pid % H).to(tl.int64)
    grp = h // GROUP
    rc, rn = tl.arange(0, C), tl.arange(0, BN)
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    ok_p, ok_n = rp < P, rn < N
    s_off = (b * H + h) * P * N + rp[:, None] * N + rn[None, :]  # the states `[B, H, P, N]`, contiguous
    ok_s = ok_p[:, None] & ok_n[None, :]
    if HAS_H0:
        s = tl.load(h0_ptr + s_off, mask=ok_s, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BP, BN], tl.float32)
    a_h, bias, d_h = head_params(a_ptr, bias_ptr, d_ptr, h, HAS_BIAS, HAS_D)
    x_head, y_head = x_ptr + b * sx_b + h * sx_h, y_ptr + b * sy_b + h * sy_h
    dt_head = dt_ptr + b * sdt_b + h * sdt_h
    b_head, c_head = b_ptr + b * sb_b + grp * sb_g, c_ptr + b * sc_b + grp * sc_g
    causal = rc[:, None] >= rc[None, :]
    for t0 in range(0, T, C):
        rt = rc.to(tl.int64) + t0  # (int64: a token stride times T passes 2^31 on long prompts)
        ok_t = rt < T
        dt = tl.load(dt_head + rt * sdt_t, mask=ok_t, other=0.0).to(tl.float32) + bias
        if SOFTPLUS:
            dt = softplus(dt)
        dt = tl.where(ok_t, tl.minimum(tl.maximum(dt, dt_lo), dt_hi), 0.0)
        cum = tl.cumsum(dt * a_h, 0)
        x = tl.load(x_head + rt[:, None] * sx_t + rp[None, :], mask=ok_t[:, None] & ok_p[None, :], other=0.0)
        x = x.to(tl.float32)
        ok_tn = ok_t[:, None] & ok_n[None, :]
        bm = tl.load(b_head + rt[:, None] * sb_t + rn[None, :], mask=ok_tn, other=0.0).to(tl.float32)
        cm = tl.load(c_head + rt[:, None] * sc_t + rn[None, :], mask=ok_tn, other=0.0).to(tl.float32)
        xdt = x * dt[:, None]
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0))
        scores = tl.where(causal, tl.dot(cm, tl.trans(bm), input_precision=PREC) * decay, 0.0)
        y = tl.dot(scores, xdt, input_precision=PREC)
        y += tl.dot(cm, tl.trans(s), input_precision=PREC) * tl.exp(cum)[:, None]
        y += x * d_h
        tl.store(y_head + rt[:, None] * sy_t + rp[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=ok_t[:, None] & ok_p[None, :])  # fmt: skip
        last = tl.sum(tl.where(rc == C - 1, cum, 0.0), 0)  # (rows past T repeat the last one's)
        s = s * tl.exp(last) + tl.dot(tl.trans(xdt * tl.exp(last - cum)[:, None]), bm, input_precision=PREC)
    tl.store(ht_ptr + s_off, s, mask=ok_s)


def launch_config(p: int, n: int) -> tuple[int, int, int, int]:
    """(chunk, head-dim rows a program, warps, stages): 32-token chunks and 32 rows (a 32 x 128 fp32 state beside
    the chunk's 32 x 128 B and C) up to a state of 128, 16 and 16 past it."""
    chunk, rows, warps, stages = CONFIG[128 if n <= 128 else 256]
    return chunk, max(16, min(next_pow2(p), rows)), warps, stages


def ssd_scan_triton(x, dt, A, B, C, D, dt_bias, h0, y, ht, softplus: bool, dt_limit: tuple[float, float],
                    exact: bool) -> None:  # fmt: skip
    """x and y `[Bt, T, H, P]`, dt `[Bt, T, H]`, A, D, dt_bias `[H]` (contiguous), B and C `[Bt, T, G, N]` (last dims
    contiguous), h0 (or None) and ht `[Bt, H, P, N]` contiguous, ht fp32 (validated by `state_ops.ssd_scan`);
    exact: IEEE fp32 products (else TF32 on a GPU)."""
    batch, tokens, heads, p = x.shape
    n = B.shape[-1]
    if batch == 0 or heads == 0 or p == 0:
        return
    chunk, bp, warps, stages = launch_config(p, n)
    _ssd_scan_kernel[(batch * heads, cdiv(p, bp))](
        x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, ht if h0 is None else h0, y, ht,
        tokens, heads, heads // B.shape[2], p, n, float(dt_limit[0]), float(dt_limit[1]),
        *x.stride()[:3], *dt.stride(), *B.stride()[:3], *C.stride()[:3], *y.stride()[:3],
        C=chunk, BP=bp, BN=max(16, next_pow2(n)), HAS_D=D is not None, HAS_BIAS=dt_bias is not None,
        SOFTPLUS=softplus, HAS_H0=h0 is not None, PREC="ieee" if exact else "tf32", num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
