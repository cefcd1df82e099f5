"""Triton gated delta rule, token by token (Gated DeltaNet's recurrence: Qwen3-Next, Qwen3.5): what decode runs, and
the few tokens a speculative step verifies. One program per (sequence, value head, block of BV value columns) holds
its dk x BV slice of the state in fp32 registers for all T tokens, so the state is read once and written once however
many tokens run; per token it reads q_t and k_t (the value head's key head, l2-normalised in the program), v_t's BV
columns and two scalars::

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T (scale q_t)

Both reductions are over dk, the tile's rows, so the BV columns are independent and the value dim splits across
programs with no exchange (each recomputes the norms of q_t and k_t: dk flops against dk x BV of state work)."""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.host_math import cdiv, next_pow2


@triton.jit
def _head_vec(ptr, row, rk, ok_k, eps, L2NORM: tl.constexpr):
    x = tl.load(ptr + row + rk, mask=ok_k, other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.math.rsqrt(tl.sum(x * x, 0) + eps)
    return x


@triton.jit
def _gated_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, o_ptr, ht_ptr,
    T, HV, GROUP, DK, DV, scale, eps,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sbt_b, sbt_t, sbt_h, so_b, so_t, so_h,
    BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, L2NORM: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = (pid // HV).to(tl.int64)
    hv = (pid % HV).to(tl.int64)  # (int64: a head stride times the heads can pass 2^31 in a head-major view)
    hk = hv // GROUP  # key head hk serves value heads hk * GROUP ... (hk + 1) * GROUP - 1 (transformers' order)
    rk = tl.arange(0, BK)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    ok_k, ok_v = rk < DK, cols < DV
    ok = ok_k[:, None] & ok_v[None, :]
    # the state `[B, HV, DK, DV]`, contiguous (the op makes it so)
    s_off = (b * HV + hv) * DK * DV + rk[:, None] * DV + cols[None, :]
    if HAS_H0:
        h = tl.load(h0_ptr + s_off, mask=ok, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BK, BV], tl.float32)
    q_row, k_row = q_ptr + b * sq_b + hk * sq_h, k_ptr + b * sk_b + hk * sk_h
    v_row, o_row = v_ptr + b * sv_b + hv * sv_h, o_ptr + b * so_b + hv * so_h
    g_row, beta_row = g_ptr + b * sg_b + hv * sg_h, beta_ptr + b * sbt_b + hv * sbt_h
    for t in range(T):
        q = _head_vec(q_row, t * sq_t, rk, ok_k, eps, L2NORM) * scale
        k = _head_vec(k_row, t * sk_t, rk, ok_k, eps, L2NORM)
        v = tl.load(v_row + t * sv_t + cols, mask=ok_v, other=0.0).to(tl.float32)
        g = tl.load(g_row + t * sg_t).to(tl.float32)
        beta = tl.load(beta_row + t * sbt_t).to(tl.float32)
        h = h * tl.exp(g)
        # the delta rule: write only what the decayed state does not already predict for k_t
        delta = (v - tl.sum(h * k[:, None], 0)) * beta
        h = h + k[:, None] * delta[None, :]
        o = tl.sum(h * q[:, None], 0)
        tl.store(o_row + t * so_t + cols, o.to(o_ptr.dtype.element_ty), mask=ok_v)
    tl.store(ht_ptr + s_off, h, mask=ok)


def block_v(dk: int, dv: int) -> int:
    """Value columns a program holds: 32 (a 128-wide key head's 128 x 32 fp32 tile is 32 registers a thread over 4
    warps), 16 for key heads wider than 128, never more than dv's power of two."""
    return min(next_pow2(dv), 32 if dk <= 128 else 16)


def gated_delta_triton(q, k, v, g, beta, h0, o, ht, scale: float, l2norm: bool, eps: float) -> None:
    """q, k `[B, T, HK, DK]`, v and o `[B, T, HV, DV]`, g and beta `[B, T, HV]` (any strides, the head dims
    contiguous), h0 (or None) and ht `[B, HV, DK, DV]` contiguous, ht fp32 (validated by `state_ops`): o and ht
    written."""
    batch, tokens, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if batch == 0 or hv == 0 or dv == 0:
        return
    bk, bv = next_pow2(dk), block_v(dk, dv)
    _gated_delta_kernel[(batch * hv, cdiv(dv, bv))](
        q, k, v, g, beta, ht if h0 is None else h0, o, ht,
        tokens, hv, hv // hk, dk, dv, float(scale), float(eps),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(), *o.stride()[:3],
        BK=bk, BV=bv, HAS_H0=h0 is not None, L2NORM=l2norm, num_warps=4,
    )  # fmt: skip
