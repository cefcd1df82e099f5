"""Triton kernels for the DF11 rows layout (`df11.rows`): decode into a buffer, and a fused GEMV for M = 1..4.

A program owns ROWS weight rows x LANES lanes of the layout's L (LANES = min(L, 32) by default: one warp per
row when L >= 32); grid (cdiv(N, ROWS), L / LANES). Every lane finds its stream from the index (row offset +
lane offset), knows its code count, and decodes alone: no count pass, no prefix sum, and its outputs W[r, 4 (l
+ i L) + j] (group l + i L, code j) sit at positions fixed by (r, l, i, j). A group's sign/mantissa is one
32-bit load (`rows.SM_FIELDS`: a rotate and one logic op put a code at the fp32 weight's bits) and, in the
GEMV, each row of x one 64-bit load of 4 bf16. A lane keeps a 64-bit bit buffer (the next 32 - t stream bits,
MSB-aligned) and refills one aligned 32-bit word when it holds <= 32 bits (every ~12 codes at ~2.7 bits per
code), so the next code is always in the buffer and each step is one LUT walk (1 load for codes <= 12 bits, a
predicated second one for longer codes) plus a shift. Word loads are masked to the lane's own [start, end), so
no stream pad is needed and a corrupt stream cannot read out of bounds. Positions, counts and table entries
are int32 (64-bit SASS arithmetic costs two instructions an op); the main loop runs (K // 4) // L group steps
with every lane active (no column mask), and one masked step takes the rest: the last (K // 4) mod L whole
groups and the short group of K mod 4 columns (codes j >= K - 4 g masked). The kernels move integers (u32
words in, int16 out) and turn bf16 into fp32 by a 16-bit shift, so the interpreter's bf16 arithmetic never
comes into play.

Corruption: a lane that hits an unused table entry (the min of its entries is 0), or that does not end
exactly at its stream's marker (the bits after its last code, to its last word's end, must be 1 0...0),
sets err[program] = 1. The decoder still writes (positions cannot be wrong, values can: the host raises
on err before anyone sees the weight); the GEMV writes nothing.

GEMV: each lane multiplies its weights by x[m, k] in fp32 (products of two bf16 are exact in fp32) and
sums them in k order into one accumulator (a chain of at most 4 ceil(ceil(K / 4) / L) adds: its codes);
one `tl.sum` over the LANES lanes at the end; the L / LANES lane groups of a row (split-K, lanes' groups
in g mod L) meet in fp32 atomics into a zeroed y, else each program stores its rows (every y element
written once). Error: |y - y_fp64| <= gamma_d sum_k |w_k x_k| with d = 4 ceil(ceil(K / 4) / L) +
log2(LANES) + L / LANES (the depth of the summation tree), gamma_d = d u / (1 - d u), u = 2^-24.

Launch configs come from `lookup_config` (table ops "df11_rows_decode" / "df11_rows_gemv", shape key
(N, K, lanes), M bucketed for the GEMV); untuned defaults below.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from codesign.autotune.lookup import lookup_config, shape_key
from codesign.backend import device_view
from codesign.kernels.host_math import cdiv
from codesign.specs import CodesignError

DECODE_OP = "df11_rows_decode"
GEMV_OP = "df11_rows_gemv"
GEMV_MAX_M = 4  # x rows the GEMV keeps accumulators for (one fp32 register per row per lane)
# 4 warps of one row each: the loop is latency-bound on the dependent LUT load, and small programs keep
# many rows in flight. Untuned (no GPU numbers yet; `codesign tune --op df11_rows_decode` / `df11_rows_gemv`
# writes the tables).
DEFAULT_NUM_WARPS = 4
WARP = 32
GROUP = 4  # adjacent columns a lane owns (`rows.GROUP`)
# Groups per main-loop iteration: constant pointer offsets, one loop branch per UNROLL groups.
UNROLL = tl.constexpr(2)
CODES_PER_ITER = GROUP * UNROLL.value  # codes a lane decodes per main-loop iteration
SM_FIELD = tl.constexpr(0x807F0000 - (1 << 32))  # sign and mantissa bits of an fp32 weight (as int32)


class RowsStream(NamedTuple):
    """A rows container as the kernels take it: contiguous device buffers plus its geometry.

    stream int32 (the u32 words), sign_mantissa int32[N * ceil(K / 4)] (the u32 words of `rows`), row_offsets
    int32[N + 1] (the u32 bits), lane_offsets int16[N * L] (the u16 bits), luts int32 (`rows.build_rows_luts`).
    """

    stream: torch.Tensor
    sign_mantissa: torch.Tensor
    row_offsets: torch.Tensor
    lane_offsets: torch.Tensor
    luts: torch.Tensor
    n: int
    k: int
    lanes: int
    levels: int


@triton.jit
def _lanes_start(stream_ptr, rowoff_ptr, laneoff_ptr, rows, lane, row_ok, L: tl.constexpr):
    """Per lane: a pointer to its first stream word, its word count, and its bit buffer (int64) filled with
    its first two words. Rows past N get 0 words (every stream load masked off)."""
    r64 = rows.to(tl.int64)
    base = tl.load(rowoff_ptr + r64, mask=row_ok, other=0).to(tl.int64) & 0xFFFFFFFF
    nxt = tl.load(rowoff_ptr + r64 + 1, mask=row_ok, other=0).to(tl.int64) & 0xFFFFFFFF
    lo = tl.load(laneoff_ptr + r64 * L + lane, mask=row_ok, other=0).to(tl.int32) & 0xFFFF
    more = lane + 1 < L
    hi = tl.load(laneoff_ptr + r64 * L + lane + 1, mask=row_ok & more, other=0).to(tl.int32) & 0xFFFF
    words = tl.where(more, hi, (nxt - base).to(tl.int32)) - lo  # a row's words fit int32 (K < 2^26)
    lane_ptr = stream_ptr + base + lo
    w0 = tl.load(lane_ptr, mask=words > 0, other=0).to(tl.uint32).to(tl.int64)
    w1 = tl.load(lane_ptr + 1, mask=words > 1, other=0).to(tl.uint32).to(tl.int64)
    return lane_ptr, words, (w0 << 32) | w1


@triton.jit
def _next_code(lane_ptr, lut_ptr, buf, t, q, words, act, LEVELS: tl.constexpr, MASKED: tl.constexpr,
               REFILL: tl.constexpr):  # fmt: skip
    """Decode the code at the top of each lane's buffer (`build_rows_luts` entries) and consume it; if REFILL,
    refill one word when the buffer holds <= 32 bits (t = 32 - bits held >= 0; without REFILL the buffer
    must keep the next code: codes <= 16 bits, two tables, decoded in pairs). Returns (entry, buf, t, q): entry =
    symbol << 23 | length; 0 on an unused table entry (the buffer then stops), 1 << 23 (length 0) on lanes
    `act` masks off (MASKED), so min(entry) flags a lane. Unmasked, a row past N decodes its all-zero buffer
    (in-bounds table loads)."""
    idx = ((buf >> 52) & 0xFFF).to(tl.int32)  # the first table: the top FIRST_BITS = 12 bits
    if MASKED:
        e = tl.load(lut_ptr + idx, mask=act, other=1 << 23)
    else:
        e = tl.load(lut_ptr + idx)
    if LEVELS > 1:  # codes > 12 bits: the next 4 bits (`rows.TABLE_BITS`)
        ptr = e < 0
        e2 = tl.load(lut_ptr + (((buf >> 48) & 0xF).to(tl.int32) - e), mask=ptr, other=0)
        e = tl.where(ptr, e2, e)
    if LEVELS > 2:  # codes > 16 bits: the next 8 (the last level has no pointers)
        ptr = e < 0
        e2 = tl.load(lut_ptr + (((buf >> 40) & 0xFF).to(tl.int32) - e), mask=ptr, other=0)
        e = tl.where(ptr, e2, e)
    length = e & 31
    buf = buf << length
    t = t + length
    if REFILL:
        refill = t >= 0
        w = tl.load(lane_ptr + q, mask=refill & (q < words), other=0).to(tl.uint32).to(tl.int64)
        buf = buf | (w << (t & 31))  # w is 0 unless refill, when t is 0..31
        t = tl.where(refill, t - 32, t)
        q = q + refill.to(tl.int32)
    return e, buf, t, q


@triton.jit
def _f32_bits(word, e, J: tl.constexpr):
    """fp32 bits of code J of a group: its sign and mantissa from the group's sign/mantissa word rotated left
    8 J (`rows.SM_FIELDS`), its exponent from the table entry e (symbol << 23: already there)."""
    if J == 0:
        r = word
    else:
        r = (word << 8 * J) | ((word >> (32 - 8 * J)) & ((1 << 8 * J) - 1))  # a rotate: one funnel shift
    return (r & SM_FIELD) | (e & 0x7F800000)


@triton.jit
def _decode_group(lane_ptr, lut_ptr, smp, outp, buf, t, q, words, emin, row_ok, left, LEVELS: tl.constexpr,
                  MASKED: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    """One group a lane: its sign/mantissa word, then 4 codes decoded, joined and stored. Unmasked, every
    code is there (rows past N read row N - 1's word); MASKED, code j only where j < left (K - its column).
    VEC (4 divides K): outp is an int64 pointer and the group's 4 bf16 are one 64-bit store."""
    if MASKED:
        word = tl.load(smp, mask=row_ok & (left > 0), other=0)
    else:
        word = tl.load(smp)
    lo = tl.zeros_like(word)
    hi = tl.zeros_like(word)
    for j in tl.static_range(4):
        act = row_ok & (left > j) if MASKED else row_ok
        # codes <= 16 bits (two tables): the 33+ bits held after a refill cover two codes
        e, buf, t, q = _next_code(lane_ptr, lut_ptr, buf, t, q, words, act, LEVELS, MASKED,
                                  MASKED or LEVELS > 2 or j % 2 == 1)  # fmt: skip
        f = _f32_bits(word, e, j)
        if not VEC:
            tl.store(outp + j, (f >> 16).to(tl.int16), mask=act)
        elif j == 0:
            lo = (f >> 16) & 0xFFFF
        elif j == 1:
            lo = lo | (f & -65536)
        elif j == 2:
            hi = (f >> 16) & 0xFFFF
        else:
            hi = hi | (f & -65536)
        emin = tl.minimum(emin, e)
    if VEC:  # little-endian: column 4g in the low 16 bits
        v = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
        tl.store(outp, v, mask=row_ok & (left > 0) if MASKED else row_ok)
    return buf, t, q, emin


@triton.jit
def _lane_bad(buf, t, q, words, emin, row_ok):
    """1 where a lane hit an unused entry (emin 0) or does not end at its marker: the bits after its last
    code, to the end of its words, must be 1 0...0 (1..32 of them; the buffer holds 32 - t >= 33)."""
    pad = words * 32 - (q * 32 - (32 - t))  # bits consumed: the q words loaded less the 32 - t held
    p = tl.minimum(tl.maximum(pad, 1), 32)
    top = ((buf >> 32) & 0xFFFFFFFF) >> (32 - p)  # the top p bits
    marker = (tl.zeros_like(top) + 1) << (p - 1)  # int64: p = 32 would overflow an int32 1 << 31
    return (row_ok & ((emin == 0) | (pad != p) | (top != marker))).to(tl.int32)


@triton.jit
def _rows_decode_kernel(
    stream_ptr,
    sm_ptr,
    rowoff_ptr,
    laneoff_ptr,
    lut_ptr,
    err_ptr,
    out_ptr,
    N,
    K,
    L: tl.constexpr,
    ROWS: tl.constexpr,
    LANES: tl.constexpr,
    LEVELS: tl.constexpr,
    VEC: tl.constexpr,
):
    """out[r * K + k] (int16) = bf16 bits of W[r, k] for this program's rows and lanes (VEC: out as int64
    words of 4, when 4 divides K)."""
    pid_r = tl.program_id(0)
    pid_l = tl.program_id(1)
    zero = tl.zeros([ROWS, LANES], dtype=tl.int32)
    rows = pid_r * ROWS + tl.arange(0, ROWS)[:, None] + zero
    lane = pid_l * LANES + tl.arange(0, LANES)[None, :] + zero
    row_ok = rows < N
    lane_ptr, words, buf = _lanes_start(stream_ptr, rowoff_ptr, laneoff_ptr, rows, lane, row_ok, L)
    t = zero - 32  # 32 - bits held
    q = zero + 2
    G = (K + 3) // 4  # groups (sign/mantissa words) a row
    # pointers advance by L groups a step: no 64-bit index math in the loop; rows past N read row N - 1's words
    smp = sm_ptr + tl.minimum(rows, N - 1).to(tl.int64) * G + lane
    OUT: tl.constexpr = 1 if VEC else 4  # out elements a group
    outp = out_ptr + rows.to(tl.int64) * (K * OUT // 4) + OUT * lane
    emin = zero + 1
    for _ in range((K // 4) // (UNROLL * L)):  # whole groups, every lane active: no masks
        for u in tl.static_range(UNROLL):
            buf, t, q, emin = _decode_group(lane_ptr, lut_ptr, smp + u * L, outp + u * OUT * L, buf, t, q, words,
                                            emin, row_ok, zero, LEVELS, False, VEC)  # fmt: skip
        smp += UNROLL * L
        outp += UNROLL * OUT * L
    for _ in range(((K // 4) // L) % UNROLL):
        buf, t, q, emin = _decode_group(lane_ptr, lut_ptr, smp, outp, buf, t, q, words, emin, row_ok, zero, LEVELS,
                                        False, VEC)  # fmt: skip
        smp += L
        outp += OUT * L
    # the tail, explicitly: the last (K // 4) % L whole groups and the short group (K mod 4 columns), if any
    left = K - 4 * (((K // 4) // L) * L + lane)
    buf, t, q, emin = _decode_group(lane_ptr, lut_ptr, smp, outp, buf, t, q, words, emin, row_ok, left, LEVELS,
                                    True, VEC)  # fmt: skip
    bad = _lane_bad(buf, t, q, words, emin, row_ok)
    tl.store(err_ptr + pid_l * tl.num_programs(0) + pid_r, tl.max(tl.max(bad, axis=1), axis=0))


@triton.jit
def _x_quad(xp, m):
    """The 4 bf16 of x at int64 pointers xp (one load; 0 where m masks, None: no mask), fp32, each [1, LANES]."""
    xq = tl.load(xp, mask=m, other=0 if m is not None else None)
    lo = xq.to(tl.int32)
    hi = (xq >> 32).to(tl.int32)
    x0 = (lo << 16).to(tl.float32, bitcast=True)[None, :]
    x1 = (lo & -65536).to(tl.float32, bitcast=True)[None, :]
    x2 = (hi << 16).to(tl.float32, bitcast=True)[None, :]
    x3 = (hi & -65536).to(tl.float32, bitcast=True)[None, :]
    return x0, x1, x2, x3


@triton.jit
def _pick(x0, x1, x2, x3, J: tl.constexpr):
    if J == 0:
        return x0
    elif J == 1:
        return x1
    elif J == 2:
        return x2
    else:
        return x3


@triton.jit
def _gemv_group(lane_ptr, lut_ptr, smp, xp, stride_xm, buf, t, q, words, emin, acc0, acc1, acc2, acc3, row_ok,
                left, xm, LEVELS: tl.constexpr, MB: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One group a lane: its sign/mantissa word and 4 x values of each row of x (one load each), then 4 codes
    decoded, each weight (fp32) times x[m, k] added into acc_m for m < MB, in k order. MASKED: code j only
    where j < left (K - the group's first column), x where xm; a missing code's weight is +0.0."""
    if MASKED:
        word = tl.load(smp, mask=row_ok & (left > 0), other=0)
    else:
        word = tl.load(smp)
    a0, a1, a2, a3 = _x_quad(xp, xm)
    if MB > 1:
        b0, b1, b2, b3 = _x_quad(xp + stride_xm, xm)
    if MB > 2:
        c0, c1, c2, c3 = _x_quad(xp + 2 * stride_xm, xm)
    if MB > 3:
        d0, d1, d2, d3 = _x_quad(xp + 3 * stride_xm, xm)
    for j in tl.static_range(4):
        act = row_ok & (left > j) if MASKED else row_ok
        e, buf, t, q = _next_code(lane_ptr, lut_ptr, buf, t, q, words, act, LEVELS, MASKED,
                                  MASKED or LEVELS > 2 or j % 2 == 1)  # fmt: skip
        w = _f32_bits(word, e, j).to(tl.float32, bitcast=True)
        if MASKED:
            w = tl.where(act, w, 0.0)
        acc0 += w * _pick(a0, a1, a2, a3, j)
        if MB > 1:
            acc1 += w * _pick(b0, b1, b2, b3, j)
        if MB > 2:
            acc2 += w * _pick(c0, c1, c2, c3, j)
        if MB > 3:
            acc3 += w * _pick(d0, d1, d2, d3, j)
        emin = tl.minimum(emin, e)
    return buf, t, q, emin, acc0, acc1, acc2, acc3


@triton.jit
def _store_rows(y_ptr, acc, rows1, mask, ATOMIC: tl.constexpr):
    part = tl.sum(acc, axis=1)
    if ATOMIC:
        tl.atomic_add(y_ptr + rows1, part, mask=mask)
    else:
        tl.store(y_ptr + rows1, part, mask=mask)


@triton.jit
def _rows_gemv_kernel(
    stream_ptr,
    sm_ptr,
    rowoff_ptr,
    laneoff_ptr,
    lut_ptr,
    err_ptr,
    x_ptr,
    y_ptr,
    N,
    K,
    stride_xm,
    stride_ym,
    L: tl.constexpr,
    ROWS: tl.constexpr,
    LANES: tl.constexpr,
    LEVELS: tl.constexpr,
    MB: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """y[m, r] (fp32) (+)= sum_k W[r, k] x[m, k] for m < MB, W decoded in registers and never stored; x as
    int64 words of 4 bf16 (row stride stride_xm words, ceil(K / 4) words a row, 0 past K)."""
    pid_r = tl.program_id(0)
    pid_l = tl.program_id(1)
    zero = tl.zeros([ROWS, LANES], dtype=tl.int32)
    rows = pid_r * ROWS + tl.arange(0, ROWS)[:, None] + zero
    lane1 = pid_l * LANES + tl.arange(0, LANES)
    lane = lane1[None, :] + zero
    row_ok = rows < N
    lane_ptr, words, buf = _lanes_start(stream_ptr, rowoff_ptr, laneoff_ptr, rows, lane, row_ok, L)
    t = zero - 32  # 32 - bits held
    q = zero + 2
    G = (K + 3) // 4
    smp = sm_ptr + tl.minimum(rows, N - 1).to(tl.int64) * G + lane  # rows past N read row N - 1's words
    xp = x_ptr + lane1
    acc0 = tl.zeros([ROWS, LANES], dtype=tl.float32)
    acc1 = tl.zeros([ROWS, LANES], dtype=tl.float32)
    acc2 = tl.zeros([ROWS, LANES], dtype=tl.float32)
    acc3 = tl.zeros([ROWS, LANES], dtype=tl.float32)
    emin = zero + 1
    for _ in range((K // 4) // (UNROLL * L)):  # whole groups, every lane active: no masks
        for u in tl.static_range(UNROLL):
            buf, t, q, emin, acc0, acc1, acc2, acc3 = _gemv_group(
                lane_ptr, lut_ptr, smp + u * L, xp + u * L, stride_xm, buf, t, q, words, emin, acc0, acc1, acc2,
                acc3, row_ok, zero, None, LEVELS, MB, False)  # fmt: skip
        smp += UNROLL * L
        xp += UNROLL * L
    for _ in range(((K // 4) // L) % UNROLL):
        buf, t, q, emin, acc0, acc1, acc2, acc3 = _gemv_group(
            lane_ptr, lut_ptr, smp, xp, stride_xm, buf, t, q, words, emin, acc0, acc1, acc2, acc3, row_ok, zero,
            None, LEVELS, MB, False)  # fmt: skip
        smp += L
        xp += L
    # the tail, explicitly: the last (K // 4) % L whole groups and the short group (K mod 4 columns), if any
    left1 = K - 4 * (((K // 4) // L) * L + lane1)
    buf, t, q, emin, acc0, acc1, acc2, acc3 = _gemv_group(
        lane_ptr, lut_ptr, smp, xp, stride_xm, buf, t, q, words, emin, acc0, acc1, acc2, acc3, row_ok,
        left1[None, :] + zero, left1 > 0, LEVELS, MB, True)  # fmt: skip
    bad = _lane_bad(buf, t, q, words, emin, row_ok)
    err = tl.max(tl.max(bad, axis=1), axis=0)
    tl.store(err_ptr + pid_l * tl.num_programs(0) + pid_r, err)
    rows1 = pid_r * ROWS + tl.arange(0, ROWS)
    # Broadcast the flag to a lane vector first (the interpreter mis-types vector & scalar masks).
    mask = (rows1 < N) & ((tl.zeros_like(rows1) + err) == 0)
    _store_rows(y_ptr, acc0, rows1, mask, ATOMIC)
    if MB > 1:
        _store_rows(y_ptr + stride_ym, acc1, rows1, mask, ATOMIC)
    if MB > 2:
        _store_rows(y_ptr + 2 * stride_ym, acc2, rows1, mask, ATOMIC)
    if MB > 3:
        _store_rows(y_ptr + 3 * stride_ym, acc3, rows1, mask, ATOMIC)


# ----------------------------------------------------------------------------- launchers


def table_key(n: int, k: int, lanes: int) -> str:
    """The rows decode / GEMV tables' shape key (M: the rows of x for the GEMV, N * K for the decoder)."""
    return shape_key(N=n, K=k, lanes=lanes)


def launch_config(op: str, s: RowsStream, m: int, device: torch.device) -> dict:
    """{"LANES", "ROWS", "num_warps"} of `op` for container `s` at M = m: the tuned entry, else the default
    (LANES = min(L, 32): one warp per row; ROWS = 32 num_warps / LANES). CodesignError on a bad entry."""
    lanes = min(s.lanes, WARP)
    default = {
        "LANES": lanes,
        "ROWS": max(1, WARP * DEFAULT_NUM_WARPS // lanes),
        "num_warps": DEFAULT_NUM_WARPS,
    }
    cfg = lookup_config(op, device_view(device).gpu_name, m, table_key(s.n, s.k, s.lanes), default)
    ln, rows = int(cfg["LANES"]), int(cfg["ROWS"])
    if ln < 1 or ln > s.lanes or s.lanes % ln or ln & (ln - 1) or rows < 1 or rows & (rows - 1):
        raise CodesignError(
            f"{op}: config {cfg} needs LANES a power of two dividing {s.lanes}, ROWS a power of two"
        )
    return cfg


def launch_grid(s: RowsStream, cfg: dict) -> tuple[int, int]:
    """(row blocks, lane groups per row); lane groups > 1 is split-K (fp32 atomics in the GEMV)."""
    return (cdiv(s.n, int(cfg["ROWS"])), s.lanes // int(cfg["LANES"]))


def _args(s: RowsStream, err: torch.Tensor) -> tuple:
    return (s.stream, s.sign_mantissa, s.row_offsets, s.lane_offsets, s.luts, err)


def rows_decode_triton(s: RowsStream, out: torch.Tensor, err: torch.Tensor, cfg: dict | None = None) -> Any:
    """Decode into `out` (int16[N * K], the bf16 bits); err[p] = 1 marks a corrupt program. Returns Triton's
    handle of the launched kernel (None when nothing launches; its `asm` in a compile-only session).

    Assumes validated, contiguous tensors on one device; err int32 with >= prod(launch_grid) entries.
    """
    if s.n * s.k == 0:
        return None
    cfg = cfg or launch_config(DECODE_OP, s, s.n * s.k, out.device)
    vec = s.k % GROUP == 0 and out.data_ptr() % 8 == 0  # a group's 4 bf16 as one aligned 64-bit store
    return _rows_decode_kernel[launch_grid(s, cfg)](
        *_args(s, err), out.view(torch.int64) if vec else out, s.n, s.k, L=s.lanes, ROWS=int(cfg["ROWS"]),
        LANES=int(cfg["LANES"]), LEVELS=s.levels, VEC=vec, num_warps=int(cfg["num_warps"]),
    )  # fmt: skip


def x_words(x_bits: torch.Tensor) -> torch.Tensor:
    """x_bits (int16 [M, K], unit column stride) as the GEMV reads it: int64 words of 4 bf16, ceil(K / 4) a row
    (0 past K). A view when 4 divides K and the rows are 8-byte aligned, else a zero-padded copy."""
    m, k = x_bits.shape
    g = -(-k // GROUP)
    if (
        k % GROUP == 0
        and x_bits.stride(0) % GROUP == 0
        and x_bits.data_ptr() % 8 == 0
        and x_bits.stride(1) == 1
    ):
        return torch.as_strided(x_bits, (m, k), x_bits.stride()).view(torch.int64)
    pad = torch.zeros(m, g * GROUP, dtype=torch.int16, device=x_bits.device)
    pad[:, :k] = x_bits
    return pad.view(torch.int64)


def rows_gemv_triton(s: RowsStream, x_bits: torch.Tensor, y: torch.Tensor, err: torch.Tensor,
                     cfg: dict | None = None) -> Any:  # fmt: skip
    """y (fp32 [M, N]) = x @ W^T for M <= 4 rows of x_bits (int16 [M, K], bf16 bits; unit column stride).

    y must be zeroed when `launch_grid` has more than one lane group (split-K atomics); otherwise every
    element of y is stored. err int32 with >= prod(launch_grid) entries; a flagged program writes nothing.
    Returns Triton's handle of the launched kernel (None when nothing launches).
    """
    m = x_bits.shape[0]
    if not 1 <= m <= GEMV_MAX_M:
        raise CodesignError(f"rows GEMV takes 1..{GEMV_MAX_M} rows of x, got {m}")
    if s.n == 0:
        return None
    cfg = cfg or launch_config(GEMV_OP, s, m, y.device)
    grid = launch_grid(s, cfg)
    xw = x_words(x_bits)
    return _rows_gemv_kernel[grid](
        *_args(s, err), xw, y, s.n, s.k, xw.stride(0), y.stride(0), L=s.lanes, ROWS=int(cfg["ROWS"]),
        LANES=int(cfg["LANES"]), LEVELS=s.levels, MB=m, ATOMIC=grid[1] > 1, num_warps=int(cfg["num_warps"]),
    )  # fmt: skip


def gemv_error_bound(k: int, lanes: int, group_lanes: int) -> float:
    """gamma_d for the GEMV's fp32 summation tree (module docstring): |y - y64| <= this * sum |w x|."""
    steps = cdiv(cdiv(k, GROUP), lanes)  # groups of the busiest lane
    d = GROUP * steps + int(math.log2(group_lanes)) + lanes // group_lanes
    u = 2.0**-24
    return d * u / (1 - d * u)
