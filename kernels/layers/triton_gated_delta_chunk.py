"""Triton gated delta rule in chunks (Gated DeltaNet over a prompt: the chunked form of FLA's chunk_gated_delta_rule,
`gated_delta.gated_delta_rule_chunked` in plain torch), three launches, FLA's split:

1. `_prep_kernel`, one program a (sequence, value head, chunk of C tokens), all chunks at once: the chunk's decay
   (the cumulative sum of g), A = (beta K K^T) * decay strictly below the diagonal, its inverse (I + A)^-1 by
   forward substitution in blocks of 16 rows, every step a `tl.dot` (15 within the diagonal blocks, then 2 for the
   second block row: 17 products of 32 x 32 x 32), then w = (I + A)^-1 (beta K exp(cum)) and
   u = (I + A)^-1 (beta V) into fp32 scratch.
2. `_state_kernel`, one program a (sequence, value head, block of BV value columns), the chunks in order with the
   dk x BV state in registers, only what the next chunk needs: v' = u - w S (each token's delta given the state
   entering the chunk, written over u), S <- exp(cum_last) S + (K exp(cum_last - cum))^T v'; the state entering each
   chunk is stored (bf16 for bf16 inputs, as FLA keeps it; else fp32).
3. `_output_kernel`, one program a (sequence, value head, chunk), all chunks at once:
   o = (q exp(cum)) S_in + ((q K^T) * decay, the diagonal kept) v'.

The serial chain is the state walk's two products a chunk; the output's three run in parallel (in one walk, the
first version, the walk's 32-row products were also laid over all 8 warps, Triton's layout for chained dots, each
computed 4 times). q and k are l2-normalised on load, q times the scale. Every product is a `tl.dot` (tensor cores on
a GPU: TF32 for 16-bit inputs, IEEE fp32 for fp32 ones, whose callers asked for fp32). Rows past the prompt's end
load as g = 0, k = q = beta = 0: they add nothing and keep the last row's decay, so cum_last is row C-1's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.host_math import cdiv, next_pow2

CHUNK = 32  # tokens a chunk (FLA and transformers take 64: compiles here too; untimed, docs/kernels.md)
SUB_BLOCK = 16  # rows of the inverse's diagonal blocks (tl.dot's smallest tile)
PREP_WARPS, SCAN_WARPS, SCAN_STAGES, SCAN_BV = 8, 8, 2, 32  # the state walk: fastest predicted, no spills
OUT_WARPS, OUT_BV = 8, 128  # the output launch: every value column a program, q K^T once (state_predict)


@triton.jit
def _rows(ptr, t0, T, s_t, rk, DK, eps, L2NORM: tl.constexpr, C: tl.constexpr):
    """The chunk's C rows of a `[T, DK]` head (row stride s_t) in fp32, zero past T, l2-normalised with L2NORM."""
    rt = tl.arange(0, C).to(tl.int64) + t0
    ok = (rt < T)[:, None] & (rk < DK)[None, :]
    x = tl.load(ptr + rt[:, None] * s_t + rk[None, :], mask=ok, other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.math.rsqrt(tl.sum(x * x, 1) + eps)[:, None]
    return x


@triton.jit
def _cum(g_ptr, t0, T, s_t, C: tl.constexpr):
    """The chunk's cumulative log decay (rows past T add 0)."""
    rt = tl.arange(0, C).to(tl.int64) + t0
    return tl.cumsum(tl.load(g_ptr + rt * s_t, mask=rt < T, other=0.0).to(tl.float32), 0)


@triton.jit
def _unit_lower_inverse(n, rc, C: tl.constexpr, SUB: tl.constexpr, PREC: tl.constexpr):
    """(I - N)^-1 for N strictly lower `[C, C]`, by forward substitution in blocks of SUB rows: within the diagonal
    blocks a row a step (the rows of the same place in every block at once), then block row by block row
    X_b += X_bb N_b,<b X. Stable where the series sum N^k is not (similar keys, beta near 1 and slow decay give A
    entries near 1, whose powers reach C(31, 15) and cancel in fp32)."""
    blk, loc = rc // SUB, rc % SUB
    same = blk[:, None] == blk[None, :]
    nd = tl.where(same, n, 0.0)
    x = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
    for i in range(1, SUB):  # row i of each diagonal block from the rows above it in that block (final already)
        x += tl.dot(tl.where((loc == i)[:, None], nd, 0.0), x, input_precision=PREC)
    xd = x  # the diagonal blocks' inverses
    no = tl.where(same, 0.0, n)
    for b in range(1, C // SUB):  # block row b from the block rows above it (final already)
        r = tl.dot(tl.where((blk == b)[:, None], no, 0.0), x, input_precision=PREC)
        x += tl.dot(xd, r, input_precision=PREC)
    return x


@triton.jit
def _prep_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr,
    T, HV, GROUP, DK, DV, eps,
    sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sbt_b, sbt_t, sbt_h,
    C: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, L2NORM: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    n_chunks = tl.cdiv(T, C)  # (one grid axis: (chunk, sequence, head) past 65535 on no axis's limit)
    pid = tl.program_id(0)
    bh = pid // n_chunks
    b, hv = (bh // HV).to(tl.int64), (bh % HV).to(tl.int64)
    t0 = (pid % n_chunks).to(tl.int64) * C  # (int64: a token stride times T passes 2^31 on long prompts)
    rk, rv, rc = tl.arange(0, BK), tl.arange(0, BVF), tl.arange(0, C)
    k = _rows(k_ptr + b * sk_b + (hv // GROUP) * sk_h, t0, T, sk_t, rk, DK, eps, L2NORM, C)
    v = _rows(v_ptr + b * sv_b + hv * sv_h, t0, T, sv_t, rv, DV, eps, False, C)
    cum = _cum(g_ptr + b * sg_b + hv * sg_h, t0, T, sg_t, C)
    rt = t0 + rc
    beta = tl.load(beta_ptr + b * sbt_b + hv * sbt_h + rt * sbt_t, mask=rt < T, other=0.0).to(tl.float32)
    kb = k * beta[:, None]
    below = rc[:, None] > rc[None, :]
    # exp of the decay only where it is used (above the diagonal cum_i - cum_j > 0 could overflow)
    decay = tl.exp(tl.where(below, cum[:, None] - cum[None, :], 0.0))
    n = tl.where(below, -tl.dot(kb, tl.trans(k), input_precision=PREC) * decay, 0.0)  # N = -A
    inv = _unit_lower_inverse(n, rc, C, SUB, PREC)
    w = tl.dot(inv, kb * tl.exp(cum)[:, None], input_precision=PREC)
    u = tl.dot(inv, v * beta[:, None], input_precision=PREC)
    base = (b * HV + hv) * T
    ok_t = (rt < T)[:, None]
    tl.store(w_ptr + (base + rt[:, None]) * DK + rk[None, :], w, mask=ok_t & (rk < DK)[None, :])
    tl.store(u_ptr + (base + rt[:, None]) * DV + rv[None, :], u, mask=ok_t & (rv < DV)[None, :])


@triton.jit
def _state_kernel(
    k_ptr, g_ptr, w_ptr, u_ptr, h0_ptr, hc_ptr, ht_ptr,
    T, HV, GROUP, DK, DV, eps,
    sk_b, sk_t, sk_h, sg_b, sg_t, sg_h,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, L2NORM: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b, hv = (pid // HV).to(tl.int64), (pid % HV).to(tl.int64)
    rk, rc = tl.arange(0, BK), tl.arange(0, C)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    ok_k, ok_v = rk < DK, cols < DV
    s_off = rk[:, None] * DV + cols[None, :]
    ok_s = ok_k[:, None] & ok_v[None, :]
    if HAS_H0:
        h = tl.load(h0_ptr + (b * HV + hv) * DK * DV + s_off, mask=ok_s, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BK, BV], tl.float32)
    k_head, g_head = k_ptr + b * sk_b + (hv // GROUP) * sk_h, g_ptr + b * sg_b + hv * sg_h
    base = (b * HV + hv) * T
    hc_head = hc_ptr + (b * HV + hv) * tl.cdiv(T, C) * DK * DV
    for c in range(0, tl.cdiv(T, C)):
        t0 = c * C
        rt = rc.to(tl.int64) + t0  # (int64: a token stride times T passes 2^31 on long prompts)
        ok_t = (rt < T)[:, None]
        # the state entering the chunk, for the output launch (bf16 with bf16 inputs, as FLA keeps it)
        tl.store(hc_head + s_off, h.to(hc_ptr.dtype.element_ty), mask=ok_s)
        hc_head += DK * DV  # (a pointer step: c DK DV would pass 2^31 in int32 on prompts of millions of tokens)
        k = _rows(k_head, t0, T, sk_t, rk, DK, eps, L2NORM, C)
        cum = _cum(g_head, t0, T, sg_t, C)
        w = tl.load(w_ptr + (base + rt[:, None]) * DK + rk[None, :], mask=ok_t & ok_k[None, :], other=0.0)
        u_at = u_ptr + (base + rt[:, None]) * DV + cols[None, :]
        v_new = tl.load(u_at, mask=ok_t & ok_v[None, :], other=0.0) - tl.dot(w, h, input_precision=PREC)
        tl.store(u_at, v_new, mask=ok_t & ok_v[None, :])  # (in place of u: the output pass reads v')
        last = tl.sum(tl.where(rc == C - 1, cum, 0.0), 0)  # (rows past T repeat the last one's)
        k_end = k * tl.exp(last - cum)[:, None]
        h = h * tl.exp(last) + tl.dot(tl.trans(k_end), v_new, input_precision=PREC)
    tl.store(ht_ptr + (b * HV + hv) * DK * DV + s_off, h, mask=ok_s)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, g_ptr, u_ptr, hc_ptr, o_ptr,
    T, HV, GROUP, DK, DV, scale, eps,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sg_b, sg_t, sg_h, so_b, so_t, so_h,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    n_chunks = tl.cdiv(T, C)
    pid = tl.program_id(0)
    bh = pid // n_chunks
    b, hv = (bh // HV).to(tl.int64), (bh % HV).to(tl.int64)
    c = (pid % n_chunks).to(tl.int64)
    t0 = c * C
    hk = hv // GROUP
    rk, rc = tl.arange(0, BK), tl.arange(0, C)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    ok_k, ok_v = rk < DK, cols < DV
    rt = rc.to(tl.int64) + t0
    ok_t = (rt < T)[:, None]
    q = _rows(q_ptr + b * sq_b + hk * sq_h, t0, T, sq_t, rk, DK, eps, L2NORM, C) * scale
    k = _rows(k_ptr + b * sk_b + hk * sk_h, t0, T, sk_t, rk, DK, eps, L2NORM, C)
    cum = _cum(g_ptr + b * sg_b + hv * sg_h, t0, T, sg_t, C)
    h = tl.load(hc_ptr + ((b * HV + hv) * n_chunks + c) * DK * DV + rk[:, None] * DV + cols[None, :],
                mask=ok_k[:, None] & ok_v[None, :], other=0.0).to(tl.float32)  # fmt: skip
    v_new = tl.load(u_ptr + ((b * HV + hv) * T + rt[:, None]) * DV + cols[None, :], mask=ok_t & ok_v[None, :],
                    other=0.0)  # fmt: skip
    causal = rc[:, None] >= rc[None, :]
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0))
    attn = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PREC) * decay, 0.0)
    o = tl.dot(q * tl.exp(cum)[:, None], h, input_precision=PREC) + tl.dot(attn, v_new, input_precision=PREC)
    o_at = o_ptr + b * so_b + hv * so_h + rt[:, None] * so_t + cols[None, :]
    tl.store(o_at, o.to(o_ptr.dtype.element_ty), mask=ok_t & ok_v[None, :])


def chunk_states(batch: int, heads: int, tokens: int, dk: int, dv: int, dtype, device):
    """The scratch for the state entering each chunk: bf16 for bf16 inputs (as FLA keeps it: its range is fp32's),
    fp32 for fp16 (a state past 65504 would overflow it) and fp32 inputs."""
    import torch

    keep = dtype if dtype == torch.bfloat16 else torch.float32
    return torch.empty(batch, heads, cdiv(tokens, CHUNK), dk, dv, dtype=keep, device=device)


def block_v_chunk(dv: int) -> int:
    """Value columns a scan program holds: 32 (its 128 x 32 fp32 state beside the chunk's tiles)."""
    return min(next_pow2(dv), SCAN_BV)


def gated_delta_chunk_triton(q, k, v, g, beta, h0, o, ht, w, u, hc, scale: float, l2norm: bool, eps: float,
                             exact: bool) -> None:  # fmt: skip
    """As `triton_gated_delta.gated_delta_triton` (shapes there), in chunks of CHUNK; w `[B, HV, T, DK]` and u
    `[B, HV, T, DV]` fp32 scratch, hc `[B, HV, cdiv(T, CHUNK), DK, DV]` (`chunk_states`), all contiguous; exact: IEEE
    fp32 products (else TF32 on a GPU)."""
    batch, tokens, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if batch == 0 or hv == 0 or dv == 0:
        return
    prec = "ieee" if exact else "tf32"
    bk, bv = max(16, next_pow2(dk)), max(16, block_v_chunk(dv))
    if tokens:
        _prep_kernel[(cdiv(tokens, CHUNK) * batch * hv,)](
            k, v, g, beta, w, u, tokens, hv, hv // hk, dk, dv, float(eps),
            *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
            C=CHUNK, SUB=SUB_BLOCK, BK=bk, BVF=max(16, next_pow2(dv)), L2NORM=l2norm, PREC=prec,
            num_warps=PREP_WARPS, num_stages=1,
        )  # fmt: skip
    n_chunks = cdiv(tokens, CHUNK)
    _state_kernel[(batch * hv, cdiv(dv, bv))](
        k, g, w, u, ht if h0 is None else h0, hc, ht, tokens, hv, hv // hk, dk, dv, float(eps),
        *k.stride()[:3], *g.stride(),
        C=CHUNK, BK=bk, BV=bv, HAS_H0=h0 is not None, L2NORM=l2norm, PREC=prec, num_warps=SCAN_WARPS,
        num_stages=SCAN_STAGES,
    )  # fmt: skip
    if n_chunks:
        bo = min(max(16, next_pow2(dv)), OUT_BV)
        _output_kernel[(n_chunks * batch * hv, cdiv(dv, bo))](
            q, k, g, u, hc, o, tokens, hv, hv // hk, dk, dv, float(scale), float(eps),
            *q.stride()[:3], *k.stride()[:3], *g.stride(), *o.stride()[:3],
            C=CHUNK, BK=bk, BV=bo, L2NORM=l2norm, PREC=prec, num_warps=OUT_WARPS,
        )  # fmt: skip
