"""Triton kernels for the DF11 rows layout (`df11.rows`): decode into a buffer, and a fused GEMV for M = 1..4.

A program owns ROWS weight rows x LANES lanes of the layout's L (LANES = min(L, 32) by default: one warp
per row when L >= 32); grid (cdiv(N, ROWS), L / LANES). Every lane finds its stream from the index
(row offset + lane offset), knows its code count, and decodes alone: no count pass, no prefix sum, and
its outputs W[r, l + i L] sit at positions fixed by (r, l, i). A lane keeps a 64-bit bit buffer (the
next `nb` stream bits, MSB-aligned) and refills 32 bits from 4 bytes when nb <= 32 (every ~12 codes at
~2.7 bits per code), so the next code is always in the buffer and each step is one LUT walk (1 load for
codes <= 8 bits) plus a shift. Byte loads are masked to the lane's own [start, end), so no stream pad is
needed and a corrupt stream cannot read out of bounds. The kernels move integers (uint8 in, int16 out) and
turn bf16 into fp32 by a 16-bit shift, so the interpreter's bf16 arithmetic never comes into play.

Corruption: a lane that hits an unused table entry, or whose decoded bits do not end in its last byte
(ceil(bits / 8) != end - start), sets err[program] = 1. The decoder still writes (positions cannot be
wrong, values can: the host raises on err before anyone sees the weight); the GEMV writes nothing.

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
from typing import NamedTuple

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
# many rows in flight. Untuned (no GPU numbers yet; `codesign tune` would write tables for these ops).
DEFAULT_NUM_WARPS = 4
WARP = 32


class RowsStream(NamedTuple):
    """A rows container as the kernels take it: contiguous device buffers plus its geometry.

    stream uint8, sign_mantissa uint8[N * K], row_offsets int32[N + 1] (the u32 bits), lane_offsets
    int16[N * L] (the u16 bits), luts int32[T * 256].
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
def _word(stream_ptr, p, end, m):
    """Big-endian 32-bit word of stream bytes p..p+3 (int64); bytes at or past `end` read as 0."""
    b0 = tl.load(stream_ptr + p, mask=m & (p < end), other=0).to(tl.int64)
    b1 = tl.load(stream_ptr + p + 1, mask=m & (p + 1 < end), other=0).to(tl.int64)
    b2 = tl.load(stream_ptr + p + 2, mask=m & (p + 2 < end), other=0).to(tl.int64)
    b3 = tl.load(stream_ptr + p + 3, mask=m & (p + 3 < end), other=0).to(tl.int64)
    return (b0 << 24) | (b1 << 16) | (b2 << 8) | b3


@triton.jit
def _lanes_start(stream_ptr, rowoff_ptr, laneoff_ptr, rows, lane, row_ok, L: tl.constexpr):
    """Per lane: (start, end) bytes of its stream, and its bit buffer filled with the first 8 bytes."""
    r64 = rows.to(tl.int64)
    base = tl.load(rowoff_ptr + r64, mask=row_ok, other=0).to(tl.int64) & 0xFFFFFFFF
    nxt = tl.load(rowoff_ptr + r64 + 1, mask=row_ok, other=0).to(tl.int64) & 0xFFFFFFFF
    lo = tl.load(laneoff_ptr + r64 * L + lane, mask=row_ok, other=0).to(tl.int64) & 0xFFFF
    more = lane + 1 < L
    hi = tl.load(laneoff_ptr + r64 * L + lane + 1, mask=row_ok & more, other=0).to(tl.int64) & 0xFFFF
    start = base + lo
    end = tl.where(more, base + hi, nxt)
    buf = (_word(stream_ptr, start, end, row_ok) << 32) | _word(stream_ptr, start + 4, end, row_ok)
    return start, end, buf


