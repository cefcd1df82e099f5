"""Loads of one K/V tile for the paged attention kernel (`triton_attention`), shared by the cache formats: each
token's row address through the block table, code words and their unpacking, FP8 codes, (scale, zero) pairs, and the
column splits and joins of a tile over two blocks."""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.triton_codes import unpack_words
from codesign.kernels.triton_planes import plane_words


@triton.jit
def pairs(ptr, mask):
    """fp16 (scale, zero) of the pairs at `ptr` (each pair an aligned int32 word: the launch's META32) by one 4-byte
    load a pair, the scale's bits low; 0 where masked."""
    w = tl.load(ptr.to(tl.pointer_type(tl.int32), bitcast=True), mask=mask, other=0)
    return w.to(tl.int16).to(tl.float16, bitcast=True), (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def tile_rows(ptr, bt_row, start, s_hi, blk, off, kvh, stride_b, stride_s, stride_h, BLOCK_N: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, PER_BLOCK: tl.constexpr):  # fmt: skip
    """[BLOCK_N] pointers to the rows of tokens start .. start + BLOCK_N - 1 (kv head kvh) of a paged tensor
    [blocks, BLOCK_SIZE, heads, ..]. Tiles start at multiples of BLOCK_N, so where one of BLOCK_N and BLOCK_SIZE
    divides the other each block of the tile is a scalar load and one 64-bit base, and a row adds a 32-bit offset
    (and a multiply-add per block past the first), not a 64-bit multiply and sign extension per row. Else, and where
    PER_BLOCK is False, per row from the rows' block ids `blk` (int64) and offsets `off`: the kernel keeps that for
    extend and tree launches, where per-block bases took the bf16 tree tile from 232 registers to 255 (extend 180 to
    212; sm_90, 64 x 4 warps) to save instructions in launches that wait on latency, not issue. Rows past s_hi may
    point anywhere: every load masks them."""
    r = tl.arange(0, BLOCK_N)
    if not PER_BLOCK:
        rows = ptr + blk * stride_b + off * stride_s + kvh * stride_h
    elif BLOCK_SIZE % BLOCK_N == 0:  # one block
        rows = ptr + tl.load(bt_row + start // BLOCK_SIZE).to(tl.int64) * stride_b + kvh * stride_h
        rows = rows + (start % BLOCK_SIZE + r) * stride_s
    elif BLOCK_N % BLOCK_SIZE == 0:  # BLOCK_N / BLOCK_SIZE whole blocks
        # (block steps as multiplies, not selects: Triton's alignment analysis keeps a product's factor of 16, which
        # the 16-byte copies of the codes need, and loses it through a select)
        b0 = start // BLOCK_SIZE
        prev = tl.load(bt_row + b0).to(tl.int64)
        rows = ptr + prev * stride_b + kvh * stride_h + (r % BLOCK_SIZE) * stride_s
        for t in tl.static_range(1, BLOCK_N // BLOCK_SIZE):
            bt = tl.load(bt_row + b0 + t, mask=start + t * BLOCK_SIZE < s_hi, other=0).to(tl.int64)
            rows += (r // BLOCK_SIZE >= t).to(tl.int64) * ((bt - prev) * stride_b)
            prev = bt
    else:
        rows = ptr + blk * stride_b + off * stride_s + kvh * stride_h
    return rows


@triton.jit
def _fp8_e4m3_f16(byte):
    """fp16 value of e4m3fn bytes (int32), exactly, with integer ops and no fp8 type (sm_80, the interpreter):
    the sign, E and M bits moved into fp16's fields read as the e4m3 value times 2^-8 (both biases and the
    subnormals line up), so one exact fp16 multiply by 256 follows; 0x7F/0xFF are NaN."""
    bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
    h = bits.to(tl.int16).to(tl.float16, bitcast=True) * 256.0
    return tl.where((byte & 0x7F) == 0x7F, float("nan"), h)


@triton.jit
def load_fp8_tile(base, s_ptr, kvh, d, kv_m, out_ty: tl.constexpr, HW_FP8: tl.constexpr):
    """FP8: e4m3 codes decoded in hardware (sm_89+) or with integer ops, exact in fp16 (see below for the scale)."""
    raw = tl.load(base + d[None, :], mask=kv_m, other=0)
    if HW_FP8:  # sm_89+: the hardware's e4m3 conversion (NaN codes included), two elements at a time
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        x = _fp8_e4m3_f16(raw.to(tl.int32))
    # e4m3 values are exact in fp16. fp16 tiles leave the head's scale out (the kernel folds the key scale
    # into the scores' row factor and the value scale into the output); fp32 tiles take it per element.
    if out_ty != tl.float16:
        x = x.to(tl.float32) * tl.load(s_ptr + kvh)
    return x


@triton.jit
def load_codes(base, d, row_ok, kv_m, BITS: tl.constexpr, WORDS: tl.constexpr, HEAD_DIM: tl.constexpr,
               DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """int32 [BLOCK_N, DIM_PAD] tile of packed BITS-bit codes from row pointers `base` [BLOCK_N, 1] (0 where masked).

    WORDS (rows of whole int32 words; `base` into an int32 view, strides in words): word w holds elements
    32/BITS * w + i at bits [BITS * i, BITS * (i + 1)), so unpacking a [BLOCK_N, NW] word tile along a new
    last axis and flattening gives the elements in order: one coalesced 4-byte load per 32 / BITS codes.
    Otherwise a byte gather, which loads (and holds in registers) each byte 8 / BITS times."""
    if WORDS:
        PERW: tl.constexpr = 32 // BITS
        NW: tl.constexpr = DIM_PAD // PERW
        w = tl.arange(0, NW)
        words = tl.load(base + w[None, :], mask=row_ok[:, None] & (w < HEAD_DIM // PERW)[None, :], other=0)
        code = tl.reshape(unpack_words(words, BITS), (BLOCK_N, DIM_PAD))
    elif BITS == 8:
        code = tl.load(base + d[None, :], mask=kv_m, other=0).to(tl.int32)
    else:
        PER: tl.constexpr = 8 // BITS
        byte = tl.load(base + (d // PER)[None, :], mask=kv_m, other=0).to(tl.int32)
        code = (byte >> ((d % PER) * BITS)[None, :]) & (2**BITS - 1)
    return code


@triton.jit
def row_major_words(base, j_ok, NW_OK: tl.constexpr, NW: tl.constexpr):
    """int32 [BLOCK_N, NW] words of rows `base` [BLOCK_N, 1] (0 where masked or at or past NW_OK), each thread's
    eight contiguous words of one row, as two loads of four (`w // 4 * 8 + w % 4`, then + 4) joined in registers.
    Triton's coalescing would give one [BLOCK_N, NW] load four words a thread over two rows, and the 8-bit mixed
    tile would then meet the 2- and 4-bit branches' layout (a thread: one row, 32 columns) through shared memory
    (sm_90, 32 x 128 on 4 warps: 4 STS.128, 4 LDS.128 and 3 barriers a tile, K and V each)."""
    w = tl.arange(0, NW // 2)
    at = w // 4 * 8 + w % 4  # each thread's first four words, then its last four (+ 4)
    lo = tl.load(base + at[None, :], mask=j_ok[:, None] & (at < NW_OK)[None, :], other=0)
    hi = tl.load(base + 4 + at[None, :], mask=j_ok[:, None] & (at + 4 < NW_OK)[None, :], other=0)
    x = tl.permute(tl.reshape(tl.join(lo, hi), (lo.shape[0], NW // 8, 4, 2)), (0, 1, 3, 2))  # [row, group, half, k]
    return tl.reshape(x, (lo.shape[0], NW))


@triton.jit
def span_rows(ptr, bt_row, start, s_hi, h: tl.constexpr, kvh, stride_b, stride_s, stride_h, HALF: tl.constexpr):
    """[HALF] pointers to the rows of block `start // HALF + h` (a tile of two whole blocks of HALF tokens) and its
    block id (0 where the tile ends before it: every row then masked, its fp16 codes read from block 0 and unused,
    `mixed_span_codes`), one scalar load of the block table."""
    ok = start + h * HALF < s_hi
    bt = tl.load(bt_row + start // HALF + h, mask=ok, other=0).to(tl.int64)
    return ptr + bt * stride_b + kvh * stride_h + tl.arange(0, HALF) * stride_s, bt


@triton.jit
def cat_cols(a, b):
    """[M, 2 N]: a [M, N] then b beside it, in registers (a join: each thread's elements of a and b side by side)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def split_cols(x):
    """The two column halves of x [M, 2 N] (`cat_cols` undone), in registers."""
    return tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))


@triton.jit
def load_words(crow, j_ok, BITS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
               PLANES: tl.constexpr = False):  # fmt: skip
    """The int32 code words of a per-token tile's rows (`_load_code_tile`'s word-pair path), [BLOCK_N, words]; for
    code planes `plane_words`' tile (2 bits: int16 half-words, [BLOCK_N, 2 words])."""
    PERW: tl.constexpr = 32 // BITS
    if PLANES:
        words = plane_words(crow[:, None], j_ok[:, None], BITS, HEAD_DIM, DIM_PAD)
    else:
        w = tl.arange(0, DIM_PAD // PERW)
        words = tl.load(crow[:, None] + w[None, :], mask=j_ok[:, None] & (w < HEAD_DIM // PERW)[None, :], other=0)
    return words
