"""Oaken's outliers in the paged attention kernel (`triton_attention`, KV_FORMAT_OAKEN / _OAKEN_OFFLINE): the offline
variant's metadata grid, and each outlier's difference from the dense value added to the scores (keys, by token)
and to the output (values, by channel) through the index the cache keeps (`kvcache.oaken.outlier_index`), with the
program's scratch for the layouts the corrections change."""

from __future__ import annotations

import triton
import triton.language as tl

from codesign.kernels.kvcache.oaken import INDEX_COORD_BITS

_COORD = tl.constexpr((1 << INDEX_COORD_BITS) - 1)  # a slot word's coordinate bits (`oaken.outlier_index`)


@triton.jit
def oaken_offline_meta(mrow, j_ok, bits_ptr, kvh, IS_KEY: tl.constexpr, BITS: tl.constexpr):
    """Oaken offline: the rows' fp32 (scale, zero) from their uint8 (z, r) on the kv head's grid (bits_ptr: the
    grids [2 (K, V), kv_heads, 2 (base, step)]), O(BLOCK_N): zero = base + z step, scale = r step / (2^BITS - 1)
    (`kvcache.quantizers.offline_meta`)."""
    gp = bits_ptr + (kvh if IS_KEY else tl.num_programs(1) + kvh) * 2
    g_base = tl.load(gp)
    g_step = tl.load(gp + 1)
    zc = tl.load(mrow, mask=j_ok, other=0).to(tl.float32)
    rc = tl.load(mrow + 1, mask=j_ok, other=0).to(tl.float32)
    return tl.math.div_rn(rc * g_step, (2**BITS - 1) * 1.0), g_base + zc * g_step


@triton.jit
def oaken_slot(x):
    """An index slot word (`oaken.outlier_index`) as (its other coordinate, its delta in fp32): the low
    INDEX_COORD_BITS, and the word with them cleared (an fp32 whose last mantissa bits are 0), one AND each."""
    return x & _COORD, (x & ~_COORD).to(tl.float32, bitcast=True)


@triton.jit
def oaken_key_heads(ix_ptr, blk, start, s_hi, kvh, stride_ib, stride_ih, bt_row, OAKEN_CAP: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, OAKEN_NBT: tl.constexpr):  # fmt: skip
    """The heads of a tile's key-outlier lists (`oaken_key_corr`), loaded a tile ahead of their use (they address
    the slot words, which address the gathers): each token's list (start, end) in the token-sorted index
    (`oaken.outlier_index`) and the ranks of the tile's fullest list (the loop bound for the ranks past the first)."""
    j = start + tl.arange(0, BLOCK_N)
    j_ok = j < s_hi
    lists = ix_ptr + blk * stride_ib + kvh * stride_ih + OAKEN_CAP  # the list starts, after the CAP slot words
    st = tl.load(lists + j % BLOCK_SIZE, mask=j_ok, other=0)
    en = tl.load(lists + j % BLOCK_SIZE + 1, mask=j_ok, other=0)
    if BLOCK_N % BLOCK_SIZE == 0:
        # tiles of whole blocks: the fullest of its blocks' fullest tokens, read from each block's index row
        # (OAKEN_NBT words, a power of two here), not a max over the tile's tokens (a reduction across the warps: a
        # shared-memory round trip and 2 barriers a tile, sm_90)
        bi = start // BLOCK_SIZE + tl.arange(0, OAKEN_NBT)
        live = bi * BLOCK_SIZE < s_hi  # blocks of this split's keys (not past its end)
        blk_t = tl.load(bt_row + bi, mask=live, other=0).to(tl.int64)
        nr = tl.max(tl.load(ix_ptr + blk_t * stride_ib + kvh * stride_ih + OAKEN_CAP + BLOCK_SIZE + 1,
                            mask=live, other=0), 0)  # fmt: skip
    else:
        nr = tl.max(tl.load(lists + BLOCK_SIZE + 1, mask=j_ok, other=0), 0)  # the tile's fullest token
    return st, en, nr


@triton.jit
def oaken_key_first(ix_ptr, blk, kvh, stride_ib, stride_ih, heads, R: tl.constexpr, AHEAD: tl.constexpr = True):
    """The first R (channel, delta) slot words of each token's list (`oaken_key_heads`), loaded at the
    top of the tile so that their latency hides behind the key dot; with the list heads and the index (not AHEAD:
    no words, the loop of `oaken_key_corr` takes every rank)."""
    st, en, nr = heads
    ib = ix_ptr + blk * stride_ib + kvh * stride_ih  # each token's block's index
    words = ()
    if AHEAD:  # (none past the list's end: word 0, channel 0 and delta 0)
        for u in tl.static_range(R):
            words = words + (tl.load(ib + st + u, mask=u < en - st, other=0),)
    return ib, st, en, nr, words