@triton.jit
def _next_code(stream_ptr, lut_ptr, buf, nb, ptr, end, act, LEVELS: tl.constexpr):
    """Decode the code at the top of each active lane's buffer and consume it; refill 32 bits when the
    buffer holds <= 32. Returns (symbol, length, buf, nb, ptr); length 0 marks an unused table entry."""
    table = tl.zeros_like(buf)
    sym = tl.zeros_like(buf)
    length = tl.zeros_like(buf)
    pending = act
    for lvl in tl.static_range(LEVELS):
        e = tl.load(lut_ptr + table * 256 + ((buf >> (56 - 8 * lvl)) & 0xFF), mask=pending, other=0)
        e = e.to(tl.int64)
        leaf = pending & ((e & 0x8000) == 0)
        sym = tl.where(leaf, e & 0xFF, sym)
        length = tl.where(leaf, e >> 8, length)
        table = tl.where(pending, e & 0x7FFF, table)
        pending = pending & ((e & 0x8000) != 0)
    buf = buf << length  # length is 0 on inactive lanes
    nb = nb - length
    refill = act & (nb <= 32)
    w = _word(stream_ptr, ptr, end, refill)
    buf = tl.where(refill, buf | (w << tl.maximum(32 - nb, 0)), buf)
    nb = tl.where(refill, nb + 32, nb)
    ptr = tl.where(refill, ptr + 4, ptr)
    return sym, length, buf, nb, ptr


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
    start, end, buf = _lanes_start(stream_ptr, rowoff_ptr, laneoff_ptr, rows, lane, row_ok, L)
    nb = tl.zeros_like(buf) + 64
    ptr = start + 8
    base = rows.to(tl.int64) * K
    bad = zero
    for i in range(tl.cdiv(K, L)):
        col = lane + i * L
        act = row_ok & (col < K)
        sym, length, buf, nb, ptr = _next_code(stream_ptr, lut_ptr, buf, nb, ptr, end, act, LEVELS)
        bad = bad | (act & (length == 0)).to(tl.int32)
        v = tl.load(sm_ptr + base + col, mask=act, other=0).to(tl.int64)
        bits = ((v & 0x80) << 8) | (sym << 7) | (v & 0x7F)
        bits = bits - ((bits >> 15) & 1) * 65536  # the uint16 pattern as a signed int16 value
        tl.store(out_ptr + base + col, bits.to(tl.int16), mask=act)
    used = (ptr - start) * 8 - nb  # bits this lane consumed
    bad = bad | (row_ok & ((used + 7) // 8 != end - start)).to(tl.int32)
    tl.store(err_ptr + pid_l * tl.num_programs(0) + pid_r, tl.max(tl.max(bad, axis=1), axis=0))


@triton.jit
def _x_row(x_ptr, xcol, K):
    """fp32 of bf16 x[xcol] (x as int16 bits), 0 past K: [LANES] broadcast over the rows."""
    xb = tl.load(x_ptr + xcol, mask=xcol < K, other=0).to(tl.int64) & 0xFFFF
    return (xb << 16).to(tl.uint32).to(tl.float32, bitcast=True)[None, :]


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
    start, end, buf = _lanes_start(stream_ptr, rowoff_ptr, laneoff_ptr, rows, lane, row_ok, L)
    nb = tl.zeros_like(buf) + 64
    ptr = start + 8
    base = rows.to(tl.int64) * K
    bad = zero
    acc0 = tl.zeros([ROWS, LANES], dtype=tl.float32)
    acc1 = tl.zeros([ROWS, LANES], dtype=tl.float32)
    acc2 = tl.zeros([ROWS, LANES], dtype=tl.float32)
    acc3 = tl.zeros([ROWS, LANES], dtype=tl.float32)
    for i in range(tl.cdiv(K, L)):
        col = lane + i * L
        act = row_ok & (col < K)
        sym, length, buf, nb, ptr = _next_code(stream_ptr, lut_ptr, buf, nb, ptr, end, act, LEVELS)
        bad = bad | (act & (length == 0)).to(tl.int32)
        v = tl.load(sm_ptr + base + col, mask=act, other=0).to(tl.int64)
        bits = ((v & 0x80) << 8) | (sym << 7) | (v & 0x7F)
        w = (bits << 16).to(tl.uint32).to(tl.float32, bitcast=True)  # +0.0 on inactive lanes
        xcol = lane1 + i * L
        acc0 += w * _x_row(x_ptr, xcol, K)
        if MB > 1:
            acc1 += w * _x_row(x_ptr + stride_xm, xcol, K)
        if MB > 2:
            acc2 += w * _x_row(x_ptr + 2 * stride_xm, xcol, K)
        if MB > 3:
            acc3 += w * _x_row(x_ptr + 3 * stride_xm, xcol, K)
    used = (ptr - start) * 8 - nb
    bad = bad | (row_ok & ((used + 7) // 8 != end - start)).to(tl.int32)
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


def rows_decode_triton(s: RowsStream, out: torch.Tensor, err: torch.Tensor, cfg: dict | None = None) -> None:
    """Decode into `out` (int16[N * K], the bf16 bits); err[p] = 1 marks a corrupt program.

    Assumes validated, contiguous tensors on one device; err int32 with >= prod(launch_grid) entries.
    """
    if s.n * s.k == 0:
        return
    cfg = cfg or launch_config(DECODE_OP, s, s.n * s.k, out.device)
    _rows_decode_kernel[launch_grid(s, cfg)](
        *_args(s, err), out, s.n, s.k, L=s.lanes, ROWS=int(cfg["ROWS"]), LANES=int(cfg["LANES"]),
        LEVELS=s.levels, num_warps=int(cfg["num_warps"]),
    )  # fmt: skip


def rows_gemv_triton(s: RowsStream, x_bits: torch.Tensor, y: torch.Tensor, err: torch.Tensor,
                     cfg: dict | None = None) -> None:  # fmt: skip
    """y (fp32 [M, N]) = x @ W^T for M <= 4 rows of x_bits (int16 [M, K], bf16 bits; unit column stride).

    y must be zeroed when `launch_grid` has more than one lane group (split-K atomics); otherwise every
    element of y is stored. err int32 with >= prod(launch_grid) entries; a flagged program writes nothing.
    """
    m = x_bits.shape[0]
    if not 1 <= m <= GEMV_MAX_M:
        raise CodesignError(f"rows GEMV takes 1..{GEMV_MAX_M} rows of x, got {m}")
    if s.n == 0:
        return
    cfg = cfg or launch_config(GEMV_OP, s, m, y.device)
    grid = launch_grid(s, cfg)
    _rows_gemv_kernel[grid](
        *_args(s, err), x_bits, y, s.n, s.k, x_bits.stride(0), y.stride(0), L=s.lanes, ROWS=int(cfg["ROWS"]),
        LANES=int(cfg["LANES"]), LEVELS=s.levels, MB=m, ATOMIC=grid[1] > 1, num_warps=int(cfg["num_warps"]),
    )  # fmt: skip


def gemv_error_bound(k: int, lanes: int, group_lanes: int) -> float:
    """gamma_d for the GEMV's fp32 summation tree (module docstring): |y - y64| <= this * sum |w x|."""
    d = -(-k // lanes) + int(math.log2(group_lanes)) + lanes // group_lanes
    u = 2.0**-24
    return d * u / (1 - d * u)
