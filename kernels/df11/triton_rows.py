"""Triton kernels for the DF11 rows layout (`df11.rows`): decode into a buffer, and a fused GEMV for M = 1..4.

A program owns ROWS weight rows x LANES lanes of the layout's L (LANES = min(L, 32) by default: one warp
per row when L >= 32); grid (cdiv(N, ROWS), L / LANES). Every lane finds its stream from the index
(row offset + lane offset), knows its code count, and decodes alone: no count pass, no prefix sum, and
its outputs W[r, l + i L] sit at positions fixed by (r, l, i). A lane keeps a 64-bit bit buffer (the
next 32 - t stream bits, MSB-aligned) and refills one aligned 32-bit word when it holds <= 32 bits (every
~12 codes at ~2.7 bits per code), so the next code is always in the buffer and each step is one LUT walk
(1 load for codes <= 8 bits, a predicated second one for longer codes) plus a shift. Word loads are masked
to the lane's own [start, end), so no stream pad is needed and a corrupt stream cannot read out of bounds.
Positions, counts and table entries are int32 (64-bit SASS arithmetic costs two instructions an op); the
main loop runs K // L steps with every lane active (no column mask), unrolled UNROLL times, and one masked
step takes the last K mod L columns. The kernels move integers (uint8 in, int16 out) and turn bf16 into
fp32 by a 16-bit shift, so the interpreter's bf16 arithmetic never comes into play.

Corruption: a lane that hits an unused table entry (the min of its entries is 0), or that does not end
exactly at its stream's marker (the bits after its last code, to its last word's end, must be 1 0...0),
sets err[program] = 1. The decoder still writes (positions cannot be wrong, values can: the host raises
on err before anyone sees the weight); the GEMV writes nothing.

GEMV: each lane multiplies its weights by x[m, k] in fp32 (products of two bf16 are exact in fp32) and
sums them in k order; one `tl.sum` over the LANES lanes at the end; the L / LANES lane groups of a row
(split-K, in k mod L) meet in fp32 atomics into a zeroed y, else each program stores its rows (every
y element written once). Error: |y - y_fp64| <= gamma_d sum_k |w_k x_k| with d = ceil(K / L) +
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
from codesign.specs import CodesignError

DECODE_OP = "df11_rows_decode"
GEMV_OP = "df11_rows_gemv"
GEMV_MAX_M = 4  # x rows the GEMV keeps accumulators for (one fp32 register per row per lane)
# 4 warps of one row each: the loop is latency-bound on the dependent LUT load, and small programs keep
# many rows in flight. Untuned (no GPU numbers yet; `codesign tune --op df11_rows_decode` / `df11_rows_gemv`
# writes the tables).
DEFAULT_NUM_WARPS = 4
WARP = 32
# Main-loop steps per iteration (even: with codes <= 16 bits, two LUT levels, the 33+ bits a lane holds
# cover two codes, so it refills every second code): constant pointer offsets, one loop branch per 4 codes.
UNROLL = tl.constexpr(4)


class RowsStream(NamedTuple):
    """A rows container as the kernels take it: contiguous device buffers plus its geometry.

    stream int32 (the u32 words), sign_mantissa uint8[N * K], row_offsets int32[N + 1] (the u32 bits),
    lane_offsets int16[N * L] (the u16 bits), luts int32[T * 256].
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
    must keep the next code: codes <= 16 bits decoded in pairs). Returns (entry, buf, t, q): entry =
    length << 16 | symbol << 7; 0 on an unused table entry (the buffer then stops), 1 (length 0) on lanes
    `act` masks off (MASKED), so min(entry) flags a lane. Unmasked, a row past N decodes its all-zero buffer
    (in-bounds table loads)."""
    idx = ((buf >> 56) & 0xFF).to(tl.int32)
    if MASKED:
        e = tl.load(lut_ptr + idx, mask=act, other=1)
    else:
        e = tl.load(lut_ptr + idx)
    for lvl in tl.static_range(1, LEVELS):  # codes > 8 bits: the next table (the last level has no pointers)
        ptr = e < 0
        e2 = tl.load(lut_ptr + (((buf >> (56 - 8 * lvl)) & 0xFF).to(tl.int32) - e), mask=ptr, other=0)
        e = tl.where(ptr, e2, e)
    length = e >> 16
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
def _decode_step(lane_ptr, lut_ptr, smp, outp, buf, t, q, words, emin, act, LEVELS: tl.constexpr,
                 MASKED: tl.constexpr, REFILL: tl.constexpr):  # fmt: skip
    """One code a lane: decode, join with its sign/mantissa byte, store (masked by act; the byte load only
    when MASKED: unmasked, rows past N read row N - 1's bytes)."""
    e, buf, t, q = _next_code(lane_ptr, lut_ptr, buf, t, q, words, act, LEVELS, MASKED, REFILL)
    tl.store(outp, _bf16_bits(smp, e, act, MASKED).to(tl.int16), mask=act)  # the low 16 bits
    return buf, t, q, tl.minimum(emin, e)


@triton.jit
def _bf16_bits(smp, e, act, MASKED: tl.constexpr):
    """The bf16 bits in bits 0..15 (higher bits: don't care): sign and mantissa from the byte at smp
    (v * 257 puts bit 7 at bit 15), the exponent from the table entry (symbol << 7)."""
    if MASKED:
        v = tl.load(smp, mask=act, other=0).to(tl.int32)
    else:
        v = tl.load(smp).to(tl.int32)
    return ((v * 257) & 0x807F) | (e & -32896)  # -32896 = ~0x807F


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
):
    """out[r * K + k] (int16) = bf16 bits of W[r, k] for this program's rows and lanes."""
    pid_r = tl.program_id(0)
    pid_l = tl.program_id(1)
    zero = tl.zeros([ROWS, LANES], dtype=tl.int32)
    rows = pid_r * ROWS + tl.arange(0, ROWS)[:, None] + zero
    lane = pid_l * LANES + tl.arange(0, LANES)[None, :] + zero
    row_ok = rows < N
    lane_ptr, words, buf = _lanes_start(stream_ptr, rowoff_ptr, laneoff_ptr, rows, lane, row_ok, L)
    t = zero - 32  # 32 - bits held
    q = zero + 2
    # pointers advance by L a step: no 64-bit index math in the loop; rows past N read row N - 1's bytes
    smp = sm_ptr + tl.minimum(rows, N - 1).to(tl.int64) * K + lane
    outp = out_ptr + rows.to(tl.int64) * K + lane
    emin = zero + 1
    for _ in range(K // (UNROLL * L)):  # every lane active: no column mask, no mask on the first table load
        for u in tl.static_range(UNROLL):  # constant pointer offsets, one loop branch per UNROLL codes
            buf, t, q, emin = _decode_step(lane_ptr, lut_ptr, smp + u * L, outp + u * L, buf, t, q, words, emin,
                                           row_ok, LEVELS, False, LEVELS > 2 or u % 2 == 1)  # fmt: skip
        smp += UNROLL * L
        outp += UNROLL * L
    for _ in range((K // L) % UNROLL):
        buf, t, q, emin = _decode_step(lane_ptr, lut_ptr, smp, outp, buf, t, q, words, emin, row_ok, LEVELS,
                                       False, True)  # fmt: skip
        smp += L
        outp += L
    act = row_ok & (lane + (K // L) * L < K)  # the last K % L columns (none when L divides K)
    buf, t, q, emin = _decode_step(
        lane_ptr, lut_ptr, smp, outp, buf, t, q, words, emin, act, LEVELS, True, True
    )
    bad = _lane_bad(buf, t, q, words, emin, row_ok)
    tl.store(err_ptr + pid_l * tl.num_programs(0) + pid_r, tl.max(tl.max(bad, axis=1), axis=0))


@triton.jit
def _x_row(xp, m):
    """fp32 of bf16 x at pointers xp (x as int16 bits), 0 where m masks (None: no mask): [LANES] broadcast
    over the rows."""
    xb = tl.load(xp, mask=m, other=0 if m is not None else None).to(tl.int32)
    return (xb << 16).to(tl.float32, bitcast=True)[None, :]


@triton.jit
def _weight(smp, e, act, MASKED: tl.constexpr):
    """fp32 of the bf16 weight from its sign/mantissa byte and table entry e (+0.0 where masked)."""
    return (_bf16_bits(smp, e, act, MASKED) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_step(lane_ptr, lut_ptr, smp, xp, stride_xm, buf, t, q, words, emin, acc0, acc1, acc2, acc3, act, xm,
               LEVELS: tl.constexpr, MB: tl.constexpr, MASKED: tl.constexpr, REFILL: tl.constexpr):  # fmt: skip
    """One code a lane: decode, form the fp32 weight, add w * x[m, k] into acc_m for m < MB."""
    e, buf, t, q = _next_code(lane_ptr, lut_ptr, buf, t, q, words, act, LEVELS, MASKED, REFILL)
    w = _weight(smp, e, act, MASKED)
    acc0 += w * _x_row(xp, xm)
    if MB > 1:
        acc1 += w * _x_row(xp + stride_xm, xm)
    if MB > 2:
        acc2 += w * _x_row(xp + 2 * stride_xm, xm)
    if MB > 3:
        acc3 += w * _x_row(xp + 3 * stride_xm, xm)
    return buf, t, q, tl.minimum(emin, e), acc0, acc1, acc2, acc3


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
    """y[m, r] (fp32) (+)= sum_k W[r, k] x[m, k] for m < MB, W decoded in registers and never stored."""
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
    smp = sm_ptr + tl.minimum(rows, N - 1).to(tl.int64) * K + lane  # rows past N read row N - 1's bytes
    xp = x_ptr + lane1
    acc0 = tl.zeros([ROWS, LANES], dtype=tl.float32)
    acc1 = tl.zeros([ROWS, LANES], dtype=tl.float32)
    acc2 = tl.zeros([ROWS, LANES], dtype=tl.float32)
    acc3 = tl.zeros([ROWS, LANES], dtype=tl.float32)
    emin = zero + 1
    for _ in range(K // (UNROLL * L)):  # every lane active: no column mask, no mask on the first table load
        for u in tl.static_range(UNROLL):  # constant pointer offsets, one loop branch per UNROLL codes
            buf, t, q, emin, acc0, acc1, acc2, acc3 = _gemv_step(
                lane_ptr, lut_ptr, smp + u * L, xp + u * L, stride_xm, buf, t, q, words, emin, acc0, acc1, acc2,
                acc3, row_ok, None, LEVELS, MB, False, LEVELS > 2 or u % 2 == 1)  # fmt: skip
        smp += UNROLL * L
        xp += UNROLL * L
    for _ in range((K // L) % UNROLL):
        buf, t, q, emin, acc0, acc1, acc2, acc3 = _gemv_step(
            lane_ptr, lut_ptr, smp, xp, stride_xm, buf, t, q, words, emin, acc0, acc1, acc2, acc3, row_ok, None,
            LEVELS, MB, False, True)  # fmt: skip
        smp += L
        xp += L
    xm = lane1 + (K // L) * L < K  # the last K % L columns (none when L divides K)
    buf, t, q, emin, acc0, acc1, acc2, acc3 = _gemv_step(
        lane_ptr, lut_ptr, smp, xp, stride_xm, buf, t, q, words, emin, acc0, acc1, acc2, acc3, row_ok & xm[None, :],
        xm, LEVELS, MB, True, True)  # fmt: skip
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
    return (triton.cdiv(s.n, int(cfg["ROWS"])), s.lanes // int(cfg["LANES"]))


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
    return _rows_decode_kernel[launch_grid(s, cfg)](
        *_args(s, err), out, s.n, s.k, L=s.lanes, ROWS=int(cfg["ROWS"]), LANES=int(cfg["LANES"]),
        LEVELS=s.levels, num_warps=int(cfg["num_warps"]),
    )  # fmt: skip


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
    return _rows_gemv_kernel[grid](
        *_args(s, err), x_bits, y, s.n, s.k, x_bits.stride(0), y.stride(0), L=s.lanes, ROWS=int(cfg["ROWS"]),
        LANES=int(cfg["LANES"]), LEVELS=s.levels, MB=m, ATOMIC=grid[1] > 1, num_warps=int(cfg["num_warps"]),
    )  # fmt: skip


def gemv_error_bound(k: int, lanes: int, group_lanes: int) -> float:
    """gamma_d for the GEMV's fp32 summation tree (module docstring): |y - y64| <= this * sum |w x|."""
    d = -(-k // lanes) + int(math.log2(group_lanes)) + lanes // group_lanes
    u = 2.0**-24
    return d * u / (1 - d * u)
