"""The mixed-precision cache's code tiles for the paged attention kernel (`triton_attention`, KV_FORMAT_MIXED):
each block's codes at its own width (`block_bits`), in one column order for every width, and tiles over two blocks
read block by block."""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.attention.triton_tiles import load_codes, row_major_words
from codesign.kernels.triton_codes import chunk_words_f16, opaque_f16


@triton.jit
def _mixed_words(base, j_ok, kv_m, d, BITS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, out_ty: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """One width's tile of a mixed-precision block read as words: fp16 tiles by `chunk_words_f16` (one column order
    for every width, which q and the output follow), else int32 codes in order. 8 bits: `row_major_words`, so each
    thread holds one row's 32 columns as the 4- and 2-bit tiles do and the branches meet without shared memory."""
    if out_ty == tl.float16:
        PERW: tl.constexpr = 32 // BITS
        if BITS == 8 and DIM_PAD // PERW >= 8:  # (head_dim 16: 4 words a row, one load already holds a row)
            words = row_major_words(base, j_ok, HEAD_DIM // PERW, DIM_PAD // PERW)
        else:
            w = tl.arange(0, DIM_PAD // PERW)
            words = tl.load(base + w[None, :], mask=j_ok[:, None] & (w < HEAD_DIM // PERW)[None, :], other=0)
        code = chunk_words_f16(words, BITS, INTERPRETED)
    else:
        code = load_codes(base, d, j_ok, kv_m, BITS, True, HEAD_DIM, DIM_PAD, BLOCK_N)
    return code


@triton.jit
def mixed_block_words(base, j_ok, kv_m, d, blk, bits_ptr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                      BLOCK_N: tl.constexpr, out_ty: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """A tile of rows inside one mixed block (`_mixed_words`), its width read from the block's entry: one runtime
    branch a width, each yielding the same register layout."""
    nb = tl.load(bits_ptr + blk)
    if nb == 8:
        code = _mixed_words(base, j_ok, kv_m, d, 8, HEAD_DIM, DIM_PAD, BLOCK_N, out_ty, INTERPRETED)
    elif nb == 4:
        code = _mixed_words(base, j_ok, kv_m, d, 4, HEAD_DIM, DIM_PAD, BLOCK_N, out_ty, INTERPRETED)
    else:
        code = _mixed_words(base, j_ok, kv_m, d, 2, HEAD_DIM, DIM_PAD, BLOCK_N, out_ty, INTERPRETED)
    return code


@triton.jit
def mixed_span_codes(crow, crow1, blk0, blk1, start, s_hi, d, d_ok, bits_ptr, HEAD_DIM: tl.constexpr,
                     DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, out_ty: tl.constexpr,
                     INTERPRETED: tl.constexpr):  # fmt: skip
    """The codes of a tile of two whole mixed blocks (rows crow, then crow1) as two tiles, each read at its own width
    (`mixed_block_words`), so the per-tile work that does not depend on the width (softmax, addresses, metadata,
    the loop) is paid once per two blocks. Kept apart, a dot each: stacked along rows (a join), the pair sits in
    the register order of a row pair, and the fp16 operand's shared-memory store repacks it (sm_90, bf16, head_dim
    128: ~70 byte permutes a tile)."""
    HALF: tl.constexpr = BLOCK_N // 2
    r = start + tl.arange(0, HALF)
    ok0 = r < s_hi
    ok1 = r + HALF < s_hi
    if out_ty == tl.float16:
        # Rows past the end are read unmasked: every row lies in an allocated block (block 0 once the tile has ended,
        # `span_rows`), any bytes unpack to finite fp16 codes (`chunk_words_f16`), and those rows meet masked scores
        # and zero probabilities. Masked, each load took a zero fill, and the 2- and 4-bit loads a branch.
        ok0 = tl.full([HALF], 1, tl.int1)
        ok1 = ok0
    c0 = mixed_block_words(crow[:, None], ok0, ok0[:, None] & d_ok[None, :], d, blk0, bits_ptr, HEAD_DIM, DIM_PAD,
                           HALF, out_ty, INTERPRETED)  # fmt: skip
    c1 = mixed_block_words(crow1[:, None], ok1, ok1[:, None] & d_ok[None, :], d, blk1, bits_ptr, HEAD_DIM, DIM_PAD,
                           HALF, out_ty, INTERPRETED)  # fmt: skip
    if out_ty == tl.float16:
        c0 = opaque_f16(c0, INTERPRETED)
        c1 = opaque_f16(c1, INTERPRETED)
    else:
        c0 = c0.to(out_ty)
        c1 = c1.to(out_ty)
    return c0, c1
