"""Triton Mamba-2 scan over a token tree (a tree speculative step's verification through Granite 4.0-H's, Bamba's or
Nemotron-H's Mamba-2 layers): every node's output as if its path from the root had run token by token, one launch.

SSD is linear in its inputs, so the chunked form (`triton_ssd_chunk`) of one chunk holding the whole tree, with the
causal mask replaced by the ancestor mask and the cumulative decay by the decay summed down each node's path
(cum_i = sum of dt A over i's path), is each path's recurrence exactly (no inverse, unlike Gated DeltaNet's)::

    y = ((C B^T) * exp(cum_i - cum_j) over i's ancestors and i itself) (dt x) + (C S0^T) exp(cum) + D x

One program a (sequence, head, block of BP head-dim rows), the tree's nodes (up to MAX_NODES, padded to a power of
two >= 16) and the BP x N slice of the state entering the step in registers, three `tl.dot`s. dt after its bias and
softplus, as the one-token update takes it (no clamp to a time-step limit: transformers' step and mamba_ssm's
apply none). No state is written: the caller keeps the accepted path's by the update over that path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.host_math import cdiv, next_pow2
from codesign.kernels.layers.triton_ssd_update import softplus
from codesign.specs import CodesignError

MAX_NODES = 64  # nodes one program holds
TREE_BP, TREE_WARPS = 64, 4  # head-dim rows and warps a program: no spills on sm_90 up to 64 nodes (254 registers)


@triton.jit
def _ssd_tree_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, bias_ptr, anc_ptr, h0_ptr, y_ptr,
    NODES, H, GROUP, P, N,
    sx_b, sx_t, sx_h, sdt_b, sdt_t, sdt_h, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g, sy_b, sy_t, sy_h,
    C: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr, HAS_H0: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b, h = (pid // H).to(tl.int64), (pid % H).to(tl.int64)
    grp = h // GROUP
    rc, rn = tl.arange(0, C), tl.arange(0, BN)
    rp = tl.program_id(1) * BP + tl.arange(0, BP)
    ok_p, ok_n, ok_t = rp < P, rn < N, rc < NODES
    a_h = tl.load(a_ptr + h).to(tl.float32)
    dt = tl.load(dt_ptr + b * sdt_b + h * sdt_h + rc * sdt_t, mask=ok_t, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)
    dt = tl.where(ok_t, dt, 0.0)
    # anc[i, j]: node j is i itself or one of its ancestors (rows and columns past the tree: none)
    anc = tl.load(anc_ptr + rc[:, None] * NODES + rc[None, :], mask=ok_t[:, None] & ok_t[None, :], other=0) != 0
    cum = tl.sum(tl.where(anc, (dt * a_h)[None, :], 0.0), 1)  # the log decay from the step's state to each node
    x = tl.load(x_ptr + b * sx_b + h * sx_h + rc[:, None] * sx_t + rp[None, :], mask=ok_t[:, None] & ok_p[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    ok_tn = ok_t[:, None] & ok_n[None, :]
    bm = tl.load(b_ptr + b * sb_b + grp * sb_g + rc[:, None] * sb_t + rn[None, :], mask=ok_tn, other=0.0)
    cm = tl.load(c_ptr + b * sc_b + grp * sc_g + rc[:, None] * sc_t + rn[None, :], mask=ok_tn, other=0.0)
    bm, cm = bm.to(tl.float32), cm.to(tl.float32)
    # exp only where the mask keeps it (off the path cum_i - cum_j may be > 0 and overflow)
    scores = tl.where(anc, tl.dot(cm, tl.trans(bm), input_precision=PREC)
                      * tl.exp(tl.where(anc, cum[:, None] - cum[None, :], 0.0)), 0.0)  # fmt: skip
    y = tl.dot(scores, x * dt[:, None], input_precision=PREC)
    if HAS_H0:
        s = tl.load(h0_ptr + (b * H + h) * P * N + rp[:, None] * N + rn[None, :], mask=ok_p[:, None] & ok_n[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        y += tl.dot(cm, tl.trans(s), input_precision=PREC) * tl.exp(cum)[:, None]
    if HAS_D:
        y += x * tl.load(d_ptr + h).to(tl.float32)
    tl.store(y_ptr + b * sy_b + h * sy_h + rc[:, None] * sy_t + rp[None, :], y.to(y_ptr.dtype.element_ty),
             mask=ok_t[:, None] & ok_p[None, :])  # fmt: skip


def ssd_tree_triton(x, dt, A, B, C, D, dt_bias, anc, h0, y, softplus: bool, exact: bool) -> None:
    """x and y `[Bt, NODES, H, P]` (last dims contiguous), dt `[Bt, NODES, H]`, A, D, dt_bias `[H]` contiguous, B and C
    `[Bt, NODES, G, N]` (last dims contiguous), anc the `[NODES, NODES]` int8 ancestor-or-self mask, h0 `[Bt, H, P, N]`
    contiguous or None (zeros); exact: IEEE fp32 products (else TF32 on a GPU)."""
    batch, nodes, heads, p = x.shape
    n = B.shape[-1]
    if batch == 0 or heads == 0 or p == 0 or nodes == 0:
        return
    if nodes > MAX_NODES:
        raise CodesignError(f"the Triton tree form holds trees of up to {MAX_NODES} nodes, got {nodes}")
    bp = max(16, min(next_pow2(p), TREE_BP))
    _ssd_tree_kernel[(batch * heads, cdiv(p, bp))](
        x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, anc, y if h0 is None else h0, y,
        nodes, heads, heads // B.shape[2], p, n,
        *x.stride()[:3], *dt.stride(), *B.stride()[:3], *C.stride()[:3], *y.stride()[:3],
        C=max(16, next_pow2(nodes)), BP=bp, BN=max(16, next_pow2(n)), HAS_D=D is not None,
        HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus, HAS_H0=h0 is not None, PREC="ieee" if exact else "tf32",
        num_warps=TREE_WARPS,
    )  # fmt: skip
