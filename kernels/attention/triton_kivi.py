"""KIVI's tiles for the paged attention kernel (`triton_attention`, KV_FORMAT_KIVI): per-channel key (scale, zero) per
group of tokens, per-token value metadata, the residual ring's rows, and the key and value tiles as code planes."""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.attention.triton_tiles import load_codes, pairs
from codesign.kernels.triton_codes import codes_f16, pair_cols, words_f16
from codesign.kernels.triton_planes import plane_words, word_planes


@triton.jit
def _kivi_meta(s_ptr, mrow, blk, off, kvh, d, dq, d_ok, c_ok, qm, nq, stride_mb, stride_ms, stride_mh,
               IS_KEY: tl.constexpr, blk0, j0, BLOCK_SIZE: tl.constexpr, KIVI_G: tl.constexpr,
               KIVI_GV: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               RING: tl.constexpr, META32: tl.constexpr, PAIRS: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """KIVI's fp16 (scale, zero) of one tile, each broadcastable to [BLOCK_N, DIM_PAD] (`load_kivi_tile`); dq: each
    column's channel (PAIRS: `pair_order`; the value groups then hold whole words)."""
    # Metadata (fp16, kept so) is loaded at its own size, not per element: a gather of [BLOCK_N, DIM_PAD]
    # scales issues one scalar load per element (KIVI ran at 0.047x the bf16 cache's speed on an H200).
    NGV: tl.constexpr = HEAD_DIM // KIVI_GV
    if IS_KEY and KIVI_G % BLOCK_N == 0:
        # The tile lies in one key group of one block (tiles start at multiples of BLOCK_N, KIVI_G divides
        # the block size): one (scale, zero) row of DIM_PAD channels for the whole tile, and the tile is
        # all codes or all ring (n_q is a multiple of KIVI_G).
        row0 = blk0 * stride_mb + (j0 % BLOCK_SIZE // KIVI_G) * stride_ms + kvh * stride_mh
        m1 = d_ok & (d * 0 + nq > j0) if RING else d_ok  # (vector compare: the interpreter widens a scalar int1)
        if META32:
            sc, zr = pairs(s_ptr + row0 + d * 2, m1)
        else:
            sc = tl.load(s_ptr + row0 + d * 2, mask=m1, other=0.0)
            zr = tl.load(s_ptr + row0 + d * 2 + 1, mask=m1, other=0.0)
        if PAIRS:  # loaded in channel order (contiguous), then permuted in registers
            sc, zr = pair_cols(sc, BITS), pair_cols(zr, BITS)
        sc, zr = sc[None, :], zr[None, :]
    elif IS_KEY and BLOCK_N % KIVI_G == 0 and BLOCK_SIZE % BLOCK_N == 0 and BLOCK_N // KIVI_G <= 8:
        # The tile holds BLOCK_N / KIVI_G whole key groups of one block: one (scale, zero) row per group, each
        # repeated over its group's tokens (as the value scales below), not a gather per element.
        NG: tl.constexpr = BLOCK_N // KIVI_G
        gi = tl.arange(0, NG)
        row0 = blk0 * stride_mb + (j0 % BLOCK_SIZE // KIVI_G + gi) * stride_ms + kvh * stride_mh
        m1 = d_ok[None, :] & (j0 + gi * KIVI_G < nq)[:, None] if RING else d_ok[None, :] & (gi >= 0)[:, None]
        mp = s_ptr + row0[:, None] + dq[None, :] * 2
        sc = tl.reshape(tl.broadcast_to(tl.load(mp, mask=m1, other=0.0)[:, None, :], (NG, KIVI_G, DIM_PAD)),
                        (BLOCK_N, DIM_PAD))  # fmt: skip
        zr = tl.reshape(tl.broadcast_to(tl.load(mp + 1, mask=m1, other=0.0)[:, None, :], (NG, KIVI_G, DIM_PAD)),
                        (BLOCK_N, DIM_PAD))  # fmt: skip
    elif IS_KEY:  # per channel, one (scale, zero) pair per group of KIVI_G tokens: per row
        mp = s_ptr + (blk * stride_mb + (off // KIVI_G) * stride_ms + kvh * stride_mh)[:, None] + dq[None, :] * 2
        sc = tl.load(mp, mask=qm, other=0.0)
        zr = tl.load(mp + 1, mask=qm, other=0.0)
    elif NGV * KIVI_GV == DIM_PAD and NGV <= 8:
        # Per token, one pair per KIVI_GV elements of head_dim: a [BLOCK_N, NGV] load, each pair repeated
        # over its group's columns (a broadcast and an order-keeping reshape: no select per element).
        gi = tl.arange(0, NGV)
        mp = mrow[:, None] + 2 * gi[None, :]
        rq = c_ok[:, None] & (gi >= 0)[None, :]
        if META32:
            sg, zg = pairs(mp, rq)
        else:
            sg, zg = tl.load(mp, mask=rq, other=0.0), tl.load(mp + 1, mask=rq, other=0.0)
        sc = tl.reshape(tl.broadcast_to(sg[:, :, None], (BLOCK_N, NGV, KIVI_GV)), (BLOCK_N, DIM_PAD))
        zr = tl.reshape(tl.broadcast_to(zg[:, :, None], (BLOCK_N, NGV, KIVI_GV)), (BLOCK_N, DIM_PAD))
    elif NGV <= 8:
        # Per token, one pair per KIVI_GV elements of head_dim: NGV [BLOCK_N] loads, spread over columns.
        rq = c_ok
        sc = tl.zeros([BLOCK_N, DIM_PAD], s_ptr.dtype.element_ty)
        zr = tl.zeros([BLOCK_N, DIM_PAD], s_ptr.dtype.element_ty)
        for g in tl.static_range(NGV):
            in_g = (dq // KIVI_GV == g)[None, :]
            sc = tl.where(in_g, tl.load(mrow + 2 * g, mask=rq, other=0.0)[:, None], sc)
            zr = tl.where(in_g, tl.load(mrow + 2 * g + 1, mask=rq, other=0.0)[:, None], zr)
    else:  # many small value groups: gather per element
        mp = s_ptr + (blk * stride_mb + off * stride_ms + kvh * stride_mh)[:, None] + ((dq // KIVI_GV) * 2)[None, :]
        sc = tl.load(mp, mask=qm, other=0.0)
        zr = tl.load(mp + 1, mask=qm, other=0.0)
    return sc, zr


@triton.jit
def kivi_key_planes(words, mrow, BITS: tl.constexpr, HEAD_DIM: tl.constexpr, META32: tl.constexpr,
                    INTERPRETED: tl.constexpr):  # fmt: skip
    """A KIVI key tile of codes only, inside one key group, as dequantized code planes (`word_planes` of `plane_words`):
    plane j (channels PERW w + j) times its channels' fp16 scales plus their zeros (mrow: the group's (scale, zero)
    row), one fp16 multiply-add an element as the joined tile's; each plane stays an elementwise function of the
    words, so it reaches the dot without a shared-memory round trip."""
    PERW: tl.constexpr = 8 if BITS == 2 else 32 // BITS  # planes
    w = tl.arange(0, words.shape[1])  # the word columns (`plane_words`)
    planes = word_planes(words, BITS, INTERPRETED)
    out = ()
    for pj in tl.static_range(PERW):
        ch = PERW * w + pj
        if META32:
            sc, zr = pairs(mrow + ch * 2, ch < HEAD_DIM)
        else:
            sc = tl.load(mrow + ch * 2, mask=ch < HEAD_DIM, other=0.0)
            zr = tl.load(mrow + ch * 2 + 1, mask=ch < HEAD_DIM, other=0.0)
        out = out + (planes[pj] * sc[None, :] + zr[None, :],)
    return out


@triton.jit
def _value_group(w, WORDS_PER_GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """The value group of word column w (its own function: the tests mutate it)."""
    return w // WORDS_PER_GROUP


@triton.jit
def kivi_value_planes(base, mrow, j_ok, j, nq, rrow, BITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      DIM_PAD: tl.constexpr, KIVI_GV: tl.constexpr, META32: tl.constexpr, RING: tl.constexpr,
                      INTERPRETED: tl.constexpr):  # fmt: skip
    """A KIVI value tile as dequantized code planes (`word_planes` of `plane_words`): plane j (channels PERW w + j)
    times its token's group (scale, zero). A value group holds whole words (KIVI_GV a multiple of PERW), so column
    w's group is w // (KIVI_GV / PERW) in every plane: one [BLOCK_N, words] load of pairs serves all planes. RING:
    tokens at or past nq come from the fp16 ring rows `rrow`, read plane by plane (channel PERW w + j). Each plane
    stays an elementwise function of loaded tiles, so it reaches the dot without a shared-memory round trip."""
    PERW: tl.constexpr = 8 if BITS == 2 else 32 // BITS  # planes (2 bits: of half-words)
    w = tl.arange(0, DIM_PAD // PERW)
    w_ok = w < HEAD_DIM // PERW
    c_ok = j_ok & (j < nq) if RING else j_ok
    m_ok = c_ok[:, None] & w_ok[None, :]
    planes = word_planes(plane_words(base, c_ok[:, None], BITS, HEAD_DIM, DIM_PAD), BITS, INTERPRETED)
    at = mrow[:, None] + _value_group(w, KIVI_GV // PERW, DIM_PAD // KIVI_GV)[None, :] * 2
    if META32:
        sc, zr = pairs(at, m_ok)
    else:
        sc = tl.load(at, mask=m_ok, other=0.0)
        zr = tl.load(at + 1, mask=m_ok, other=0.0)
    out = ()
    for pj in tl.static_range(PERW):
        x = planes[pj] * sc + zr
        if RING:
            r_ok = (j_ok & (j >= nq))[:, None] & w_ok[None, :]
            xr = tl.load(rrow[:, None] + (PERW * w + pj)[None, :], mask=r_ok, other=0.0).to(tl.float16)
            x = tl.where((j < nq)[:, None], x, xr)
        out = out + (x,)
    return out


@triton.jit
def load_kivi_tile(base, s_ptr, mrow, blk, off, kvh, d, j_ok, kv_m, stride_mb, stride_ms, stride_mh,
                   out_ty: tl.constexpr,
                   BITS: tl.constexpr, j, b, nq, r_ptr, stride_rb, stride_rr, stride_rh, IS_KEY: tl.constexpr, blk0,
                   j0, d_ok, BLOCK_SIZE: tl.constexpr, KIVI_G: tl.constexpr, KIVI_GV: tl.constexpr,
                   KIVI_R: tl.constexpr, HEAD_DIM: tl.constexpr, WORDS: tl.constexpr, DIM_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, RING: tl.constexpr, META32: tl.constexpr, dq,
                   PAIRS: tl.constexpr):  # fmt: skip
    """KIVI: tokens below n_q from the codes (keys per channel over KIVI_G tokens, values per token over KIVI_GV
    elements), the newer ones from the sequence's residual ring (RING False: the caller's tile is all codes).
    PAIRS: fp16 codes by `words_f16`, columns in `pair_order` (dq: each column's channel), as the INT formats'."""
    if RING:
        c_ok = j_ok & (j < nq)
        quant = (j < nq)[:, None]
        qm = kv_m & quant
    else:  # no ring row in the tile: no compare or select against n_q
        c_ok = j_ok
        qm = kv_m
    if PAIRS:
        PERW: tl.constexpr = 32 // BITS
        w = tl.arange(0, DIM_PAD // PERW)
        words = tl.load(base + w[None, :], mask=c_ok[:, None] & (w < HEAD_DIM // PERW)[None, :], other=0)
        code = tl.reshape(words_f16(words, BITS), (BLOCK_N, DIM_PAD))  # fp16 already
    else:
        code = load_codes(base, d, c_ok, qm, BITS, WORDS, HEAD_DIM, DIM_PAD, BLOCK_N)
    sc, zr = _kivi_meta(s_ptr, mrow, blk, off, kvh, d, dq, d_ok, c_ok, qm, nq, stride_mb, stride_ms, stride_mh, IS_KEY,
                        blk0, j0, BLOCK_SIZE, KIVI_G, KIVI_GV, HEAD_DIM, DIM_PAD, BLOCK_N, RING, META32, PAIRS,
                        BITS)  # fmt: skip
    if PAIRS:
        cf = code
    elif out_ty == tl.float16:
        cf = codes_f16(code)
    if not RING:  # masked rows and columns load code, scale and zero 0: they dequantize to 0 with no select
        if out_ty == tl.float16:
            x = cf * sc + zr
        else:
            x = code.to(tl.float32) * sc.to(tl.float32) + zr.to(tl.float32)
    else:
        ring = (j % (KIVI_G + KIVI_R)) * stride_rr  # the residual ring row of token j
        rp = r_ptr + b * stride_rb + kvh * stride_rh + ring[:, None] + d[None, :]
        if out_ty == tl.float16:
            # fp16 codes by bit patterns and one fused multiply-add in fp16 with the stored fp16 (scale, zero):
            # one rounding (2^-11, finer than the bf16 tiles this replaces) and no per-element conversion (an
            # int-to-float and a float-to-bf16 cvt each ran at 16 per clock per SM).
            xr = tl.load(rp, mask=kv_m & ~quant, other=0.0).to(tl.float16)
            if PAIRS:  # ring rows read in channel order (contiguous), then permuted in registers
                xr = pair_cols(xr, BITS)
            x = tl.where(quant, cf * sc + zr, xr)
        else:
            xr = tl.load(rp, mask=kv_m & ~quant, other=0.0).to(tl.float32)
            x = tl.where(quant, code.to(tl.float32) * sc.to(tl.float32) + zr.to(tl.float32), xr)
        x = tl.where(kv_m, x, 0.0)
    return x
