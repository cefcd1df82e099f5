"""Triton gated delta rule over a token tree (Gated DeltaNet's layers in a tree speculative step: Qwen3-Next,
Qwen3.5): every node's output as if its path from the root had run token by token, in one launch.

The chunked form (`triton_gated_delta_chunk`) of one chunk holding the whole tree, with the causal mask replaced by
the ancestor mask and the cumulative decay by the decay summed along each node's path (gp_i = sum of g over i's
path). Node i's row of A = (beta K K^T) * exp(gp_i - gp_j) reaches only i's strict ancestors, so forward substitution
in the nodes' order (each parent before its child) gives each node exactly the values the recurrence along its own
path would, and

    w = (I + A)^-1 (beta K exp(gp)),  u = (I + A)^-1 (beta V),  v' = u - w S0,
    o = (q exp(gp)) S0 + ((q K^T) * exp(gp_i - gp_j) over i's ancestors and i itself) v'

One program a (sequence, value head, block of BV value columns): the tree's nodes (up to MAX_NODES, padded to a
power of two >= 16) and the dk x BV slice of the state entering the step in registers; each program redoes the
node-by-node inverse (n^2 dk work, small beside the state's n dk BV). No state is written: the caller keeps the
state of the path it accepts by running the recurrence over that path (a few tokens), instead of a state a node.
"""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.host_math import cdiv, next_pow2
from codesign.kernels.layers.triton_gated_delta_chunk import SUB_BLOCK, _rows, _unit_lower_inverse
from codesign.specs import CodesignError

MAX_NODES = 64  # nodes one program holds (its n x n products and the inverse in registers)
TREE_BV = 64  # value columns a program: a 128 x 64 fp32 state slice
# warps by the padded node count: no spills at 16 (4 warps, 168 registers) and 32 (8 warps, 251); at 64 every
# choice tried spills on sm_90 (8 warps: 328 spill stores; compile-only, docs/kernels.md)
TREE_WARPS = {16: 4, 32: 8, 64: 8}


@triton.jit
def _tree_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, h0_ptr, o_ptr,
    N, HV, GROUP, DK, DV, scale, eps,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sbt_b, sbt_t, sbt_h,
    so_b, so_t, so_h,
    C: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
    L2NORM: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b, hv = (pid // HV).to(tl.int64), (pid % HV).to(tl.int64)
    hk = hv // GROUP
    rk, rc = tl.arange(0, BK), tl.arange(0, C)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    ok_k, ok_v, ok_n = rk < DK, cols < DV, rc < N
    q = _rows(q_ptr + b * sq_b + hk * sq_h, 0, N, sq_t, rk, DK, eps, L2NORM, C) * scale
    k = _rows(k_ptr + b * sk_b + hk * sk_h, 0, N, sk_t, rk, DK, eps, L2NORM, C)
    v = tl.load(v_ptr + b * sv_b + hv * sv_h + rc[:, None] * sv_t + cols[None, :],
                mask=ok_n[:, None] & ok_v[None, :], other=0.0).to(tl.float32)  # fmt: skip
    g = tl.load(g_ptr + b * sg_b + hv * sg_h + rc * sg_t, mask=ok_n, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + b * sbt_b + hv * sbt_h + rc * sbt_t, mask=ok_n, other=0.0).to(tl.float32)
    # anc[i, j]: node j is i itself or one of its ancestors (rows and columns past N: none)
    anc = tl.load(anc_ptr + rc[:, None] * N + rc[None, :], mask=ok_n[:, None] & ok_n[None, :], other=0) != 0
    gp = tl.sum(tl.where(anc, g[None, :], 0.0), 1)  # the log decay from the state entering the step to each node
    strict = anc & (rc[:, None] != rc[None, :])
    # exp only where the mask keeps it (off the path gp_i - gp_j may be > 0 and overflow)
    kb = k * beta[:, None]
    n = tl.where(strict, -tl.dot(kb, tl.trans(k), input_precision=PREC)
                 * tl.exp(tl.where(strict, gp[:, None] - gp[None, :], 0.0)), 0.0)  # fmt: skip
    inv = _unit_lower_inverse(n, rc, C, SUB, PREC)
    w = tl.dot(inv, kb * tl.exp(gp)[:, None], input_precision=PREC)
    u = tl.dot(inv, v * beta[:, None], input_precision=PREC)
    if HAS_H0:
        h = tl.load(h0_ptr + (b * HV + hv) * DK * DV + rk[:, None] * DV + cols[None, :],
                    mask=ok_k[:, None] & ok_v[None, :], other=0.0).to(tl.float32)  # fmt: skip
    else:
        h = tl.zeros([BK, BV], tl.float32)
    v_new = u - tl.dot(w, h, input_precision=PREC)
    attn = tl.where(anc, tl.dot(q, tl.trans(k), input_precision=PREC)
                    * tl.exp(tl.where(anc, gp[:, None] - gp[None, :], 0.0)), 0.0)  # fmt: skip
    o = tl.dot(q * tl.exp(gp)[:, None], h, input_precision=PREC) + tl.dot(attn, v_new, input_precision=PREC)
    o_at = o_ptr + b * so_b + hv * so_h + rc[:, None] * so_t + cols[None, :]
    tl.store(o_at, o.to(o_ptr.dtype.element_ty), mask=ok_n[:, None] & ok_v[None, :])


def gated_delta_tree_triton(q, k, v, g, beta, anc, h0, o, scale: float, l2norm: bool, eps: float,
                            exact: bool) -> None:  # fmt: skip
    """o `[B, N, HV, DV]` for the N nodes of q, k `[B, N, HK, DK]` (last dim contiguous), v `[B, N, HV, DV]`, g, beta
    `[B, N, HV]`, anc the `[N, N]` int8 ancestor-or-self mask (contiguous), h0 `[B, HV, DK, DV]` contiguous fp32 or
    None (zeros); exact: IEEE fp32 products (else TF32 on a GPU)."""
    batch, nodes, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if batch == 0 or hv == 0 or dv == 0 or nodes == 0:
        return
    bv, c = max(16, min(next_pow2(dv), TREE_BV)), max(SUB_BLOCK, next_pow2(nodes))
    if c not in TREE_WARPS:
        raise CodesignError(f"the Triton tree form holds trees of up to {MAX_NODES} nodes, got {nodes}")
    _tree_kernel[(batch * hv, cdiv(dv, bv))](
        q, k, v, g, beta, anc, o if h0 is None else h0, o, nodes, hv, hv // hk, dk, dv, float(scale), float(eps),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(), *o.stride()[:3],
        C=c, SUB=SUB_BLOCK, BK=max(16, next_pow2(dk)), BV=bv, HAS_H0=h0 is not None,
        L2NORM=l2norm, PREC="ieee" if exact else "tf32", num_warps=TREE_WARPS[c],
    )  # fmt: skip
