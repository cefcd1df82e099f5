"""Triton kernels for paged attention: one kernel for decode, extend (chunked prefill) and tree
verification, plus the split-KV (flash-decoding) reduction.

Per query token i of sequence b (kv_len = context_lens[b] includes the new tokens, q_len new tokens
sit at the end of the cache, prefix = kv_len - q_len):

    s_ij = softcap(scale * q_i . k_j) + alibi_h * (pos_j - pos_i)      softcap(x) = c * tanh(x / c)
    o_i  = sum_j softmax_j(s_ij | visible(i, j)) v_j,   lse_i = log sum_j exp(s_ij)   (natural log)

visible(i, j): causal mode j <= prefix + i; tree mode j < prefix or mask_b[i, j - prefix];
with a window W also pos_i - pos_j < W (the W most recent positions, the query's own included).

Programs: axis 0 walks (sequence, block of BLOCK_Q query tokens) — the sequence found by binary
search over cu_seqlens_q, so the grid needs no host sync; axis 1 a kv head, whose GROUP query
heads share each K/V load (rows = BLOCK_Q tokens x GROUP_PAD heads); axis 2 a KV split. With
NUM_SPLITS > 1 each split writes a normalized partial output and its log2-sum-exp, and
`_reduce_splits_kernel` merges them. Softmax runs online in fp32, in base 2 (exp2 is cheaper). K/V tiles
start at multiples of BLOCK_N (a window's first key is rounded down; the mask drops the extra keys), so a
tile never straddles a KIVI key group or, when BLOCK_N divides the block size, a block.

The K/V read path takes a KV_FORMAT constexpr (the codes of `kvcache.formats`) and scale pointers (unused
for plain caches): the quantized caches of `codesign.kernels.kvcache` dequantize inside this same loop,
tile by tile in registers (no dequantized copy of the cache), with a module of jit helpers per format family
(`triton_kivi`, `triton_mixed`, `triton_oaken`; the loads they share in `triton_tiles`):
  KV_FORMAT_INT: packed BITS-bit codes `[blocks, block_size, kv_heads, D * BITS / 8]` uint8 and
      (scale, zero) fp16 `[blocks, block_size, kv_heads, 2]`:  x = code * scale + zero.
  KV_FORMAT_FP8: e4m3 codes `[blocks, block_size, kv_heads, D]` (as uint8), fp32 scale per kv head.
  KV_FORMAT_KIVI: packed codes as INT; key (scale, zero) per channel per group of KIVI_G tokens
      `[blocks, block_size / G, kv_heads, D, 2]`, value (scale, zero) per token per KIVI_GV elements
      `[blocks, block_size, kv_heads, D / GV, 2]`; tokens j >= n_q = floor(max(ctx - R, 0) / G) * G
      come from the per-sequence residual ring `[batch, G + R, kv_heads, D]` at row j % (G + R).
  KV_FORMAT_MIXED: per-chunk mixed precision (Cocktail-style): block i holds BITS_i-bit codes
      (8, 4 or 2 from `block_bits[i]`) in the first D * BITS_i / 8 bytes of rows of D bytes, with
      per-token (scale, zero) as INT; one launch covers blocks of every width (decode by default runs one INT
      launch a width instead, `mixed_by_width`).
  KV_FORMAT_OAKEN: dense codes and per-token (scale, zero) as INT (outlier positions hold code 0),
      plus OAKEN_CAP sparse outliers per (block, kv head) `[blocks, kv_heads, CAP]` int32, each
      (position_in_block << 16) | fp16 bits (-1: empty). The kernel reads them through the index the cache
      keeps (`kvcache.oaken.outlier_index`: keys by token, values by channel; `OakenPagedKV.k_index`) and adds
      each one's difference from the dense value to the scores and the output (`oaken_key_corr`,
      `oaken_value_corr`).
  KV_FORMAT_OAKEN_OFFLINE: as OAKEN, but the per-token metadata is uint8 (z, r) on a per-kv-head
      offline grid (base, step) fp32 `[2 (K, V), kv_heads, 2]` (passed as `block_bits`):
      zero = base + z * step, scale = r * step / (2^BITS - 1)   (`kvcache.quantizers.offline_meta`).
The dequantized tile is cast to q's dtype before tl.dot, as a plain cache of that dtype would be.

Which tile, warps, split count and code layout a launch takes is `launch_rules`' (defaults per format, GPU and
shape, over the tuned tables); `plan_launch` here turns them into a launch plan and `paged_attention_triton`
runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from codesign.backend import device_view
from codesign.kernels.attention.launch_rules import (
    WORDS8_DEFAULT,
    choose_num_splits,
    decode_occupancy,
    dim_pad,
    launch_config,
    mixed_reads_words,
    reads_planes,
    reads_value_planes,
    reads_words,
    rows_config,
    rows_layout,
    tile_blocks,
)
from codesign.kernels.attention.options import AttentionBatch, AttentionOptions
from codesign.kernels.attention.triton_kivi import (
    kivi_key_planes,
    kivi_value_planes,
    load_kivi_tile,
)
from codesign.kernels.attention.triton_mixed import (
    mixed_block_words,
    mixed_span_codes,
)
from codesign.kernels.attention.triton_oaken import (
    oaken_key_corr,
    oaken_key_first,
    oaken_key_heads,
    oaken_offline_meta,
    oaken_value_corr,
    oaken_value_first,
    oaken_value_heads,
    rows_max,
    spread_rows,
    through_scratch,
)
from codesign.kernels.attention.triton_tiles import (
    cat_cols,
    load_codes,
    load_fp8_tile,
    load_words,
    pairs,
    span_rows,
    split_cols,
    tile_rows,
)
from codesign.kernels.host_math import next_pow2
from codesign.kernels.kvcache.formats import (
    KV_FORMAT_FP8,
    KV_FORMAT_INT,
    KV_FORMAT_KIVI,
    KV_FORMAT_MIXED,
    KV_FORMAT_OAKEN,
    KV_FORMAT_OAKEN_OFFLINE,
    KV_FORMAT_PLAIN,
    PLAIN_BITS,
)
from codesign.kernels.kvcache.oaken import index_capacity
from codesign.kernels.triton_codes import (
    CODE_UNITS,
    codes_f16,
    opaque_f16,
    pair_order,
    pow2_scale,
    words_f16,
)
from codesign.kernels.triton_planes import plane_words, word_planes_raw

# Formats whose codes meet fp16 / bf16 queries in fp16 products (F16_MMA): codes become fp16 by bit patterns
# (`codes_f16`), not by an integer-to-float conversion per element; queries are scaled per row into fp16's range.
F16_MMA_FORMATS = (KV_FORMAT_INT, KV_FORMAT_FP8, KV_FORMAT_KIVI, KV_FORMAT_MIXED, KV_FORMAT_OAKEN,
                   KV_FORMAT_OAKEN_OFFLINE)  # fmt: skip
MASK_CAUSAL = 0
MASK_TREE = 1
LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * LOG2E)
LN2 = 0.6931471805599453  # lse back to natural log
# The kernel reads a row's mask bits for one tile as a 64-bit window (`tree_mask_words`); a tile starts at most
# BLOCK_N <= 64 keys before the tree, so the packed bits start this far in.
TREE_PAD_BITS = tl.constexpr(64)
# Outlier ranks of Oaken's corrections loaded ahead of the tile's dense part, a trip of its value loops for the ranks
# past them (`oaken_value_first`, `oaken_value_corr`): 10 takes the fullest channel of a block in the bench's cache
# (sm_90) without the loop, whose chain of dependent loads a trip was the tile's critical path.
OAKEN_RANKS = 10
OAKEN_KEY_RANKS = 6  # and of the key side (`oaken_key_first`: the bench cache's fullest token, 6 slots)
# Extend and tree tiles (64 rows) load the index where it is used, a trip of 5 value and 3 key ranks (at 2 ptxas
# unrolled the loop with a straight-line remainder; more spilled the tree's tile).
OAKEN_ROWS_RANKS = 5
OAKEN_ROWS_KEY_RANKS = 3
# The constants above as the jit code reads them (a kernel reads only constexpr globals).
_PLAIN = tl.constexpr(KV_FORMAT_PLAIN)
_INT = tl.constexpr(KV_FORMAT_INT)
_FP8 = tl.constexpr(KV_FORMAT_FP8)
_KIVI = tl.constexpr(KV_FORMAT_KIVI)
_MIXED = tl.constexpr(KV_FORMAT_MIXED)
_OAKEN = tl.constexpr(KV_FORMAT_OAKEN)
_OAKEN_OFFLINE = tl.constexpr(KV_FORMAT_OAKEN_OFFLINE)
_OAKEN_RANKS = tl.constexpr(OAKEN_RANKS)
_OAKEN_KEY_RANKS = tl.constexpr(OAKEN_KEY_RANKS)
_OAKEN_ROWS_RANKS = tl.constexpr(OAKEN_ROWS_RANKS)
_OAKEN_ROWS_KEY_RANKS = tl.constexpr(OAKEN_ROWS_KEY_RANKS)
_CAUSAL = tl.constexpr(MASK_CAUSAL)
_TREE = tl.constexpr(MASK_TREE)
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)
_CODE_UNITS = tl.constexpr(CODE_UNITS)
# Lazy rescaling (`LAZY` below): the running max moves only when a row's max grows past it by more than this (log2
# units: probabilities up to 2^8 = 256, exact in fp16 and far from its range's end).
_RESCALE_TAU = tl.constexpr(8.0)


@triton.jit
def _find_seq(cu_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest b with cu[b] // BLOCK_Q + b <= pid: sequence b's q-blocks start at that index."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_kv_tile(crow, s_ptr, mrow, blk, off, kvh, d, j_ok, kv_m,
                  stride_mb, stride_ms, stride_mh, out_ty: tl.constexpr,
                  KV_FORMAT: tl.constexpr, BITS: tl.constexpr,
                  j, b, nq, r_ptr, stride_rb, stride_rr, stride_rh, IS_KEY: tl.constexpr, blk0, j0, d_ok,
                  BLOCK_SIZE: tl.constexpr,
                  KIVI_G: tl.constexpr, KIVI_GV: tl.constexpr, KIVI_R: tl.constexpr, bits_ptr,
                  HEAD_DIM: tl.constexpr, WORDS: tl.constexpr, DIM_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, HW_FP8: tl.constexpr, RING: tl.constexpr = True,
                  INTERPRETED: tl.constexpr = False, META32: tl.constexpr = False, dq=None,
                  PAIRS: tl.constexpr = False, KPLANES: tl.constexpr = False):  # fmt: skip
    """One [BLOCK_N, DIM_PAD] K or V tile, dequantized to `out_ty` (masked entries 0): the plain, FP8 and KIVI
    caches, one helper per format family (the per-token INT, mixed and Oaken formats take the factored path,
    `_load_code_tile`). RING False: a KIVI tile of codes only (every token below n_q). crow, mrow: the rows'
    pointers into the codes and the per-token metadata (`tile_rows`). KPLANES: a KIVI key tile of codes only as
    dequantized code planes (`kivi_key_planes`), a tuple."""
    base = crow[:, None]
    if KV_FORMAT == _PLAIN:
        x = tl.load(base + d[None, :], mask=kv_m, other=0.0)
    elif KV_FORMAT == _FP8:
        x = load_fp8_tile(base, s_ptr, kvh, d, kv_m, out_ty, HW_FP8)
    elif KPLANES:  # a KIVI key tile of codes only, inside one key group
        words = plane_words(base, j_ok[:, None], BITS, HEAD_DIM, DIM_PAD)
        row0 = blk0 * stride_mb + (j0 % BLOCK_SIZE // KIVI_G) * stride_ms + kvh * stride_mh
        x = kivi_key_planes(words, s_ptr + row0, BITS, HEAD_DIM, META32, INTERPRETED)
    else:
        x = load_kivi_tile(base, s_ptr, mrow, blk, off, kvh, d, j_ok, kv_m, stride_mb, stride_ms, stride_mh, out_ty,
                           BITS, j, b, nq, r_ptr, stride_rb, stride_rr, stride_rh, IS_KEY, blk0, j0, d_ok, BLOCK_SIZE,
                           KIVI_G, KIVI_GV, KIVI_R, HEAD_DIM, WORDS, DIM_PAD, BLOCK_N, RING, META32, dq,
                           PAIRS)  # fmt: skip
    if not KPLANES:
        if WORDS and out_ty == tl.float16:  # codes unpacked by a join tree (`opaque_f16`)
            x = opaque_f16(x.to(out_ty), INTERPRETED)
        x = x.to(out_ty)
    return x


@triton.jit
def _load_code_tile(crow, mrow, blk, d, j_ok, kv_m, out_ty: tl.constexpr, KV_FORMAT: tl.constexpr,
                    BITS: tl.constexpr, bits_ptr, WORDS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, blk0, INTERPRETED: tl.constexpr,
                    META32: tl.constexpr, kvh=0, IS_KEY: tl.constexpr = True, SPAN: tl.constexpr = False,
                    span=None, PLANES: tl.constexpr = False, meta=None, words=None):  # fmt: skip
    """Per-token formats (INT, MIXED, Oaken's dense part): the raw codes of one [BLOCK_N, DIM_PAD] tile as `out_ty`
    (fp16 through `codes_f16`, or fp32; exact either way) and the rows' fp32 (scale, zero), for the factored products
    q . k_j = sc_j (q . c_j) + zr_j sum(q) and sum_j p_j v_j = (p * sc) @ c + sum_j p_j zr_j. The scale and
    zero cost O(BLOCK_N) per tile instead of a multiply-add and two conversions per element. crow, mrow: the rows'
    pointers into the codes and the (scale, zero) pairs (`tile_rows`); kvh, IS_KEY: Oaken offline's grid. SPAN: a
    mixed tile of two whole blocks, crow the first's rows, span the rest (`mixed_span_codes`: two code tiles).
    PLANES: per-token INT8 / INT4 / INT2 words as a tuple of unfinished code planes (`word_planes_raw`: plane j holds
    c 2^(b_j - 24)), each [BLOCK_N, DIM_PAD / P] (P planes: 32 / BITS, or 8 of INT2's half-words).
    meta, words: the rows' (scale, zero) (`_load_meta`) and their code words (`load_words`, the word-pair path)
    already loaded, or None to load them here."""
    base = crow[:, None]
    INT_CODES: tl.constexpr = KV_FORMAT == _INT or KV_FORMAT == _OAKEN or KV_FORMAT == _OAKEN_OFFLINE
    PAIRS: tl.constexpr = INT_CODES and WORDS and out_ty == tl.float16
    if PAIRS:  # `words_f16`: its columns in `pair_order` (the kernel permutes q and o alike)
        if words is None:
            words = load_words(crow, j_ok, BITS, HEAD_DIM, DIM_PAD, PLANES)
        if PLANES:  # c 2^(b - 24), b each plane's `plane_shift`: the kernel folds 2^(24 - b) into q and the output
            code = word_planes_raw(words, BITS, INTERPRETED)
        else:
            code = tl.reshape(words_f16(words, BITS), (BLOCK_N, DIM_PAD))
    elif INT_CODES:
        code = load_codes(base, d, j_ok, kv_m, BITS, WORDS, HEAD_DIM, DIM_PAD, BLOCK_N)
    elif SPAN:  # mixed, a tile of two whole blocks (span: the second block's rows and id, start, s_hi, d_ok)
        code = mixed_span_codes(crow, span[0], blk0, span[1], span[2], span[3], d, span[4], bits_ptr, HEAD_DIM,
                                DIM_PAD, BLOCK_N, out_ty, INTERPRETED)  # fmt: skip
    elif WORDS:
        # Mixed chunks, the tile inside one block (BLOCK_N divides the block size; tiles start at multiples of
        # BLOCK_N): one width for the whole tile, its codes read as int32 words like the INT formats' instead
        # of a byte gather with a shift per row (the mixed cache ran at 1/11 of the bf16 cache on an H200).
        code = mixed_block_words(base, j_ok, kv_m, d, blk0, bits_ptr, HEAD_DIM, DIM_PAD, BLOCK_N, out_ty,
                                 INTERPRETED)  # fmt: skip
    else:
        nbits = tl.load(bits_ptr + blk, mask=j_ok, other=8).to(tl.int32)[:, None]  # per row: its block's width
        per = 8 // nbits
        byte = tl.load(base + d[None, :] // per, mask=kv_m, other=0).to(tl.int32)
        code = (byte >> ((d[None, :] % per) * nbits)) & ((1 << nbits) - 1)
    if meta is None:
        sc, zr = _load_meta(mrow, j_ok, KV_FORMAT, META32, bits_ptr, kvh, IS_KEY, BITS)
    else:
        sc, zr = meta
    if SPAN or PLANES:  # (`mixed_span_codes`: the two halves' tiles; the planes, a tuple)
        x = code
    elif PAIRS or (KV_FORMAT == _MIXED and WORDS and out_ty == tl.float16):
        x = opaque_f16(code, INTERPRETED)
    elif out_ty == tl.float16:
        x = opaque_f16(codes_f16(code), INTERPRETED)
    else:
        x = code.to(out_ty)
    return x, sc, zr


@triton.jit
def _load_meta(mrow, j_ok, KV_FORMAT: tl.constexpr, META32: tl.constexpr, bits_ptr, kvh, IS_KEY: tl.constexpr,
               BITS: tl.constexpr):  # fmt: skip
    """The fp32 (scale, zero) of a per-token tile's rows (`_load_code_tile`)."""
    if KV_FORMAT == _OAKEN_OFFLINE:
        sc, zr = oaken_offline_meta(mrow, j_ok, bits_ptr, kvh, IS_KEY, BITS)
    elif META32:
        sc, zr = pairs(mrow, j_ok)
        sc, zr = sc.to(tl.float32), zr.to(tl.float32)
    else:
        sc = tl.load(mrow, mask=j_ok, other=0.0).to(tl.float32)
        zr = tl.load(mrow + 1, mask=j_ok, other=0.0).to(tl.float32)
    return sc, zr


# Allow-listed (pyproject.toml): a Triton kernel is one program; jit helpers change inlining and registers.
@triton.jit
def _paged_attn_kernel(  # noqa: C901, PLR0915
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, op_ptr, lsep_ptr,
    bt_ptr, ctx_ptr, cu_ptr, pos_ptr, mask_ptr, mask_off_ptr, alibi_ptr,
    k_scale_ptr, v_scale_ptr, stride_mb, stride_ms, stride_mh, stride_vmb, stride_vms, stride_vmh,
    k_res_ptr, v_res_ptr, stride_rb, stride_rr, stride_rh, bits_ptr, scr_ptr,
    sm_scale, softcap, window, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    stride_pt, stride_ph, stride_ps,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    IS_DECODE: tl.constexpr, MASK_MODE: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr, WRITE_LSE: tl.constexpr, KV_FORMAT: tl.constexpr, DOT_PREC: tl.constexpr,
    BITS: tl.constexpr = 16, KIVI_G: tl.constexpr = 1, KIVI_GV: tl.constexpr = 1, KIVI_R: tl.constexpr = 0,
    OAKEN_CAP: tl.constexpr = 0, WORDS: tl.constexpr = False, HW_FP8: tl.constexpr = False,
    OAKEN_NBT: tl.constexpr = 1, F16_MMA: tl.constexpr = False, OAKEN_GP: tl.constexpr = 1,
    INTERPRETED: tl.constexpr = False, META32: tl.constexpr = False, BT_AHEAD: tl.constexpr = True,
    PLANES: tl.constexpr = False, KV_ALIGN: tl.constexpr = 1, VPLANES: tl.constexpr = False,
    SCORE_IO: tl.constexpr = False,
):  # fmt: skip
    if KV_ALIGN > 1:  # the K/V strides' common power of two below 16 (`kv_align`), which Triton does not specialize
        # on: a product with the constant carries it into the alignment analysis (`tl.multiple_of` on a scalar did not)
        stride_kb = stride_kb // KV_ALIGN * KV_ALIGN
        stride_ks = stride_ks // KV_ALIGN * KV_ALIGN
        stride_kh = stride_kh // KV_ALIGN * KV_ALIGN
        stride_vb = stride_vb // KV_ALIGN * KV_ALIGN
        stride_vs = stride_vs // KV_ALIGN * KV_ALIGN
        stride_vh = stride_vh // KV_ALIGN * KV_ALIGN
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if IS_DECODE:
        b = pid
        q_start = pid
        q_len = 1
        q_block = 0
    else:
        b = _find_seq(cu_ptr, num_seqs, pid, BLOCK_Q)
        q_start = tl.load(cu_ptr + b)
        q_len = tl.load(cu_ptr + b + 1) - q_start
        q_block = pid - (q_start // BLOCK_Q + b)
    if q_block * BLOCK_Q < q_len:
        kv_len = tl.load(ctx_ptr + b)
        prefix = kv_len - q_len
        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
        rows = tl.arange(0, BLOCK_M)
        qi = q_block * BLOCK_Q + rows // GROUP_PAD  # query index inside the sequence
        hg = rows % GROUP_PAD
        row_ok = (qi < q_len) & (hg < GROUP)
        qh = kvh * GROUP + hg
        d = tl.arange(0, DIM_PAD)
        d_ok = d < HEAD_DIM
        # INT codes (Oaken's too) read as words meet fp16 queries in `words_f16`'s column order: q and o take it (the
        # permutation stays inside each word, so d_ok and the masks are unchanged).
        INT_CODES: tl.constexpr = KV_FORMAT == _INT or KV_FORMAT == _OAKEN or KV_FORMAT == _OAKEN_OFFLINE
        PAIRS: tl.constexpr = INT_CODES and WORDS and F16_MMA
        # KIVI too where each value group holds whole words (its per-group scales then need no permutation)
        KIVI_PAIRS: tl.constexpr = KV_FORMAT == _KIVI and WORDS and F16_MMA and KIVI_GV % (32 // BITS) == 0
        # KIVI with PLANES: its key tiles of codes only (each inside one key group) as code planes; values joined
        KIVI_KPLANES: tl.constexpr = PLANES and KIVI_PAIRS and KIVI_G % BLOCK_N == 0
        # and its value tiles too (VPLANES, `reads_value_planes`: no more warps than a value plane's column tiles)
        KIVI_VPLANES: tl.constexpr = KIVI_KPLANES and VPLANES
        # Where the output builds up in the dots' accumulators (KIVI's value planes), a tile's rescale is a multiply
        # of every accumulator element (64 a lane a tile on one warp): it runs only in tiles where some row's max
        # grows by more than _RESCALE_TAU (FlashAttention-4's conditional rescale; p <= 2^TAU between rescales, and the
        # sums and the output are taken against the same stale max, so the result is the same softmax).
        LAZY: tl.constexpr = KIVI_VPLANES and IS_DECODE
        # mixed chunks read as words: `chunk_words_f16`'s order (16-element chunks as 2-bit `pair_order`), every width
        MIXED_PAIRS: tl.constexpr = KV_FORMAT == _MIXED and WORDS and F16_MMA
        # mixed tiles of two whole blocks, each read at its own width (`mixed_span_codes`)
        MIXED_SPAN: tl.constexpr = KV_FORMAT == _MIXED and WORDS and BLOCK_N == 2 * BLOCK_SIZE
        if MIXED_PAIRS:
            dq = pair_order(d, 2)
        else:
            dq = pair_order(d, BITS) if PAIRS or KIVI_PAIRS else d
        qt = (q_start + qi).to(tl.int64)
        q = tl.load(
            q_ptr + qt[:, None] * stride_qt + qh[:, None] * stride_qh + dq[None, :],
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )  # fmt: skip
        if MASK_MODE == _TREE:
            qpos = tl.load(pos_ptr + qt, mask=row_ok, other=0)
        else:
            qpos = prefix + qi
        if HAS_ALIBI:
            slope = tl.load(alibi_ptr + qh, mask=row_ok, other=0.0) * _LOG2E

        # Keys this q-block can see: causal stops at its last query; a window starts late.
        if MASK_MODE == _CAUSAL:
            kv_hi = tl.minimum(kv_len, prefix + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len))
            first_pos = prefix + q_block * BLOCK_Q
        else:
            kv_hi = kv_len
            first_pos = prefix  # tree positions are prefix + depth >= prefix
        kv_lo = 0
        if HAS_WINDOW:  # rounded down to a tile boundary (the window mask drops the extra keys): tiles start
            # at multiples of BLOCK_N, which KIVI's per-tile key metadata relies on
            kv_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        per = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        s_lo = kv_lo + split * per
        s_hi = tl.minimum(kv_hi, s_lo + per)

        qk_scale = sm_scale * _LOG2E
        # Per-token formats factor each row's (scale, zero) out of the products (`_load_code_tile`).
        FACTORED: tl.constexpr = (KV_FORMAT == _INT or KV_FORMAT == _MIXED or KV_FORMAT == _OAKEN
                                  or KV_FORMAT == _OAKEN_OFFLINE)  # fmt: skip
        q_sum = tl.sum(q.to(tl.float32), 1)  # padded rows and columns load as 0
        if F16_MMA:
            # fp16 and bf16 queries meet the codes (INT, mixed) or the dequantized tiles (KIVI, Oaken, FP8) in fp16
            # products (`codes_f16`: codes up to 8 bits are exact in fp16, not in bf16's 8-bit significand, and
            # fp16 needs no conversion instruction; KIVI's and Oaken's scales dequantize in fp16). Each row is
            # scaled by a power of two putting its largest element in [2^14, 2^15): every bf16 element within
            # 2^-24 of the row's largest is exact in fp16, and none overflows. Scores are scaled back per row.
            qf = q.to(tl.float32)
            q_f, q_unf = pow2_scale(tl.max(tl.abs(qf), 1), 14)
            q_mma = (qf * q_f[:, None]).to(tl.float16)
            if KV_FORMAT == _FP8:  # FP8: the key head scale joins the row factor (the value's scales the output)
                q_unf = q_unf * tl.load(k_scale_ptr + kvh)
            if MIXED_PAIRS:  # `chunk_words_f16`'s codes are c / CODE_UNITS: the scores take it back here, once
                q_unf = q_unf * _CODE_UNITS
        else:
            q_mma = q
            q_unf = tl.full([BLOCK_M], 1.0, tl.float32)
        # PLANES (`reads_planes`): the dots run over code planes (`word_planes`): q's columns j, j + P, .. meet plane j
        # of the code words (2-bit codes: of their half-words, `plane_words`). Per-token INT: keys and values, the
        # output built up plane by plane (NWP columns each) in units u_acc (the last tile's value scale), so each
        # tile's rescale rides in the dot's accumulator; KIVI: its code-only key tiles (KIVI_KPLANES).
        # Per-token INT's planes come unfinished (`word_planes_raw`: c 2^(b - 24), one AND a code pair against an AND,
        # an OR and a packed subtract or FMA): q's plane j takes 2^-b (exact), the scores 2^24 with the key scales, and
        # each value plane's output 2^(24 - b) at the end.
        RAW_PLANES: tl.constexpr = PLANES and FACTORED
        PW: tl.constexpr = 8 if BITS == 2 else 32 // BITS
        NWP: tl.constexpr = DIM_PAD // PW
        if PLANES:
            wq = tl.arange(0, NWP)
            q_planes = ()
            acc_planes = ()
            for pj in tl.static_range(PW):
                qj = tl.load(q_ptr + qt[:, None] * stride_qt + qh[:, None] * stride_qh + (PW * wq + pj)[None, :],
                             mask=row_ok[:, None], other=0.0)  # fmt: skip
                qjf = qj.to(tl.float32) * q_f[:, None]
                if RAW_PLANES:
                    qjf = qjf * (1.0 / (1 << (BITS * (pj % (8 // BITS)))))  # 2^-b (`plane_shift`)
                q_planes = q_planes + (qjf.to(tl.float16),)
                acc_planes = acc_planes + (tl.zeros([BLOCK_M, NWP], tl.float32),)
            u_acc = sm_scale * 0.0 + 1.0
            z_acc = tl.zeros([BLOCK_M], tl.float32)  # (per-token INT: sum_j p_j zr_j, apart from the planes)
        nq = tl.maximum(kv_len - KIVI_R, 0) // KIVI_G * KIVI_G  # KIVI: tokens below are quantized
        # Oaken's outlier corrections run on the CR = BLOCK_Q x OAKEN_GP rows of real query heads (OAKEN_GP: GROUP
        # to a power of two), not the GROUP_PAD-padded tile (4 rows against 16 at decode). k_res_ptr / v_res_ptr
        # hold the cache's outlier index (`oaken.outlier_index`), scr_ptr each program's scratch (`oaken_scratch_size`):
        # p ([BLOCK_N, CR]), the key corrections ([CR, BLOCK_N]), q ([HEAD_DIM, CR]).
        OAKEN: tl.constexpr = (KV_FORMAT == _OAKEN or KV_FORMAT == _OAKEN_OFFLINE) and OAKEN_CAP > 0
        CR: tl.constexpr = BLOCK_Q * OAKEN_GP
        # Decode loads each tile's code words, metadata and outlier index ahead of the work that waits on them, the
        # next tile's list heads a tile ahead (its chain of dependent loads was the tile's critical path, sm_90); the
        # extend and tree tiles' 64 rows leave no registers for it (the tree spilled 88 B, sm_90), nor fp32 queries
        # (decode in blocks of 16 spilled 16 B, sm_80).
        OAKEN_AHEAD: tl.constexpr = IS_DECODE and F16_MMA
        KR: tl.constexpr = _OAKEN_KEY_RANKS if OAKEN_AHEAD else _OAKEN_ROWS_KEY_RANKS  # ranks a trip: key side
        VR: tl.constexpr = _OAKEN_RANKS if OAKEN_AHEAD else _OAKEN_ROWS_RANKS  # value side
        SPREAD: tl.constexpr = OAKEN_GP < GROUP_PAD  # padded rows (decode on a GPU): a [CR, DIM_PAD] accumulator apart
        if OAKEN:
            cr = tl.arange(0, CR)
            cqi = q_block * BLOCK_Q + cr // OAKEN_GP
            c_ok = (cqi < q_len) & (cr % OAKEN_GP < GROUP)
            qrow = q_ptr + (q_start + cqi).to(tl.int64) * stride_qt + (kvh * GROUP + cr % OAKEN_GP) * stride_qh
            prog = (pid * tl.num_programs(1) + kvh) * NUM_SPLITS + split
            pp = scr_ptr + prog.to(tl.int64) * (2 * CR * BLOCK_N + HEAD_DIM * CR)
            kp = pp + CR * BLOCK_N  # the key corrections
            qtr = kp + CR * BLOCK_N  # q, fp32 channel-major: a key slot's CR rows are one load (`_oaken_key_rank`)
            tl.store(qtr + d[None, :] * CR + cr[:, None],
                     tl.load(qrow[:, None] + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32),
                     mask=d_ok[None, :])  # fmt: skip
            tl.debug_barrier()
            # p stored token-major ([BLOCK_N, CR]): a value slot's CR probabilities are one 16-byte load
            p_at = ((rows // GROUP_PAD) * OAKEN_GP + hg)[:, None] + tl.arange(0, BLOCK_N)[None, :] * CR
            c_at = tl.arange(0, BLOCK_N)[:, None] + cr[None, :] * BLOCK_N  # the [CR, BLOCK_N] rows, in order
            # each tile row's real row there (padding rows: a copy, masked later)
            k_at = ((rows // GROUP_PAD) * OAKEN_GP + hg % OAKEN_GP)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            if SPREAD:
                acc_o = tl.zeros([CR, DIM_PAD], tl.float32)
        # PRESCALED: the scores' scale (sm_scale log2 e, or sm_scale / softcap) rides in q_unf and q_sum, a row's
        # factors taken once, instead of a multiply of every score a tile (not where unscaled score terms are added:
        # Oaken's key corrections and score biases)
        PRESCALED: tl.constexpr = (F16_MMA or FACTORED) and not OAKEN and not SCORE_IO
        if PRESCALED:
            if HAS_SOFTCAP:
                q_unf = q_unf * (sm_scale / softcap)
                q_sum = q_sum * (sm_scale / softcap)
            else:
                q_unf = q_unf * qk_scale
                q_sum = q_sum * qk_scale
        bt_row = bt_ptr + b * stride_bt  # the sequence's block table
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        # Tree verification walks the keys in two phases: the prefix tiles, every key visible (but for a window),
        # with no mask or position loads, as a causal extend walks them; then what is left (the tree's tokens
        # and a partial prefix tile) under the ancestor mask. KIVI (but for tree launches) walks its code-only tiles
        # first, with no select between ring and codes per element, then the rest (the ring, a tile across n_q).
        KIVI_SPLIT: tl.constexpr = KV_FORMAT == _KIVI and MASK_MODE != _TREE
        for phase in tl.static_range(2 if MASK_MODE == _TREE or KIVI_SPLIT else 1):
            if MASK_MODE == _TREE or KIVI_SPLIT:
                edge = prefix if MASK_MODE == _TREE else nq
                mid = s_lo + tl.maximum(tl.minimum(s_hi, edge) - s_lo, 0) // BLOCK_N * BLOCK_N
                lo = s_lo if phase == 0 else mid
                hi = mid if phase == 0 else s_hi
            else:
                lo = s_lo
                hi = s_hi
            # BT_AHEAD: each tile's block ids are loaded one tile ahead (loop-carried): the codes' addresses hang on
            # them, and loaded in the tile that uses them each was an L2 round trip on its critical path (sm_90 tree
            # prefix loop: 8 such loads, each waited on by the next instruction, ~2000 of its 5589 simulated cycles a
            # tile). Not below sm_90: the FP8 tree tile on mma.sync (sm_80, 255 registers) spilled 8 B.
            if BT_AHEAD:
                j_next = lo + tl.arange(0, BLOCK_N)
                blk_next = tl.load(bt_row + j_next // BLOCK_SIZE, mask=j_next < s_hi, other=0)
            if OAKEN and OAKEN_AHEAD:  # the first tile's outlier list heads (`oaken_key_heads`: a tile the next's)
                j_h = lo + tl.arange(0, BLOCK_N)
                blk_h = tl.load(bt_row + j_h // BLOCK_SIZE, mask=j_h < s_hi, other=0).to(tl.int64)
                kheads = oaken_key_heads(k_res_ptr, blk_h, lo, s_hi, kvh, stride_rb, stride_rr, bt_row, OAKEN_CAP,
                                         BLOCK_SIZE, BLOCK_N, OAKEN_NBT)  # fmt: skip
                vheads = oaken_value_heads(v_res_ptr, bt_row, lo, s_hi, kvh, dq, d_ok, stride_rb, stride_rr,
                                           OAKEN_CAP, HEAD_DIM, BLOCK_SIZE, OAKEN_NBT)  # fmt: skip
            for start in range(lo, hi, BLOCK_N):
                j = start + tl.arange(0, BLOCK_N)
                j_ok = j < s_hi
                if BT_AHEAD:
                    blk = blk_next.to(tl.int64)
                    j_next = j + BLOCK_N
                    blk_next = tl.load(bt_row + j_next // BLOCK_SIZE, mask=j_next < s_hi, other=0)
                else:
                    blk = tl.load(bt_row + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
                if MIXED_SPAN:
                    blk0 = 0  # (each block's id from `span_rows` below)
                elif KV_FORMAT == _KIVI or KV_FORMAT == _MIXED:  # the tile's first block: KIVI key meta, mixed widths
                    blk0 = tl.load(bt_ptr + b * stride_bt + start // BLOCK_SIZE).to(tl.int64)
                else:
                    blk0 = 0
                off = j % BLOCK_SIZE
                kv_m = j_ok[:, None] & d_ok[None, :]
                if MIXED_SPAN:  # each block's rows apart (`mixed_span_codes`)
                    krow, blk0 = span_rows(k_ptr, bt_row, start, s_hi, 0, kvh, stride_kb, stride_ks, stride_kh,
                                           BLOCK_SIZE)  # fmt: skip
                    krow1, blk1 = span_rows(k_ptr, bt_row, start, s_hi, 1, kvh, stride_kb, stride_ks, stride_kh,
                                            BLOCK_SIZE)  # fmt: skip
                    kspan = (krow1, blk1, start, s_hi, d_ok)
                else:
                    krow = tile_rows(k_ptr, bt_row, start, s_hi, blk, off, kvh, stride_kb, stride_ks, stride_kh,
                                     BLOCK_N, BLOCK_SIZE, IS_DECODE)  # fmt: skip
                    kspan = None
                kmrow = tile_rows(k_scale_ptr, bt_row, start, s_hi, blk, off, kvh, stride_mb, stride_ms, stride_mh,
                                  BLOCK_N, BLOCK_SIZE, IS_DECODE)  # fmt: skip
                kmeta = None  # (rows' (scale, zero) and code words loaded ahead: Oaken decode, below)
                vmeta = None
                kwords = None
                vwords = None
                if OAKEN and OAKEN_AHEAD:
                    # Every load of the tile first, then the work that waits on them (ptxas moves no load above the
                    # scratch's barrier below): the code words and (scale, zero) of both tiles (the value tile's
                    # were loaded after the softmax, a DRAM round trip there), the outlier corrections' index
                    # (`oaken_key_first`, `oaken_value_first`), then the key corrections' gathers of q.
                    kmeta = _load_meta(kmrow, j_ok, KV_FORMAT, META32, bits_ptr, kvh, True, BITS)
                    vmeta = _load_meta(tile_rows(v_scale_ptr, bt_row, start, s_hi, blk, off, kvh, stride_vmb,
                                                 stride_vms, stride_vmh, BLOCK_N, BLOCK_SIZE, IS_DECODE),
                                       j_ok, KV_FORMAT, META32, bits_ptr, kvh, False, BITS)  # fmt: skip
                    if WORDS and q_mma.dtype == tl.float16:  # (`_load_code_tile`'s word-pair path)
                        kwords = load_words(krow, j_ok, BITS, HEAD_DIM, DIM_PAD)
                        vwords = load_words(tile_rows(v_ptr, bt_row, start, s_hi, blk, off, kvh, stride_vb,
                                                        stride_vs, stride_vh, BLOCK_N, BLOCK_SIZE, IS_DECODE),
                                             j_ok, BITS, HEAD_DIM, DIM_PAD)  # fmt: skip
                    kfirst = oaken_key_first(k_res_ptr, blk, kvh, stride_rb, stride_rr, kheads, KR)
                    vfirst = oaken_value_first(vheads, OAKEN_NBT, VR)
                    # the next tile's list heads (their loads off this tile's critical path)
                    if BT_AHEAD:
                        blk_n = blk_next.to(tl.int64)
                    else:
                        blk_n = tl.load(bt_row + (j + BLOCK_N) // BLOCK_SIZE, mask=j + BLOCK_N < s_hi,
                                        other=0).to(tl.int64)  # fmt: skip
                    kheads = oaken_key_heads(k_res_ptr, blk_n, start + BLOCK_N, s_hi, kvh, stride_rb, stride_rr,
                                             bt_row, OAKEN_CAP, BLOCK_SIZE, BLOCK_N, OAKEN_NBT)  # fmt: skip
                    vheads = oaken_value_heads(v_res_ptr, bt_row, start + BLOCK_N, s_hi, kvh, dq, d_ok, stride_rb,
                                               stride_rr, OAKEN_CAP, HEAD_DIM, BLOCK_SIZE, OAKEN_NBT)  # fmt: skip
                    kcor = oaken_key_corr(kfirst, qtr, CR, BLOCK_N, KR)
                    if SPREAD:  # to the tile's rows through the scratch (used after the dot, below)
                        kadd = through_scratch(kp, c_at, k_at, kcor)
                if FACTORED:
                    kc, ksc, kzr = _load_code_tile(krow, kmrow, blk, d, j_ok, kv_m, q_mma.dtype, KV_FORMAT, BITS,
                                                   bits_ptr, WORDS, HEAD_DIM, DIM_PAD, BLOCK_N, blk0, INTERPRETED,
                                                   META32, kvh, True, MIXED_SPAN, kspan, PLANES,
                                                   kmeta, kwords)  # fmt: skip
                    if PLANES:
                        s = tl.dot(q_planes[0], tl.trans(kc[0]), input_precision=DOT_PREC)
                        for pj in tl.static_range(1, PW):
                            s = tl.dot(q_planes[pj], tl.trans(kc[pj]), s, input_precision=DOT_PREC)
                    elif MIXED_SPAN:  # a dot per block, the scores side by side (the codes' layouts stay one block's)
                        s = cat_cols(tl.dot(q_mma, tl.trans(kc[0]), input_precision=DOT_PREC),
                                     tl.dot(q_mma, tl.trans(kc[1]), input_precision=DOT_PREC))  # fmt: skip
                    else:
                        s = tl.dot(q_mma, tl.trans(kc), input_precision=DOT_PREC)
                    if RAW_PLANES:  # (the key planes' 2^-24)
                        ksc = ksc * 16777216.0
                    s = s * (q_unf[:, None] * ksc[None, :])
                    s += q_sum[:, None] * kzr[None, :]
                    if SCORE_IO:  # the score biases (Oaken's key outliers, `oaken_split`), before the scale; keys
                        # past the sequence's end read what is there (in bounds: whole tiles), masked below
                        s += tl.load(k_res_ptr + (b * stride_rb + qh * stride_rr)[:, None] + j[None, :],
                                     mask=row_ok[:, None], other=0.0)  # fmt: skip
                    if OAKEN:  # outlier positions hold code 0: the dense part has zr there
                        if not OAKEN_AHEAD:  # each load where it is used (fewer registers)
                            kcor = oaken_key_corr(
                                oaken_key_first(k_res_ptr, blk, kvh, stride_rb, stride_rr,
                                                oaken_key_heads(k_res_ptr, blk, start, s_hi, kvh, stride_rb,
                                                                  stride_rr, bt_row, OAKEN_CAP, BLOCK_SIZE, BLOCK_N,
                                                                  OAKEN_NBT), KR, False),
                                qtr, CR, BLOCK_N, KR, False)  # fmt: skip
                            if SPREAD:
                                kadd = through_scratch(kp, c_at, k_at, kcor)
                        if SPREAD:
                            # to the tile's rows through the scratch (`kadd`, above): an in-register spread left the
                            # softmax in a second layout (its row reductions took ~250 more SASS a tile, sm_90). The
                            # reload enters as the accumulator of a dot of zeros (adds exactly 0): a dot fixes its
                            # layout, so the load's coalesced layout stops there; added to s directly, it was
                            # propagated through the softmax, which Triton then computed twice, once in each
                            # layout (m, p and l: a second exp2 of the tile, its row reductions and a conversion
                            # of s through shared memory; sm_90: 1354 -> 1317 SASS a tile at the fullest lists).
                            # Only on 64-token tiles: on 32-token tiles of 8 warps (blocks of 16, fp32 queries) the
                            # dot's layout made ptxas spill (sm_80 fp16: 128 registers, 16 B; sm_90 fp32: 56 B),
                            # where the plain add did not.
                            if BLOCK_N >= 64:
                                z16 = tl.zeros([BLOCK_M, 16], tl.float16)
                                s += tl.dot(z16, tl.zeros([16, BLOCK_N], tl.float16), kadd)
                            else:
                                s += kadd
                        else:
                            s += tl.trans(kcor)
                else:
                    k = _load_kv_tile(krow, k_scale_ptr, kmrow, blk, off, kvh, d, j_ok, kv_m,
                                      stride_mb, stride_ms, stride_mh, q_mma.dtype, KV_FORMAT, BITS,
                                      j, b, nq, k_res_ptr, stride_rb, stride_rr, stride_rh, True,
                                      blk0, start, d_ok, BLOCK_SIZE,
                                      KIVI_G, KIVI_GV, KIVI_R, bits_ptr, HEAD_DIM, WORDS, DIM_PAD,
                                      BLOCK_N, HW_FP8,
                                      not KIVI_SPLIT or phase == 1, INTERPRETED, META32, dq, KIVI_PAIRS,
                                      KIVI_KPLANES and KIVI_SPLIT and phase == 0)  # fmt: skip
                    if KIVI_KPLANES and KIVI_SPLIT and phase == 0:  # KIVI's code-only key tiles: code planes
                        s = tl.dot(q_planes[0], tl.trans(k[0]), input_precision=DOT_PREC)
                        for pj in tl.static_range(1, PW):
                            s = tl.dot(q_planes[pj], tl.trans(k[pj]), s, input_precision=DOT_PREC)
                    else:
                        s = tl.dot(q_mma, tl.trans(k), input_precision=DOT_PREC)
                    if F16_MMA:
                        s = s * q_unf[:, None]
                if HAS_SOFTCAP:
                    # c * tanh(x / c) through exp: tanh(y) = 1 - 2 / (exp(2y) + 1), exact at +-inf.
                    if PRESCALED:
                        y = s
                    else:
                        y = s * (sm_scale / softcap)
                    s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * _LOG2E
                elif not PRESCALED:
                    s = s * qk_scale
                if MASK_MODE == _TREE and phase == 1:  # the tree phase
                    in_tree = j >= prefix
                    tj = j - prefix
                    # Each row's 64 mask bits from this tile on, from two words (`tree_mask_words`): 1-D loads
                    # keep the tile in the dot's layout (a 2-D byte load put the softmax in a second one).
                    # (clamped: only a tile ending 64 or more keys before the tree, none of its bits read, goes below)
                    e = tl.maximum(tl.load(mask_off_ptr + b) + qi * q_len + (start - prefix) + TREE_PAD_BITS, 0)
                    w = (e >> 6).to(tl.int64)
                    sh = (e & 63).to(tl.uint64)
                    x0 = tl.load(mask_ptr + w, mask=row_ok, other=0).to(tl.uint64, bitcast=True)
                    x1 = tl.load(mask_ptr + w + 1, mask=row_ok, other=0).to(tl.uint64, bitcast=True)
                    win = (x0 >> sh) | ((x1 << 1) << (63 - sh))
                    c = tl.arange(0, BLOCK_N).to(tl.uint64)
                    vis = (~in_tree)[None, :] | (((win[:, None] >> c[None, :]) & 1) != 0)
                    kpos = tl.where(in_tree, tl.load(pos_ptr + q_start + tj, mask=in_tree & j_ok, other=0), j)
                elif MASK_MODE == _TREE:  # a prefix tile: every key visible
                    kpos = j
                    vis = (j < prefix)[None, :]
                else:
                    kpos = j
                    vis = kpos[None, :] <= qpos[:, None]
                vis = vis & j_ok[None, :] & row_ok[:, None]
                if HAS_WINDOW:
                    vis = vis & ((qpos[:, None] - kpos[None, :]) < window)
                if HAS_ALIBI:
                    s = s + slope[:, None] * (kpos[None, :] - qpos[:, None]).to(tl.float32)
                s = tl.where(vis, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                if LAZY:  # (a row's first visible score grows it from -inf: rescaled then)
                    if tl.max((m_new > m_i + _RESCALE_TAU).to(tl.int32), 0) > 0:
                        alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
                        l_i = l_i * alpha
                        grown = ()
                        for pj in tl.static_range(PW):
                            grown = grown + (acc_planes[pj] * alpha[:, None],)
                        acc_planes = grown
                        m_i = m_new
                    m_new = m_i
                    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
                    p = tl.exp2(s - m_safe[:, None])
                    l_i = l_i + tl.sum(p, 1)
                else:
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
                    alpha = tl.exp2(m_i - m_safe)
                    p = tl.exp2(s - m_safe[:, None])
                    l_i = l_i * alpha + tl.sum(p, 1)
                if SCORE_IO:  # p and its running max, per tile (`score_io`: p a token's heads side by side); whole
                    # tiles (p 0 past the sequence's end: a tile crosses no split's end but the last). Decode only.
                    at = b * stride_rb + qh * stride_rr
                    tl.store(v_res_ptr + (b * stride_rb + kvh * GROUP * stride_rr + hg)[:, None] + j[None, :] * GROUP,
                             p.to(v_res_ptr.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip
                    tl.store(scr_ptr + at // BLOCK_N + start // BLOCK_N, m_safe, mask=row_ok)
                if MIXED_SPAN:
                    vrow = v_ptr + blk0 * stride_vb + kvh * stride_vh + tl.arange(0, BLOCK_SIZE) * stride_vs
                    vspan = (v_ptr + blk1 * stride_vb + kvh * stride_vh + tl.arange(0, BLOCK_SIZE) * stride_vs, blk1,
                             start, s_hi, d_ok)  # fmt: skip
                else:
                    vrow = tile_rows(v_ptr, bt_row, start, s_hi, blk, off, kvh, stride_vb, stride_vs, stride_vh,
                                     BLOCK_N, BLOCK_SIZE, IS_DECODE)  # fmt: skip
                    vspan = None
                vmrow = tile_rows(v_scale_ptr, bt_row, start, s_hi, blk, off, kvh, stride_vmb, stride_vms,
                                  stride_vmh, BLOCK_N, BLOCK_SIZE, IS_DECODE)  # fmt: skip
                if FACTORED:
                    vc, vsc, vzr = _load_code_tile(vrow, vmrow, blk, d, j_ok, kv_m, q_mma.dtype, KV_FORMAT, BITS,
                                                   bits_ptr, WORDS, HEAD_DIM, DIM_PAD, BLOCK_N, blk0, INTERPRETED,
                                                   META32, kvh, False, MIXED_SPAN, vspan, PLANES,
                                                   vmeta, vwords)  # fmt: skip
                    if F16_MMA:
                        # p * sc in fp16 would lose small scales to underflow (V of magnitude 1e-5 gave 116 %
                        # error in fp16): the tile's scales are brought to [1, 2) by a power of two first.
                        v_f, v_unf = pow2_scale(tl.max(vsc, 0), 0)
                        ps = (p * (vsc * v_f)[None, :]).to(tl.float16)
                        if MIXED_PAIRS:  # (codes c / CODE_UNITS, `chunk_words_f16`)
                            v_unf = v_unf * _CODE_UNITS
                    else:
                        v_unf = 1.0
                        ps = p * vsc[None, :]
                    if PLANES:  # output = u_acc 2^(24 - b) planes + z_acc: (planes alpha u_acc / v_unf + pv) into
                        # each dot's C; the rank-1 part a row's sum apart (one scale for every plane's 2^(b - 24)).
                        # A tile of constant rows (every scale 0, p * sc = 0) keeps the units: pow2_scale(0) is 2^126,
                        # which overflowed the finished planes' accumulator (the raw planes' 2^-24 leaves room for it,
                        # but nothing is gained by moving the units there).
                        v_unf = tl.where(tl.max(vsc, 0) > 0.0, v_unf, u_acc)
                        f_acc = alpha * (u_acc / v_unf)
                        z_acc = z_acc * alpha + tl.sum(p * vzr[None, :], 1)
                        new_planes = ()
                        for pj in tl.static_range(PW):
                            c_in = acc_planes[pj] * f_acc[:, None]
                            new_planes = new_planes + (tl.dot(ps, vc[pj], c_in, input_precision=DOT_PREC),)
                        acc_planes = new_planes
                        u_acc = v_unf
                    elif MIXED_SPAN:  # each block's probabilities against its own tile
                        p0, p1 = split_cols(ps)
                        if F16_MMA:  # (the split's join would halve the dot's operand width, `opaque_f16`)
                            p0, p1 = opaque_f16(p0, INTERPRETED), opaque_f16(p1, INTERPRETED)
                        pv = tl.dot(p0.to(vc[0].dtype), vc[0], input_precision=DOT_PREC)
                        pv = tl.dot(p1.to(vc[1].dtype), vc[1], pv, input_precision=DOT_PREC) * v_unf
                    else:
                        pv = tl.dot(ps.to(vc.dtype), vc, input_precision=DOT_PREC) * v_unf
                    if not PLANES:
                        acc = acc * alpha[:, None] + pv + tl.sum(p * vzr[None, :], 1)[:, None]
                    if OAKEN:
                        tl.debug_barrier()  # every thread is done with the previous tile's p
                        tl.store(pp + p_at, p, mask=(hg < OAKEN_GP)[:, None])
                        tl.debug_barrier()
                        if not OAKEN_AHEAD:
                            vfirst = oaken_value_first(oaken_value_heads(v_res_ptr, bt_row, start, s_hi, kvh, dq,
                                                                           d_ok, stride_rb, stride_rr, OAKEN_CAP,
                                                                           HEAD_DIM, BLOCK_SIZE, OAKEN_NBT),
                                                        OAKEN_NBT, VR, False)  # fmt: skip
                        vcor = oaken_value_corr(vfirst, pp, start, c_ok, CR, BLOCK_N, DIM_PAD, BLOCK_SIZE,
                                                OAKEN_NBT, VR, OAKEN_AHEAD)  # fmt: skip
                        if SPREAD:
                            acc_o = acc_o * rows_max(alpha, BLOCK_Q, OAKEN_GP, GROUP_PAD)[:, None] + vcor
                        else:  # the tile's rows: straight into the (already rescaled) accumulator
                            acc += vcor
                elif KIVI_VPLANES:  # KIVI's value tiles as code planes, into the plane accumulators (units 1)
                    rrow = (v_res_ptr + b * stride_rb + kvh * stride_rh
                            + ((j % (KIVI_G + KIVI_R)) * stride_rr).to(tl.int64))  # fmt: skip
                    vpl = kivi_value_planes(vrow[:, None], vmrow, j_ok, j, nq, rrow, BITS, HEAD_DIM, DIM_PAD, KIVI_GV,
                                            META32, not KIVI_SPLIT or phase == 1, INTERPRETED)  # fmt: skip
                    pf = p.to(tl.float16)
                    new_planes = ()
                    for pj in tl.static_range(PW):
                        c_in = acc_planes[pj] if LAZY else acc_planes[pj] * alpha[:, None]
                        new_planes = new_planes + (tl.dot(pf, vpl[pj], c_in, input_precision=DOT_PREC),)
                    acc_planes = new_planes
                else:
                    v = _load_kv_tile(vrow, v_scale_ptr, vmrow, blk, off, kvh, d, j_ok, kv_m,
                                      stride_vmb, stride_vms, stride_vmh, q_mma.dtype, KV_FORMAT, BITS,
                                      j, b, nq, v_res_ptr, stride_rb, stride_rr, stride_rh, False,
                                      blk0, start, d_ok, BLOCK_SIZE,
                                      KIVI_G, KIVI_GV, KIVI_R, bits_ptr, HEAD_DIM, WORDS, DIM_PAD,
                                      BLOCK_N, HW_FP8,
                                      not KIVI_SPLIT or phase == 1, INTERPRETED, META32, dq, KIVI_PAIRS)  # fmt: skip
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
                m_i = m_new

        if OAKEN and SPREAD:
            acc += spread_rows(acc_o, BLOCK_Q, OAKEN_GP, GROUP_PAD, DIM_PAD)
        has = l_i > 0.0
        lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        base = qt * stride_pt + qh * stride_ph + split * stride_ps  # (the split's partial output, NUM_SPLITS > 1)
        if PLANES and (FACTORED or KIVI_VPLANES):  # plane pj holds channels pj, pj + PW, ..
            for pj in tl.static_range(PW):
                o = acc_planes[pj]
                if RAW_PLANES:  # 2^(24 - b), apart from u_acc (their product can pass fp32's range)
                    o = o * ((1 << (24 - BITS * (pj % (8 // BITS)))) * 1.0) * u_acc + z_acc[:, None]
                else:
                    o = o * u_acc
                o = o / tl.where(has, l_i, 1.0)[:, None]
                _write_out(o, PW * wq + pj, row_ok[:, None], o_ptr, op_ptr, qt, qh, base, stride_ot, stride_oh,
                           DIM_PAD, NUM_SPLITS)  # fmt: skip
        else:
            o = acc / tl.where(has, l_i, 1.0)[:, None]
            if F16_MMA and KV_FORMAT == _FP8:  # the value head scale, left out of the tiles (splits: each part alike)
                o = o * tl.load(v_scale_ptr + kvh)
            _write_out(o, dq, row_ok[:, None] & d_ok[None, :], o_ptr, op_ptr, qt, qh, base, stride_ot, stride_oh,
                       DIM_PAD, NUM_SPLITS)  # fmt: skip
        if NUM_SPLITS == 1:
            if WRITE_LSE:
                tl.store(lse_ptr + qt * stride_lt + qh * stride_lh, lse2 * _LN2, mask=row_ok)
        else:
            tl.store(lsep_ptr + base, lse2, mask=row_ok)


@triton.jit
def _write_out(o, cols, ok, o_ptr, op_ptr, qt, qh, base, stride_ot, stride_oh, DIM_PAD: tl.constexpr,
               NUM_SPLITS: tl.constexpr):  # fmt: skip
    """Store an output tile o [BLOCK_M, C] (fp32, normalized) at channels `cols` [C]: into the output, or with
    splits into this split's fp32 partial rows (`base`); ok: a mask broadcastable to o."""
    if NUM_SPLITS == 1:
        tl.store(o_ptr + qt[:, None] * stride_ot + qh[:, None] * stride_oh + cols[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=ok)  # fmt: skip
    else:
        tl.store(op_ptr + base[:, None] * DIM_PAD + cols[None, :], o, mask=ok)


@triton.jit
def _reduce_splits_kernel(
    op_ptr, lsep_ptr, o_ptr, lse_ptr, c_ptr,
    stride_pt, stride_ph, stride_ot, stride_oh, stride_lt, stride_lh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    WRITE_LSE: tl.constexpr, WALKS: tl.constexpr = 0,
):  # fmt: skip
    """o = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse2_s - max lse2); lse = log(sum_s 2^lse2_s). WALKS > 0: each
    split's WALKS corrections c [T, Hq, S, WALKS, DIM_PAD] added to its partial first (`oaken_split`)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    base = t * stride_pt + h * stride_ph + s
    lse2 = tl.load(lsep_ptr + base, mask=s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse2, 0)
    w = tl.exp2(lse2 - m)
    w = tl.where(lse2 == float("-inf"), 0.0, w)
    o_m = (w > 0.0)[:, None] & (d < HEAD_DIM)[None, :]
    o_s = tl.load(op_ptr + base[:, None] * DIM_PAD + d[None, :], mask=o_m, other=0.0)
    for k in tl.static_range(WALKS):
        o_s += tl.load(c_ptr + (base[:, None] * WALKS + k) * DIM_PAD + d[None, :], mask=o_m, other=0.0)
    tot = tl.sum(w, 0)
    o = tl.sum(o_s * w[:, None], 0) / tot
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, o.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    if WRITE_LSE:
        tl.store(lse_ptr + t * stride_lt + h * stride_lh, (m + tl.log2(tot)) * _LN2)


def tree_mask_words(mask: torch.Tensor) -> torch.Tensor:
    """The flat uint8 tree mask as int64 words of 64 bits (bit k of word w: element 64 w + k - TREE_PAD_BITS),
    TREE_PAD_BITS zero bits first and a zero word last, so every 64-bit window the kernel reads lies inside."""
    n, pad = mask.numel(), TREE_PAD_BITS.value
    words = (pad + n + 63) // 64 + 1
    bits = torch.zeros(words * 64, dtype=torch.int64, device=mask.device)
    bits[pad : pad + n] = mask.reshape(-1) != 0
    return (bits.view(words, 64) << torch.arange(64, device=mask.device)).sum(1)


@dataclass(frozen=True, eq=False)
class KernelKV:
    """The K/V operands of one launch as the kernel reads them (layouts in the module docstring).

    k, v: a plain cache's values, or a quantized cache's codes; k_meta, v_meta: its metadata (per-token or
    per-group (scale, zero), FP8's head scales); k_side, v_side: KIVI's residual rings or Oaken's outlier
    index (`oaken.outlier_index`, the cache's); block_bits: mixed precision's per-block widths, or Oaken
    offline's grids; kivi: KIVI's (G, GV, R).
    """

    k: torch.Tensor
    v: torch.Tensor
    kv_format: int = KV_FORMAT_PLAIN
    bits: int = PLAIN_BITS
    k_meta: torch.Tensor | None = None
    v_meta: torch.Tensor | None = None
    k_side: torch.Tensor | None = None
    v_side: torch.Tensor | None = None
    block_bits: torch.Tensor | None = None
    kivi: tuple[int, int, int] = (1, 1, 0)


@dataclass(frozen=True, eq=False)
class LaunchPlan:
    """Every launch choice of one attention launch, made before it (`plan_launch`): the tile config (tuned
    table or defaults, tree-adjusted), the rows layout, the split-KV count, whether codes are read as words,
    hardware fp8, the split workspace (partial outputs fp32 [T, Hq, S, DIM_PAD], partial lse [T, Hq, S]) and, for
    a tree launch, its mask packed in words (`tree_mask_words`); for an Oaken cache, the per-program scratch of
    probabilities (fp32 [programs, CR x BLOCK_N]) the value corrections gather from (the outlier index is the
    cache's: `OakenPagedKV.k_index`)."""

    config: dict
    group_pad: int
    block_q: int
    num_splits: int
    words: bool
    hw_fp8: bool
    workspace: tuple[torch.Tensor, torch.Tensor] | None
    tree_words: torch.Tensor | None = None
    oaken_scratch: torch.Tensor | None = None
    planes: bool = False
    vplanes: bool = False


def oaken_scratch_size(rows: int, block_n: int, head_dim: int) -> int:
    """fp32 words of one program's Oaken scratch (rows: the CR real query rows): p ([BLOCK_N, CR]), the key
    corrections ([CR, BLOCK_N]), q channel-major ([HEAD_DIM, CR])."""
    return 2 * rows * block_n + head_dim * rows


def plan_launch(
    q: torch.Tensor,
    kv_shape: tuple[int, ...],
    kv_format: int,
    bits: int,
    batch: AttentionBatch,
    num_splits: int | None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    oaken_cap: int = 0,
    allocate: bool = True,
) -> LaunchPlan:
    """The one place a launch is planned: config (`launch_config`, one table lookup), rows layout, split count
    (`choose_num_splits` over this launch's programs when `num_splits` is None) and workspace (`workspace`
    reused when its shape fits). q: the queries (or a tensor of their shape, dtype and device); kv_shape: the
    cache's (num_blocks, block_size, kv_heads, ...); oaken_cap: an Oaken cache's slots per (block, kv head)
    (its launch needs a probability scratch); allocate False: no workspace (a caller that lays out its own, as
    `mixed_by_width` does for its launches' shared one).
    Host-only: no sync."""
    t, hq, dim = q.shape
    bs, hkv, b = kv_shape[1], kv_shape[2], batch.block_tables.shape[0]
    view = device_view(q.device)
    cfg = launch_config(hq, hkv, dim, bs, batch.block_tables.shape[0], q.device, q.element_size(), kv_format, bits)
    if not batch.is_decode:
        cfg = rows_config(cfg, kv_format, batch.is_tree, view.capability)
    gpad, bq = rows_layout(hq // hkv, cfg["BLOCK_M"], batch.is_decode, view.min_dot_rows)
    programs = (b if batch.is_decode else -(-t // bq) + b) * hkv
    ctx = batch.block_tables.shape[1] * bs
    cfg = decode_occupancy(cfg, programs, ctx, view.sms, num_splits, view.capability)  # (a default's cap if it pays)
    if num_splits is None:
        per_sm = cfg.get("PROGRAMS_PER_SM")  # (decode only: `rows_config` drops it)
        num_splits = choose_num_splits(programs, ctx, view.sms, cfg["num_warps"], per_sm)
    words = (
        reads_words(kv_format, bits, dim)
        or mixed_reads_words(kv_format, dim, bs, cfg["BLOCK_N"])
        or (kv_format == KV_FORMAT_INT and bits == 8 and dim % 4 == 0 and bool(cfg.get("WORDS8", WORDS8_DEFAULT)))
    )
    ws = split_workspace(t, hq, num_splits, dim, q.device, workspace) if num_splits > 1 and allocate else None
    tw = tree_mask_words(batch.tree_mask) if batch.is_tree else None
    oak = None
    if kv_format in (KV_FORMAT_OAKEN, KV_FORMAT_OAKEN_OFFLINE) and oaken_cap > 0:
        programs = (b if batch.is_decode else t // bq + b) * hkv * num_splits
        oak = torch.empty(programs * oaken_scratch_size(bq * next_pow2(hq // hkv), cfg["BLOCK_N"], dim),
                          dtype=torch.float32, device=q.device)  # fmt: skip
    planes = words and batch.is_decode and q.dtype != torch.float32 and reads_planes(kv_format, bits, dim, cfg)
    vplanes = planes and reads_value_planes(kv_format, bits, dim, cfg)
    return LaunchPlan(cfg, gpad, bq, num_splits, words, kv_format == KV_FORMAT_FP8 and view.hw_fp8, ws, tw, oak, planes,
                      vplanes)  # fmt: skip


def split_workspace(
    t: int, hq: int, splits: int, dim: int, device, workspace: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split partials' workspace (fp32 o [T, Hq, S, DIM_PAD], lse [T, Hq, S]): `workspace` when its shape fits,
    else a new one."""
    if workspace is not None and workspace[1].shape == (t, hq, splits) and workspace[0].shape[-1] == dim_pad(dim):
        return workspace
    return (torch.empty(t, hq, splits, dim_pad(dim), dtype=torch.float32, device=device),
            torch.empty(t, hq, splits, dtype=torch.float32, device=device))  # fmt: skip


def pairs_are_words(meta: torch.Tensor | None) -> bool:
    """True when `meta` holds fp16 (scale, zero) pairs [.., 2] that are aligned int32 words (the kernel's META32:
    one 4-byte load a pair, not two 2-byte ones): last dimension contiguous, every other stride and the offset
    even (torch allocations are at least 4-byte aligned)."""
    if meta is None or meta.dtype != torch.float16 or meta.shape[-1] != 2 or meta.stride(-1) != 1:
        return False
    return meta.storage_offset() % 2 == 0 and all(st % 2 == 0 for st in meta.stride()[:-1])


def _side_args(kv: KernelKV, context_lens: torch.Tensor, head_dim: int) -> tuple[tuple, tuple, int, bool]:
    """The kernel's metadata strides, side-tensor arguments (KIVI's rings, Oaken's outlier index; stand-ins
    otherwise), Oaken's slot capacity and META32 (per-token INT / mixed and KIVI pairs read as int32 words)."""
    meta32 = kv.kv_format in (KV_FORMAT_INT, KV_FORMAT_MIXED, KV_FORMAT_KIVI, KV_FORMAT_OAKEN) and (
        pairs_are_words(kv.k_meta) and pairs_are_words(kv.v_meta)
    )
    if kv.kv_format not in (KV_FORMAT_PLAIN, KV_FORMAT_FP8):  # per-token / per-group metadata tensors
        ks, vs = kv.k_meta, kv.v_meta
        mstrides = (ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1), vs.stride(2))
    else:
        mstrides = (0, 0, 0) * 2
    if kv.kv_format == KV_FORMAT_KIVI:
        k_res = kv.k_side
        res = (k_res, kv.v_side, k_res.stride(0), k_res.stride(1), k_res.stride(2))
    elif kv.kv_format in (KV_FORMAT_OAKEN, KV_FORMAT_OAKEN_OFFLINE):
        kix = kv.k_side  # the cache's outlier index (`oaken.outlier_index`, kept by its writers)
        res = (kix, kv.v_side, kix.stride(0), kix.stride(1), 0)
    elif kv.k_side is not None:  # per-token INT with score biases in and probabilities out (`score_io`)
        res = (kv.k_side, kv.v_side, kv.k_side.stride(0), kv.k_side.stride(1), 0)
    else:
        res = (context_lens, context_lens, 0, 0, 0)
    return mstrides, res, _oaken_capacity(kv, head_dim), meta32


def score_io(kv: KernelKV) -> bool:
    """Whether a launch adds score biases and keeps its probabilities (SCORE_IO): a per-token INT launch given side
    tensors, Oaken's dense part (`oaken_split`): k_side the biases fp32 [B, Hq, T] (T a multiple of BLOCK_N, whole
    tiles; offsets in int32), v_side the probabilities [B, kv heads, T, group] (a token's query heads side by side,
    one load for the value walk; fp16, fp32 for fp32 queries), the plan's `oaken_scratch` the running maxima fp32
    [B, Hq, T / BLOCK_N]."""
    return kv.kv_format == KV_FORMAT_INT and kv.k_side is not None


def _oaken_capacity(kv: KernelKV, head_dim: int) -> int:
    """An Oaken cache's slots per (block, kv head), from its index's width; 0 for other formats."""
    if kv.kv_format not in (KV_FORMAT_OAKEN, KV_FORMAT_OAKEN_OFFLINE):
        return 0
    cap = index_capacity(kv.k_side.shape[2], kv.k.shape[1], head_dim)
    if cap < 0:  # slots passed where the index belongs would otherwise read as no outliers at all
        raise ValueError(f"k_side must be an Oaken outlier index (`oaken.outlier_index`), {kv.k_side.shape[2]} wide")
    return cap


def kv_align(*caches: torch.Tensor) -> int:
    """The largest power of two up to 4 elements (16 bytes of words) dividing every block, token and head stride and
    offset of `caches`, or 1 where all of them divide by 16 (Triton specializes those itself) or by no power of two.
    A 2-bit row at head_dim 128 is 8 words: heads 8 words apart, which Triton cannot tell from 3, so it copied the rows
    4 bytes at a time (`LDGSTS.E`) where 16 (`.128`) fit."""
    vals = [v for c in caches for v in (*c.stride()[:3], c.storage_offset())]
    if all(v % 16 == 0 for v in vals):
        return 1
    align = 4
    while align > 1 and any(v % align for v in vals):
        align //= 2
    return align


def _bt_ahead(device) -> bool:
    """Whether the kernel loads block ids a tile ahead (`BT_AHEAD`): on sm_90 and up, and in the interpreter (so CPU
    tests run that path); not on mma.sync GPUs, where the FP8 tree tile spilled with it."""
    cap = device_view(device).capability
    return cap is None or cap >= (9, 0)


def paged_attention_triton(
    q: torch.Tensor,
    kv: KernelKV,
    batch: AttentionBatch,
    opts: AttentionOptions,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    plan: LaunchPlan | None = None,
    reduce: bool = True,
) -> None:
    """Launch the attention (and, with more than one split, the reduction) kernels into `out` / `lse`
    (lse None: not written). `opts`: resolved (`attention.options.prepare`); `plan`: `plan_launch`'s, made
    here when not given (a plan()/run() wrapper gives its own: no table lookup, no allocation here). With splits
    the partials go to the plan's workspace at its strides (a view into a larger one is fine) and `reduce` False
    leaves them there (`reduce_splits` later merges several launches' partials at once).

    Inputs are validated by the entry points (`attention.paged.attend`, the cache types of `kvcache`);
    nothing here syncs with the host, so the launch can be captured in a CUDA graph.
    """
    t, hq, dim = q.shape
    if t == 0:
        return
    cap = _oaken_capacity(kv, dim)
    p = plan or plan_launch(q, kv.k.shape, kv.kv_format, kv.bits, batch, opts.num_splits, oaken_cap=cap)
    cfg, s, dpad, nseq = p.config, p.num_splits, dim_pad(dim), batch.block_tables.shape[0]
    hkv, bs = kv.k.shape[2], kv.k.shape[1]
    if cap > 0 and p.oaken_scratch is None:
        raise ValueError("an Oaken launch needs a plan made with oaken_cap (its probability scratch)")
    if score_io(kv) and (p.oaken_scratch is None or s < 2):
        raise ValueError("a launch with score biases needs split partials and a plan's scratch for its maxima")
    mstrides, res, cap, meta32 = _side_args(kv, batch.context_lens, dim)
    o_part, l_part = p.workspace if s > 1 else (out, out)  # unused with one split
    dummy = batch.context_lens
    lse_t = lse if lse is not None else out
    k_cache, v_cache = (kv.k.view(torch.int32), kv.v.view(torch.int32)) if p.words else (kv.k, kv.v)
    kg, kgv, kr = kv.kivi
    _paged_attn_kernel[(nseq if batch.is_decode else t // p.block_q + nseq, hkv, s)](
        q, k_cache, v_cache, out, lse_t, o_part, l_part,
        batch.block_tables, batch.context_lens, batch.cu_seqlens_q,
        batch.positions if batch.positions is not None else dummy,
        p.tree_words if p.tree_words is not None else dummy,
        batch.mask_indptr if batch.mask_indptr is not None else dummy,
        opts.alibi_slopes if opts.alibi_slopes is not None else dummy,
        kv.k_meta if kv.k_meta is not None else dummy, kv.v_meta if kv.v_meta is not None else dummy,
        *mstrides, *res,
        kv.block_bits if kv.block_bits is not None else dummy,
        p.oaken_scratch if p.oaken_scratch is not None else dummy,
        float(opts.sm_scale), float(opts.softcap) if opts.softcap else 1.0, int(opts.window or 0), nseq,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        batch.block_tables.stride(0),
        out.stride(0), out.stride(1),
        lse_t.stride(0), lse_t.stride(1),
        *l_part.stride(),
        GROUP=hq // hkv, GROUP_PAD=p.group_pad, BLOCK_Q=p.block_q, BLOCK_N=cfg["BLOCK_N"],
        HEAD_DIM=dim, DIM_PAD=dpad, BLOCK_SIZE=bs, NUM_SPLITS=s,
        IS_DECODE=batch.is_decode, MASK_MODE=MASK_TREE if batch.is_tree else MASK_CAUSAL,
        HAS_ALIBI=opts.alibi_slopes is not None, HAS_SOFTCAP=bool(opts.softcap), HAS_WINDOW=bool(opts.window),
        WRITE_LSE=lse is not None and s == 1, KV_FORMAT=kv.kv_format, BITS=kv.bits,
        KIVI_G=kg, KIVI_GV=kgv, KIVI_R=kr, OAKEN_CAP=cap, OAKEN_NBT=tile_blocks(cfg["BLOCK_N"], bs), WORDS=p.words,
        HW_FP8=p.hw_fp8, OAKEN_GP=next_pow2(hq // hkv),
        F16_MMA=kv.kv_format in F16_MMA_FORMATS and q.dtype != torch.float32,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", INTERPRETED=device_view(q.device).interpreted,
        META32=meta32, BT_AHEAD=_bt_ahead(q.device), PLANES=p.planes, KV_ALIGN=kv_align(k_cache, v_cache),
        VPLANES=p.vplanes, SCORE_IO=score_io(kv),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg.get("MAXNREG") or None,
    )  # fmt: skip
    if s > 1 and reduce:
        reduce_splits(o_part, l_part, out, lse)


def reduce_splits(
    o_part: torch.Tensor, l_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
    corr: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Merge split partials (fp32 o_part [T, Hq, S, DIM_PAD], l_part [T, Hq, S] in log2, contiguous) into `out`
    [T, Hq, D] and, when given, `lse` (natural log); a split of no keys holds -inf and weighs nothing. `corr`:
    each split's corrections (fp32 [T, Hq, S, W, DIM_PAD], contiguous), added to its partial first."""
    t, hq, s = l_part.shape
    dim = out.shape[2]
    lse_t = lse if lse is not None else out
    _reduce_splits_kernel[(t, hq)](
        o_part, l_part, out, lse_t, corr if corr is not None else o_part,
        hq * s, s, out.stride(0), out.stride(1), lse_t.stride(0), lse_t.stride(1),
        NUM_SPLITS=s, SPLITS_PAD=next_pow2(s), HEAD_DIM=dim, DIM_PAD=dim_pad(dim),
        WRITE_LSE=lse is not None, WALKS=0 if corr is None else corr.shape[3], num_warps=4 if dim >= 128 else 2,
    )  # fmt: skip