@triton.jit
def oaken_key_corr(first, qtr, CR: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr, AHEAD: tl.constexpr = True):
    """[BLOCK_N, CR] key-outlier corrections of the scores (token-major): q[row, d] * delta summed over each
    token's slots (the delta the value minus the token's dense value at code 0, which is what the factored dense
    part has there): the first ranks from the words `oaken_key_first` loaded, the rest rank by rank through the
    index. qtr: the program's q, fp32 channel-major ([HEAD_DIM, CR] in the scratch), so a slot's CR rows are one
    contiguous load."""
    ib, st, en, nr, words = first
    corr = tl.zeros([BLOCK_N, CR], tl.float32)
    LO: tl.constexpr = R if AHEAD else 0
    if AHEAD:
        for u in tl.static_range(R):
            corr += _oaken_key_rank(words[u], qtr, CR)
    for r in range(LO, nr, R):  # lists longer than the first ranks (unrolled here:
        # ptxas's own unrolling left long remainder code); one address a token a trip, its ranks' words at constant
        # offsets from it (folded into the loads: no 64-bit address a rank), each kept while before the list's end
        wp = ib + (st + r)
        left = en - (st + r)
        for u in tl.static_range(R):
            corr += _oaken_key_rank(tl.load(wp + u, mask=u < left, other=0), qtr, CR)
    return corr


@triton.jit
def _oaken_key_rank(x, qtr, CR: tl.constexpr):
    """One rank of `oaken_key_corr`: each token's slot word `x` (0 past its list's end)."""
    ch, delta = oaken_slot(x)
    # unmasked: a token with no slot here reads channel 0's q (in bounds, times a zero delta)
    qg = tl.load(qtr + (ch * CR)[:, None] + tl.arange(0, CR)[None, :])
    return qg * delta[:, None]


@triton.jit
def oaken_value_heads(ix_ptr, bt_row, start, s_hi, kvh, dq, d_ok, stride_ib, stride_ih,
                      OAKEN_CAP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      OAKEN_NBT: tl.constexpr):  # fmt: skip
    """The heads of a tile's value-outlier lists (`oaken_value_corr`), loaded a tile ahead of their use: for each
    block the tile's tokens lie in, its index, each channel's list (start, end) in the channel-sorted index and
    the ranks of its fullest channel."""
    heads = ()
    for t in tl.static_range(OAKEN_NBT):
        bi = start // BLOCK_SIZE + t
        live = bi * BLOCK_SIZE < s_hi  # a block of this split's keys (not past its end)
        blk_t = tl.load(bt_row + bi, mask=live, other=0).to(tl.int64)
        ib = ix_ptr + blk_t * stride_ib + kvh * stride_ih
        lm = d_ok & (dq * 0 + bi * BLOCK_SIZE < s_hi)  # (vector compare: the interpreter widens a scalar int1)
        lists = ib + OAKEN_CAP  # the list starts, after the CAP slot words
        st = tl.load(lists + dq, mask=lm, other=0)
        en = tl.load(lists + dq + 1, mask=lm, other=0)
        nr = tl.where(live, tl.load(lists + HEAD_DIM + 1), 0)  # (blk_t 0 when not live: in bounds)
        heads = heads + ((ib, st, en, nr),)
    return heads


@triton.jit
def oaken_value_first(heads, OAKEN_NBT: tl.constexpr, R: tl.constexpr, AHEAD: tl.constexpr = True):
    """The first R (token, delta) slot words of each channel's list in each block of the tile
    (`oaken_value_heads`), loaded at the top of the tile (their latency behind the key side's work, where after
    p they were a chain of four loads a block); with the heads."""
    blocks = ()
    for t in tl.static_range(OAKEN_NBT):
        ib, st, en, nr = heads[t]
        words = ()
        if AHEAD:  # (else none: the loop of `oaken_value_corr` takes every rank)
            for u in tl.static_range(R):  # (token, delta) slot words, as the key side's
                words = words + (tl.load(ib + st + u, mask=u < en - st, other=0),)
        blocks = blocks + ((ib, st, en, nr, words),)
    return blocks


@triton.jit
def oaken_value_corr(first, pp, start, c_ok, CR: tl.constexpr, BLOCK_N: tl.constexpr, DIM_PAD: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, OAKEN_NBT: tl.constexpr, R: tl.constexpr,
                     AHEAD: tl.constexpr = True):  # fmt: skip
    """[CR, DIM_PAD] value-outlier corrections of this tile's output (column i: channel dq[i], the dot's column
    order): p[row, token] * delta summed over each channel's slots, the first ranks from the words
    `oaken_value_first` loaded, the rest rank by rank through the index (deltas as the key side's), p gathered
    from the program's scratch `pp` ([BLOCK_N, CR], token-major)."""
    corr = tl.zeros([CR, DIM_PAD], tl.float32)
    LO: tl.constexpr = R if AHEAD else 0
    if AHEAD:
        terms = ()
        for t in tl.static_range(OAKEN_NBT):  # the blocks this tile's tokens lie in
            ib, st, en, nr, words = first[t]
            fc = (start // BLOCK_SIZE + t) * BLOCK_SIZE - start  # the block's first token's tile column (< 0: before)
            for u in tl.static_range(R):  # every block's gathers in flight at once, then their sum
                terms = terms + (_oaken_value_rank(words[u], en - st > u, fc, pp, c_ok, CR, BLOCK_N, BLOCK_SIZE),)
        for i in tl.static_range(OAKEN_NBT * R):
            corr += terms[i]
    for t in tl.static_range(OAKEN_NBT):
        ib, st, en, nr, words = first[t]
        fc = (start // BLOCK_SIZE + t) * BLOCK_SIZE - start
        for r in range(LO, nr, R):  # channels with longer lists, as the key loop
            wp = ib + (st + r)
            left = en - (st + r)
            for u in tl.static_range(R):
                corr += _oaken_value_rank(tl.load(wp + u, mask=u < left, other=0), u < left, fc, pp, c_ok, CR,
                                          BLOCK_N, BLOCK_SIZE)  # fmt: skip
    return corr


@triton.jit
def _oaken_value_rank(x, live, first, pp, c_ok, CR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One rank of `oaken_value_corr`: each channel's slot word `x` (0 where not `live`: past its list's end)."""
    cr = tl.arange(0, CR)
    tok, delta = oaken_slot(x)
    col = first + tok  # the slot's token's tile column
    if BLOCK_N % BLOCK_SIZE == 0:  # tiles start at multiples of BLOCK_N: whole blocks, every token inside
        # unmasked: every row's p is in the scratch each tile (0 for rows of no query), a column in the tile
        # (the column scaled in 64 bits: one shift and a 64-bit add a rank, not a shift, a multiply and a sign
        # extension)
        pg = tl.load(pp + cr[:, None] + (col.to(tl.int64) * CR)[None, :])
    else:
        ok = live & (col >= 0) & (col < BLOCK_N)  # slots of tokens outside the tile: not here
        delta = tl.where(ok, delta, 0.0)
        pg = tl.load(pp + cr[:, None] + col[None, :] * CR, mask=c_ok[:, None] & ok[None, :], other=0.0)
    return pg * delta[None, :]


@triton.jit
def through_scratch(scr, store_at, load_at, x):
    """`x` stored to the program's scratch at `store_at` and read back at `load_at` (another layout: the key
    corrections' real rows to the tile's padded rows), every thread's stores visible first."""
    tl.store(scr + store_at, x)
    tl.debug_barrier()
    return tl.load(scr + load_at)


@triton.jit
def spread_rows(x, BLOCK_Q: tl.constexpr, GP: tl.constexpr, GROUP_PAD: tl.constexpr, W: tl.constexpr):
    """[BLOCK_Q x GP, W] rows of real heads spread to the [BLOCK_Q x GROUP_PAD, W] tile's rows (head h of query i
    at row i GROUP_PAD + h); the padding rows get copies, which the kernel masks or never stores."""
    if GP == GROUP_PAD:
        y = x
    else:
        y = tl.reshape(tl.broadcast_to(tl.reshape(x, (BLOCK_Q, 1, GP, W)), (BLOCK_Q, GROUP_PAD // GP, GP, W)),
                       (BLOCK_Q * GROUP_PAD, W))  # fmt: skip
    return y


@triton.jit
def rows_max(x, BLOCK_Q: tl.constexpr, GP: tl.constexpr, GROUP_PAD: tl.constexpr):
    """The [BLOCK_Q x GP] real heads' entries of a [BLOCK_Q x GROUP_PAD] row vector whose padding rows are <= them
    (the online softmax's rescale: 0 on padding rows)."""
    if GP == GROUP_PAD:
        y = x
    else:
        y = tl.reshape(tl.max(tl.reshape(x, (BLOCK_Q, GROUP_PAD // GP, GP)), 1), (BLOCK_Q * GP,))
    return y
