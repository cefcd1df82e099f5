"""Systolic-array GEMM model, cycle-exact with SCALE-Sim 3.0.0, computed in closed form over folds.

A GEMM Y[M, N] = X[M, K] @ W[K, N] runs on an R x C array in one of SCALE-Sim's three dataflows.
SCALE-Sim (scalesim/compute/systolic_compute_{os,ws,is}.py) maps the operand matrices as

    dataflow  Sr (spatial rows)  Sc (spatial cols)  T (temporal)  fold length (cycles)
    "os"      M                  N                  K             R + C + T - 2  (code; paper: 2R + C + T - 2)
    "ws"      K                  N                  M             2R + C + T - 2
    "is"      K                  M                  N             2R + C + T - 2

and runs ceil(Sr / R) * ceil(Sc / C) folds back to back (column folds outer, row folds inner). Stall-free,
its reported "Total Cycles" is folds * fold_length - 1: the index of the last demand row, because it
reports the cycle at which the last output is written, counting from 0.

Output-stationary fold length: SCALE-Sim's code streams T operand rows with C - 1 (ifmap) / R - 1
(filter) cycles of skew and drains the outputs while the next fold fills, giving R + C + T - 2; its
paper (Samajdar et al., ISPASS 2020) counts a separate R-cycle output drain, 2R + C + T - 2. The
maintainers agreed the paper's count describes the hardware but left the code (scale-sim-v3 issue #4).
We follow the code by default, so reports diff cleanly against SCALE-Sim; pass os_fold="paper" for the
paper's count.

The memory side (double-buffered SRAMs fed from DRAM, as SCALE-Sim models them) follows the compute
part: `simulate_layer` returns SCALE-Sim's per-layer report rows and `gemm_cost` prices a
`codesign.specs.Gemm` on a `SystolicArray`. Neither builds SCALE-Sim's per-cycle demand matrices:
  - compute fields, SRAM counts and SRAM start/stop cycles are closed forms over folds;
  - the ofmap write buffer jumps from drain event to drain event over per-fold write-count patterns;
  - CALC-mode read buffers: a closed form when the operand fits half the SRAM, else (GEMM) an O(folds)
    window walk, or (conv, with repeated im2col addresses) a numpy replay of the request addresses;
  - USER-mode read buffers: which requests miss is timing-independent, so a numpy scan of the request
    addresses finds the misses; only misses and drains are stepped one by one.
Every field matches SCALE-Sim 3.0.0 byte for byte on the tested configurations (tests/test_scalesim_compat.py),
SCALE-Sim's quirks included (they are pointed out where they are reproduced).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field

import numpy as np

from codesign.specs import CodesignError, Gemm, check_choice, check_positive_int, dtype_bits

DATAFLOWS = ("os", "ws", "is")
OS_FOLDS = ("code", "paper")


def _check_array(rows: int, cols: int, dataflow: str) -> None:
    check_positive_int("rows", rows)
    check_positive_int("cols", cols)
    check_choice("dataflow", dataflow, DATAFLOWS)


def operand_mapping(M: int, N: int, K: int, dataflow: str) -> tuple[int, int, int]:
    """(Sr, Sc, T) of a GEMM in `dataflow`, as SCALE-Sim maps it (see the module docstring table)."""
    check_choice("dataflow", dataflow, DATAFLOWS)
    if dataflow == "os":
        return M, N, K
    if dataflow == "ws":
        return K, N, M
    return K, M, N


def fold_cycles(rows: int, cols: int, t: int, dataflow: str, os_fold: str = "code") -> int:
    """Cycles of one stall-free fold with temporal extent `t` on a rows x cols array.

    os: R + C + t - 2 (SCALE-Sim's code; os_fold="paper" gives 2R + C + t - 2); ws, is: 2R + C + t - 2.
    """
    _check_array(rows, cols, dataflow)
    check_positive_int("t", t)
    check_choice("os_fold", os_fold, OS_FOLDS)
    if dataflow == "os" and os_fold == "code":
        return rows + cols + t - 2
    return 2 * rows + cols + t - 2


def num_folds(M: int, N: int, K: int, rows: int, cols: int, dataflow: str) -> tuple[int, int]:
    """(row_folds, col_folds) = (ceil(Sr / R), ceil(Sc / C))."""
    sr, sc, _ = operand_mapping(M, N, K, dataflow)
    return math.ceil(sr / rows), math.ceil(sc / cols)


def compute_cycles(M: int, N: int, K: int, rows: int, cols: int, dataflow: str, os_fold: str = "code") -> int:
    """Stall-free cycles of GEMM (M, N, K), equal to SCALE-Sim's "Total Cycles" column.

    cycles = ceil(Sr / R) * ceil(Sc / C) * fold_cycles(R, C, T) - 1 with (Sr, Sc, T) from `operand_mapping`.
    """
    for name, v in (("M", M), ("N", N), ("K", K)):
        check_positive_int(name, v)
    _check_array(rows, cols, dataflow)
    sr, sc, t = operand_mapping(M, N, K, dataflow)
    folds = math.ceil(sr / rows) * math.ceil(sc / cols)
    return folds * fold_cycles(rows, cols, t, dataflow, os_fold) - 1


# --------------------------------------------------------------------------------------------------
# Functional mode: the integer outputs of the array, fold by fold.


def _check_int_operand(name: str, x: np.ndarray, bits: int) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise CodesignError(f"{name} must be a 2-D numpy array, got {type(x).__name__}")
    if not np.issubdtype(x.dtype, np.integer):
        raise CodesignError(f"{name} must have an integer dtype (int{bits} codes), got {x.dtype}")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if x.size and (int(x.min()) < lo or int(x.max()) > hi):
        raise CodesignError(f"{name} codes must lie in [{lo}, {hi}] (int{bits}), got [{x.min()}, {x.max()}]")
    return x.astype(np.int64)


def _wrap32(x: np.ndarray) -> np.ndarray:
    """Reduce int64 values modulo 2**32 into int32 two's complement, as a 32-bit accumulator does."""
    return x.astype(np.int32)  # numpy's int64 -> int32 cast keeps the low 32 bits


def functional_gemm(
    a: np.ndarray, b: np.ndarray, rows: int, cols: int, dataflow: str, *, a_bits: int = 8, b_bits: int = 8
) -> np.ndarray:
    """int32 outputs of X[M, K] @ W[K, N] computed fold by fold as an R x C array in `dataflow` would.

    a: int8 activation codes [M, K]; b: weight codes [K, N], int8 (b_bits=8) or int4 held in an integer
    array with values in [-8, 7] (b_bits=4). Each fold's partial sums are added into int32 accumulators
    with two's-complement wrap-around (os: one R x C output tile over all of K; ws: a K-block x N-block
    weight tile, streaming all M rows; is: a K-block x M-block input tile, streaming all N columns).
    Without overflow the result equals a.astype(int64) @ b exactly; with overflow, that value mod 2**32.
    """
    _check_array(rows, cols, dataflow)
    if a_bits not in (4, 8) or b_bits not in (4, 8):
        raise CodesignError(f"a_bits and b_bits must be 4 or 8, got {a_bits}, {b_bits}")
    a64 = _check_int_operand("a", a, a_bits)
    b64 = _check_int_operand("b", b, b_bits)
    if a64.shape[1] != b64.shape[0]:
        raise CodesignError(f"a is {a64.shape} and b is {b64.shape}: a's K must equal b's K")
    M, K = a64.shape
    N = b64.shape[1]
    out = np.zeros((M, N), dtype=np.int32)
    with np.errstate(over="ignore"):
        if dataflow == "os":  # each PE owns one output and accumulates all K products in place
            for n0 in range(0, N, cols):
                for m0 in range(0, M, rows):
                    tile = a64[m0 : m0 + rows] @ b64[:, n0 : n0 + cols]
                    out[m0 : m0 + rows, n0 : n0 + cols] = _wrap32(tile)
        elif dataflow == "ws":  # weights of a K-block x N-block stay; partial sums leave per fold
            for n0 in range(0, N, cols):
                for k0 in range(0, K, rows):
                    part = a64[:, k0 : k0 + rows] @ b64[k0 : k0 + rows, n0 : n0 + cols]
                    out[:, n0 : n0 + cols] += _wrap32(part)
        else:  # inputs of a K-block x M-block stay; weights stream, partial sums leave per fold
            for m0 in range(0, M, cols):
                for k0 in range(0, K, rows):
                    part = a64[m0 : m0 + cols, k0 : k0 + rows] @ b64[k0 : k0 + rows]
                    out[m0 : m0 + cols] += _wrap32(part)
    return out


# --------------------------------------------------------------------------------------------------
# Demand geometry: where, inside one fold, each operand's SRAM requests fall (SCALE-Sim's demand matrices).
#
# Two shapes occur. "stream": a block B[t, c] (t < T temporal steps, c < width used) enters column c at
# local row prefix + t + c (skewed). "stationary": a block B[j, c] (j < rows used) is loaded flipped,
# without skew, at local row R - 1 - j. Within a demand row, requests are issued in column order.


@dataclass(frozen=True)
class _Geometry:
    dataflow: str
    R: int
    C: int
    Sr: int
    Sc: int
    T: int
    row_folds: int
    col_folds: int
    L: int  # fold length in demand rows (SCALE-Sim's code)

    @property
    def folds(self) -> int:
        return self.row_folds * self.col_folds

    def used(self, fr: int, fc: int) -> tuple[int, int]:
        """(rows used along Sr, cols used along Sc) of fold (fr, fc)."""
        return min(self.R, self.Sr - fr * self.R), min(self.C, self.Sc - fc * self.C)


def _geometry(sr: int, sc: int, t: int, rows: int, cols: int, dataflow: str) -> _Geometry:
    L = rows + cols + t - 2 if dataflow == "os" else 2 * rows + cols + t - 2
    return _Geometry(dataflow, rows, cols, sr, sc, t, math.ceil(sr / rows), math.ceil(sc / cols), L)


def _operand_block(g: _Geometry, which: str, fr: int, fc: int, ifmap: np.ndarray, filt: np.ndarray):
    """(kind, prefix, block) of operand `which` ("ifmap" or "filter") in fold (fr, fc).

    ifmap is SCALE-Sim's ifmap operand matrix [ofmap pixels, window]; filt is [window, filters].
    """
    R, C = g.R, g.C
    r0, c0 = fr * R, fc * C
    if g.dataflow == "os":
        if which == "ifmap":  # B[t, r] = ifmap[r0 + r, t]
            return "stream", 0, ifmap[r0 : r0 + R, :].T
        return "stream", 0, filt[:, c0 : c0 + C]
    if g.dataflow == "ws":
        if which == "ifmap":  # B[t, r] = ifmap[t, r0 + r]
            return "stream", R, ifmap[:, r0 : r0 + R]
        return "stationary", 0, filt[r0 : r0 + R, c0 : c0 + C]
    if which == "ifmap":  # stationary B[j, c] = ifmap[c0 + c, r0 + j]
        return "stationary", 0, ifmap[c0 : c0 + C, r0 : r0 + R].T
    return "stream", R, filt[r0 : r0 + R, :].T  # B[t, r] = filt[r0 + r, t]


def _issue_order(kind: str, prefix: int, h: int, w: int, R: int) -> tuple[np.ndarray, np.ndarray]:
    """(local rows, flat block indices) of an h x w block's requests in issue order: row, then column."""
    jj, cc = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    local = (prefix + jj + cc if kind == "stream" else (R - 1 - jj)).ravel()
    order = np.lexsort((cc.ravel(), local))
    return local[order], order


def _block_requests(
    kind: str, prefix: int, block: np.ndarray, R: int, cache: dict | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(local rows, addresses) of the valid requests of one fold, in SCALE-Sim's issue order."""
    key = (kind, prefix, *block.shape)
    if cache is not None and key in cache:
        local, order = cache[key]
    else:
        local, order = _issue_order(kind, prefix, *block.shape, R)
        if cache is not None:
            cache[key] = (local, order)
    addr = block.ravel()[order]
    valid = addr != -1
    return local[valid], addr[valid]


def _used_grid(g: _Geometry) -> tuple[np.ndarray, np.ndarray]:
    """Rows used (along Sr) and columns used (along Sc) of every fold, as [col_folds, row_folds] arrays."""
    ru = np.minimum(g.R, g.Sr - g.R * np.arange(g.row_folds, dtype=np.int64))
    cu = np.minimum(g.C, g.Sc - g.C * np.arange(g.col_folds, dtype=np.int64))
    return np.broadcast_to(ru, (g.col_folds, g.row_folds)), np.broadcast_to(
        cu[:, None], (g.col_folds, g.row_folds)
    )


def _fold_order(g: _Geometry):
    for fc in range(g.col_folds):
        for fr in range(g.row_folds):
            yield fr, fc


def _operand_stream(g: _Geometry, which: str, ifmap: np.ndarray, filt: np.ndarray):
    """Global demand rows and addresses of every valid request of one operand, in issue order."""
    rows, addrs, cache = [], [], {}  # fold blocks come in few shapes: reuse their issue order
    for f, (fr, fc) in enumerate(_fold_order(g)):
        kind, prefix, block = _operand_block(g, which, fr, fc, ifmap, filt)
        local, addr = _block_requests(kind, prefix, block, g.R, cache)
        rows.append(local + f * g.L)
        addrs.append(addr)
    return np.concatenate(rows), np.concatenate(addrs)


def _first_last_rows(g: _Geometry, which: str, ifmap: np.ndarray, filt: np.ndarray) -> tuple[int, int]:
    """Global demand rows of the first and last valid request of an operand."""
    if isinstance(ifmap, _AffineMatrix):  # GEMM: no padding requests, so the block shape decides
        folds = list(_fold_order(g))
        _, kind, prefix, h, w = _gemm_block(g, which, *folds[0])
        first = prefix if kind == "stream" else g.R - h
        _, kind, prefix, h, w = _gemm_block(g, which, *folds[-1])
        last = prefix + (h - 1) + (w - 1) if kind == "stream" else g.R - 1
        return first, (len(folds) - 1) * g.L + last
    first = last = None
    for f, (fr, fc) in enumerate(_fold_order(g)):
        local, _ = _block_requests(*_operand_block(g, which, fr, fc, ifmap, filt), g.R)
        if local.size:
            first = int(local[0]) + f * g.L
            break
    for f, (fr, fc) in reversed(list(enumerate(_fold_order(g)))):
        local, _ = _block_requests(*_operand_block(g, which, fr, fc, ifmap, filt), g.R)
        if local.size:
            last = int(local[-1]) + f * g.L
            break
    if first is None:
        raise CodesignError(f"the {which} operand has no valid element")
    return first, last


def _ofmap_fold_counts(g: _Geometry, ru: int, cu: int) -> np.ndarray:
    """Valid ofmap writes in each local demand row of a fold using ru x cu of the array."""
    counts = np.zeros(g.L, dtype=np.int64)
    if g.dataflow == "os":  # flipped R rows (valid i >= R - ru), skewed by column, after T - 1 rows
        conv = np.convolve(np.ones(ru, dtype=np.int64), np.ones(cu, dtype=np.int64))
        start = g.T - 1 + (g.R - ru)
    else:  # T output rows streamed after 2R - 1 rows, skewed by column
        conv = np.convolve(np.ones(g.T, dtype=np.int64), np.ones(cu, dtype=np.int64))
        start = 2 * g.R - 1
    counts[start : start + conv.size] = conv
    return counts


class _OfmapRows:
    """Per-demand-row ofmap write counts over all folds, kept as per-fold-type patterns (no big arrays)."""

    def __init__(self, g: _Geometry):
        self.g = g
        ru, cu = _used_grid(g)  # [col_folds, row_folds], fold order = ravel order
        if g.dataflow != "os":
            ru = np.full_like(ru, g.R)  # ws/is write every column's outputs each fold; ru does not matter
        keys, kind = np.unique(np.stack([ru.ravel(), cu.ravel()], 1), axis=0, return_inverse=True)
        self.patterns = [np.cumsum(_ofmap_fold_counts(g, int(a), int(b))) for a, b in keys]
        self.kind = kind.ravel()
        totals = np.array([p[-1] for p in self.patterns], dtype=np.int64)[self.kind]
        self.prefix = np.concatenate(([0], np.cumsum(totals)))
        self.total = int(self.prefix[-1])
        self.nrows = g.folds * g.L

    def through(self, r: int) -> int:
        """Writes in demand rows 0..r inclusive (r may be -1)."""
        if r < 0:
            return 0
        if r >= self.nrows:
            return self.total
        f, loc = divmod(r, self.g.L)
        return int(self.prefix[f] + self.patterns[self.kind[f]][loc])

    def first_row_reaching(self, x: int) -> int:
        """Smallest demand row r with through(r) >= x (x >= 1), or nrows if none."""
        if x > self.total:
            return self.nrows
        f = int(np.searchsorted(self.prefix, x, side="left")) - 1
        loc = int(np.searchsorted(self.patterns[self.kind[f]], x - self.prefix[f], side="left"))
        return f * self.g.L + loc

    def first_valid_row(self) -> int:
        return self.first_row_reaching(1)

    def last_valid_row(self) -> int:
        return self.first_row_reaching(self.total)


class _AffineMatrix:
    """Address matrix addr[i, j] = base + i * si + j * sj, materialised only block by block.

    GEMM operand matrices are affine in SCALE-Sim (ifmap[m, k] = m*K + k, filter[k, n] = n*K + k), so big
    GEMMs never allocate their full operand matrices.
    """

    def __init__(self, h: int, w: int, si: int, sj: int, base: int):
        self.shape = (h, w)
        self.si, self.sj, self.base = si, sj, base

    @property
    def T(self) -> _AffineMatrix:  # noqa: N802 (mirrors ndarray.T)
        return _AffineMatrix(self.shape[1], self.shape[0], self.sj, self.si, self.base)

    def __getitem__(self, key: tuple[slice, slice]) -> np.ndarray:
        ri = range(*key[0].indices(self.shape[0]))
        rj = range(*key[1].indices(self.shape[1]))
        i = np.arange(ri.start, ri.stop, ri.step, dtype=np.int64)
        j = np.arange(rj.start, rj.stop, rj.step, dtype=np.int64)
        return np.add.outer(i * self.si, j * self.sj) + self.base


@dataclass(frozen=True, eq=False)  # holds numpy arrays: compare reports, not layers
class Layer:
    """One SCALE-Sim layer as operand matrices: ofmap pixels (per filter) x window, window x filters.

    A GEMM (M, N, K) is Layer.gemm(M, N, K); a convolution is `Layer.conv(...)`, whose ifmap matrix holds
    SCALE-Sim's im2col addresses (-1 where a window runs past the input edge).
    """

    name: str
    px: int  # ofmap pixels per filter (GEMM: M)
    filters: int  # GEMM: N
    window: int  # GEMM: K
    ifmap: object = field(repr=False)  # ndarray or _AffineMatrix, [px, window]
    filt: object = field(repr=False)  # [window, filters]
    ifmap_unique: int = 0  # distinct valid ifmap addresses
    filter_unique: int = 0

    @classmethod
    def gemm(
        cls, M: int, N: int, K: int, name: str = "gemm", offsets: tuple[int, int] = (0, 10000000)
    ) -> Layer:
        """SCALE-Sim's GEMM operands: ifmap[m, k] = m*K + k + off_i, filter[k, n] = n*K + k + off_f."""
        for n_, v in (("M", M), ("N", N), ("K", K)):
            check_positive_int(n_, v)
        ifmap = _AffineMatrix(M, K, K, 1, offsets[0])
        filt = _AffineMatrix(K, N, 1, K, offsets[1])
        return cls(name, M, N, K, ifmap, filt, M * K, K * N)

    @classmethod
    def conv(
        cls, name: str, ifmap_h: int, ifmap_w: int, filt_h: int, filt_w: int, channels: int, filters: int,
        stride_h: int, stride_w: int, offsets: tuple[int, int] = (0, 10000000),
    ) -> Layer:  # fmt: skip
        """SCALE-Sim's convolution operands (scalesim/compute/operand_matrix.py), built with numpy."""
        vals = dict(ifmap_h=ifmap_h, ifmap_w=ifmap_w, filt_h=filt_h, filt_w=filt_w, channels=channels,
                    filters=filters, stride_h=stride_h, stride_w=stride_w)  # fmt: skip
        for n_, v in vals.items():
            check_positive_int(n_, v)
        if filt_h > ifmap_h or filt_w > ifmap_w:
            raise CodesignError(
                f"layer {name}: filter {filt_h}x{filt_w} larger than ifmap {ifmap_h}x{ifmap_w}"
            )
        oh = math.ceil((ifmap_h - filt_h + stride_h) / stride_h)
        ow = math.ceil((ifmap_w - filt_w + stride_w) / stride_w)
        px, window = oh * ow, filt_h * filt_w * channels
        orow, ocol = np.divmod(np.arange(px, dtype=np.int64), ow)
        irow, icol = orow * stride_h, ocol * stride_w
        crow, rest = np.divmod(np.arange(window, dtype=np.int64), filt_w * channels)
        ccol, cch = np.divmod(rest, channels)
        rr = irow[:, None] + crow[None, :]
        cc = icol[:, None] + ccol[None, :]
        addr = (rr * ifmap_w + cc) * channels + cch[None, :] + offsets[0]
        ifmap = np.where((rr < ifmap_h) & (cc < ifmap_w), addr, -1)
        filt = _AffineMatrix(window, filters, 1, window, offsets[1])
        valid = ifmap[ifmap != -1]
        return cls(name, px, filters, window, ifmap, filt, int(np.unique(valid).size), window * filters)


# SCALE-Sim constants (scalesim/single_layer_sim.py, memory/read_buffer_estimate_bw.py).
_ACTIVE_FRAC = 0.5  # half of each SRAM serves the array, half is filled / drained
_CALC_READ_BW = 10  # words/cycle assumed for the first prefetch in CALC mode ("arbitrary", says SCALE-Sim)
_SETS = 100  # the estimate read buffer tracks its capacity in 100 sets


@dataclass(frozen=True)
class MemoryConfig:
    """SCALE-Sim's double-buffered scratchpads: sizes in KiB, word size in bytes, DRAM bandwidths.

    bandwidth None is SCALE-Sim's CALC mode (InterfaceBandwidth: CALC): reads never stall and the report
    gives the bandwidth needed for no stalls. An int is USER mode: the ofmap drains at `bandwidth`
    words/cycle and the ifmap / filter SRAMs fill at `read_bandwidth` (SCALE-Sim takes those two from the
    cfg's IfmapSRAMBankBandwidth / FilterSRAMBankBandwidth; default: `bandwidth`).
    """

    ifmap_kb: int = 64
    filter_kb: int = 64
    ofmap_kb: int = 64
    word_bytes: tuple[float, float, float] = (1, 1, 1)  # ifmap, filter, ofmap; SCALE-Sim uses 1 byte
    bandwidth: int | None = None
    read_bandwidth: tuple[int, int] | None = (
        None  # USER mode ifmap, filter fill words/cycle (default: bandwidth)
    )

    def __post_init__(self) -> None:
        for n_ in ("ifmap_kb", "filter_kb", "ofmap_kb"):
            check_positive_int(n_, getattr(self, n_))
        wb = self.word_bytes
        if not (
            isinstance(wb, tuple) and len(wb) == 3 and all(isinstance(w, int | float) and w > 0 for w in wb)
        ):
            raise CodesignError(
                f"word_bytes must be three positive numbers (ifmap, filter, ofmap), got {wb!r}"
            )
        if self.bandwidth is not None:
            check_positive_int("bandwidth", self.bandwidth)
        if self.read_bandwidth is not None:
            if self.bandwidth is None:
                raise CodesignError("read_bandwidth needs bandwidth (USER mode); CALC mode has neither")
            if not (isinstance(self.read_bandwidth, tuple) and len(self.read_bandwidth) == 2):
                raise CodesignError(
                    f"read_bandwidth must be (ifmap, filter) words/cycle, got {self.read_bandwidth!r}"
                )
            for n_, v in zip(("read_bandwidth[0]", "read_bandwidth[1]"), self.read_bandwidth):
                check_positive_int(n_, v)

    def words(self, which: str) -> int:
        """Capacity of the `which` ("ifmap", "filter", "ofmap") SRAM in words: floor(KB * 1024 / word)."""
        kb = getattr(self, f"{which}_kb")
        words = math.floor(kb * 1024 / self.word_bytes[("ifmap", "filter", "ofmap").index(which)])
        if words < _SETS:  # SCALE-Sim's read buffer splits its capacity into 100 sets
            raise CodesignError(
                f"{which}_kb: an SRAM of {kb} KB holds {words} words; at least {_SETS} are needed"
            )
        return words


@dataclass
class _WriteBufferResult:
    total_cycles: int
    stall_cycles: int
    dram_writes: int
    dram_start: float
    dram_stop: float
    stall_rows: list[tuple[int, int]]  # (row, stall cycles accumulated after that row), increasing
    row_offsets: dict[int, int]  # in-row stall of event rows (shifts that row's ofmap write cycle)

    def stalls_before(self, row: int) -> int:
        i = bisect.bisect_left(self.stall_rows, (row, -1))
        return self.stall_rows[i - 1][1] if i else 0

    def out_cycle(self, row: int) -> int:
        return row + self.stalls_before(row) + self.row_offsets.get(row, 0)


def _simulate_write_buffer(
    rows: _OfmapRows, size_words: int, drain_bw: int, read_rows: list[int] = (), read_stall=None
) -> _WriteBufferResult:
    """SCALE-Sim's ofmap write buffer (memory/write_buffer.py), jumping from drain event to drain event.

    Writes fill lines of `drain_bw` words; when more than half the SRAM is occupied (and no drain is in
    flight) the partial line is closed and ceil(half / drain_bw) lines drain to DRAM, one line per cycle.
    A write that finds the SRAM full waits for the drain in flight (a stall). Faithful to SCALE-Sim's
    bookkeeping quirk: a drained chunk counts every slot of its lines but the padding of its last line.
    `read_rows` (sorted) are demand rows where a read buffer fetches; read_stall(row, cycle) gives their
    read stall. A row stalls the array by max(read stall, write stall), as in SCALE-Sim's memory loop.
    """
    total = size_words
    active = int(math.ceil(total * _ACTIVE_FRAC))
    lines_per_drain = int(math.ceil((total - active) / drain_bw))
    free, drain_end, g = total, 0, 0
    nlines, line_idx, drain_start_line = 0, 0, 0
    partial: dict[int, int] = {}
    accesses = 0
    first_drain: float | None = None
    last_drain = -math.inf
    stall, stall_rows, offsets = 0, [], {}

    def close_line() -> None:
        nonlocal nlines, line_idx
        if line_idx:
            partial[nlines] = line_idx
            nlines += 1
            line_idx = 0

    def drain(start: int) -> int:
        nonlocal accesses, free, drain_start_line, first_drain, last_drain
        n = min(drain_start_line + lines_per_drain, nlines) - drain_start_line
        if n <= 0:
            raise CodesignError("ofmap drain with nothing to drain (SCALE-Sim fails here too)")
        last = drain_start_line + n - 1
        data = (n - 1) * drain_bw + partial.get(last, drain_bw)
        accesses += data
        free += data
        drain_start_line += n
        first_drain = start if first_drain is None else min(first_drain, start)
        last_drain = max(last_drain, start + n - 1)
        return start + n - 1

    def store(k: int) -> None:
        nonlocal nlines, line_idx, free, g
        nlines += (line_idx + k) // drain_bw
        line_idx = (line_idx + k) % drain_bw
        free -= k
        g += k

    r, ri, inf = 0, 0, math.inf
    while True:
        next_read = read_rows[ri] if ri < len(read_rows) else inf
        er = inf
        if g < rows.total:
            e_drain_free = g + max(1, free - active + 1)  # first write leaving less than `active` free
            r_due = max(r, drain_end - stall)  # first row issued at or after the drain in flight ends
            e_due = rows.through(r_due - 1) + 1
            e_full = g + max(1, free)  # first write that fills the SRAM
            event = e_full if e_full < e_due else max(e_drain_free, e_due)
            if event <= rows.total:
                er = rows.first_row_reaching(event)
        row = min(er, next_read)
        if row == inf:
            break
        store(rows.through(row - 1) - g)
        n = rows.through(row) - g
        cycle = row + stall
        current = cycle
        for _ in range(n):
            store(1)
            if current < drain_end:
                if free <= 0:
                    current = drain_end
            elif free < active:
                close_line()
                drain_end = drain(current)
        row_stall = current - cycle
        if current != cycle:
            offsets[row] = current - cycle
        if row == next_read:
            row_stall = max(row_stall, read_stall(row, cycle))
            ri += 1
        if row_stall > 0:
            stall += row_stall
            stall_rows.append((row, stall))
        r = row + 1
    store(rows.total - g)
    cycle = rows.nrows - 1 + stall
    close_line()
    while drain_start_line < nlines:
        drain_end = drain(cycle)
        cycle = drain_end + 1
    return _WriteBufferResult(
        rows.nrows - 1 + stall, stall, accesses, float(first_drain), float(last_drain), stall_rows, offsets
    )


@dataclass
class _ReadBufferResult:
    dram_reads: int
    dram_start: float
    dram_stop: float


def _insertions(rows: np.ndarray, addrs: np.ndarray, first_epoch: int, epoch: int) -> tuple[int, list[int]]:
    """Words fetched by SCALE-Sim's estimate read buffer and the demand rows where its window moved.

    Within a window (first `first_epoch`, then `epoch` newly fetched words) a request hits if its address
    was fetched since the window opened; the window closes at the fetch that fills it.
    """
    fetched, boundaries, p, limit, n = 0, [], 0, first_epoch, addrs.size
    while p < n:
        width = min(n - p, 4 * limit)
        while True:
            _, first = np.unique(addrs[p : p + width], return_index=True)
            if first.size >= limit or p + width >= n:
                break
            width = min(n - p, 2 * width)
        if first.size >= limit:
            first.sort()
            e = int(first[limit - 1])
            fetched += limit
            boundaries.append(int(rows[p + e]))
            p += e + 1
            limit = epoch
        else:
            fetched += first.size
            break
    return fetched, boundaries


def _gemm_block(g: _Geometry, which: str, fr: int, fc: int) -> tuple[object, str, int, int, int]:
    """(block id, kind, prefix, h, w) of a GEMM operand in fold (fr, fc); equal ids mean equal address sets.

    GEMM addresses are distinct within a fold and blocks with different ids are disjoint.
    """
    ru, cu = g.used(fr, fc)
    df = g.dataflow
    if df == "os":
        return (fr, "stream", 0, g.T, ru) if which == "ifmap" else (fc, "stream", 0, g.T, cu)
    if df == "ws":
        return (fr, "stream", g.R, g.T, ru) if which == "ifmap" else ((fr, fc), "stationary", 0, ru, cu)
    return ((fr, fc), "stationary", 0, ru, cu) if which == "ifmap" else (fr, "stream", g.R, g.T, ru)


def _position_row(kind: str, prefix: int, h: int, w: int, R: int, q: int, cache: dict) -> int:
    """Local demand row of the q-th request (0-based, issue order) of a fold's operand block."""
    if kind == "stationary":  # row R - 1 - j holds block row j: the last block row is issued first
        return R - h + q // w
    key = (h, w)
    if key not in cache:
        cache[key] = np.cumsum(np.convolve(np.ones(h, dtype=np.int64), np.ones(w, dtype=np.int64)))
    return prefix + int(np.searchsorted(cache[key], q + 1, side="left"))


def _insertions_gemm(g: _Geometry, which: str, first_epoch: int, epoch: int) -> tuple[int, list[int]]:
    """`_insertions` for GEMM operands in O(folds): no request stream is built.

    Within a window every block's fetched part is a suffix of its issue order, so what it still misses is
    a prefix of length m_b: a fold of block b fetches its first m_b requests, the k-th at position k - 1.
    """
    cache: dict = {}
    if (g.dataflow, which) in (("ws", "filter"), ("is", "ifmap")):  # stationary blocks: none recurs
        sizes = np.cumsum(np.multiply(*_used_grid(g)).ravel())
        boundaries, x = [], first_epoch  # the window fills at fetches E, E + E', E + 2E', ...
        while x <= sizes[-1]:
            f = int(np.searchsorted(sizes, x, side="left"))
            pos = x - (int(sizes[f - 1]) if f else 0) - 1
            _, kind, prefix, h, w = _gemm_block(g, which, f % g.row_folds, f // g.row_folds)
            boundaries.append(f * g.L + _position_row(kind, prefix, h, w, g.R, pos, cache))
            x += epoch
        return int(sizes[-1]), boundaries
    missing: dict[object, int] = {}  # blocks touched in the current window -> missing prefix length
    fetched, count, limit, boundaries = 0, 0, first_epoch, []
    for f, (fr, fc) in enumerate(_fold_order(g)):
        bid, kind, prefix, h, w = _gemm_block(g, which, fr, fc)
        n = h * w
        lo, hi = 0, missing.get(bid, n)  # positions [lo, hi) of this fold are new to the window
        after = 0  # missing prefix of this block once the fold is done
        while hi > lo and count + (hi - lo) >= limit:  # the window fills inside this fold
            pos = lo + (limit - count) - 1
            fetched += limit
            boundaries.append(f * g.L + _position_row(kind, prefix, h, w, g.R, pos, cache))
            missing, count, limit = {}, 0, epoch
            lo, hi, after = pos + 1, n, pos + 1  # the rest of the fold is new to the fresh window
        count += hi - lo
        missing[bid] = after
    return fetched + count, boundaries


def _estimate_read_buffer(
    g: _Geometry, which: str, layer: Layer, size_words: int, first_cycle: int, row_cycle
) -> _ReadBufferResult:
    """SCALE-Sim's CALC-mode read buffer (memory/read_buffer_estimate_bw.py) in closed form.

    Words per set s = floor(size / 100); the window is 50 sets (E = 50 s words). If the operand has fewer
    than E distinct addresses every word is fetched once, before cycle 0: DRAM reads = distinct words,
    from cycle -ceil(ceil(U / s) * s / 10) to -1. Otherwise the request stream is replayed window by window
    (numpy, per window) and each window's prefetch is spread over the cycles since the previous one.
    """
    ips = size_words // _SETS
    n_active = int(_ACTIVE_FRAC * _SETS)
    n_prefetch = _SETS - n_active
    unique = layer.ifmap_unique if which == "ifmap" else layer.filter_unique
    if unique < n_active * ips:
        fetched, boundaries = unique, []
    elif isinstance(layer.ifmap, _AffineMatrix):  # a GEMM: per-fold bookkeeping, no request stream
        fetched, boundaries = _insertions_gemm(g, which, n_active * ips, n_prefetch * ips)
    else:
        srows, saddrs = _operand_stream(g, which, layer.ifmap, layer.filt)
        fetched, boundaries = _insertions(srows, saddrs, n_active * ips, n_prefetch * ips)
    if not boundaries:  # every set prefetched at once, ending the cycle before the array starts
        cycles = math.ceil(math.ceil(fetched / ips) * ips / _CALC_READ_BW)
        return _ReadBufferResult(fetched, float(-cycles), -1.0)
    cycles = math.ceil(n_active * ips / _CALC_READ_BW)
    start = first_cycle - cycles
    last_start, last_end = first_cycle - 1, row_cycle(boundaries[0])
    for b in boundaries[1:]:
        if last_end - last_start + 1 <= 0:
            raise CodesignError("two read-buffer windows closed in one cycle (SCALE-Sim divides by zero)")
        last_start, last_end = last_end + 1, row_cycle(b)
    if last_end - last_start + 1 <= 0:
        raise CodesignError("read-buffer window closed in the cycle it opened (SCALE-Sim divides by zero)")
    return _ReadBufferResult(fetched, float(start), float(last_end + 1))


def _pad_cols(block: np.ndarray, width: int) -> np.ndarray:
    if block.shape[1] == width:
        return block
    return np.concatenate(
        (block, np.full((block.shape[0], width - block.shape[1]), -1, dtype=block.dtype)), 1
    )


def _fetch_order(g: _Geometry, which: str, ifmap, filt) -> np.ndarray:
    """SCALE-Sim's prefetch matrix of an operand, flattened in DRAM fetch order (-1 for padding).

    Per-fold operand blocks padded to the array width are stacked, then read by anti-diagonals (last row
    first within a diagonal), except the ws filter and is ifmap, which are read row by row.
    """
    R, C = g.R, g.C
    key = (g.dataflow, which)
    if key == ("os", "ifmap"):
        mats, diag = [_pad_cols(ifmap[fr * R : fr * R + R, :].T, R) for fr in range(g.row_folds)], True
    elif key == ("os", "filter"):
        mats, diag = [_pad_cols(filt[:, fc * C : fc * C + C], C) for fc in range(g.col_folds)], True
    elif key == ("ws", "ifmap"):
        mats, diag = [_pad_cols(ifmap[:, fr * R : fr * R + R], R) for fr in range(g.row_folds)], True
    elif key == ("ws", "filter"):
        mats, diag = [_pad_cols(filt[:, fc * C : fc * C + C], C) for fc in range(g.col_folds)], False
    elif key == ("is", "ifmap"):
        mats, diag = [_pad_cols(ifmap[fc * C : fc * C + C, :].T, C) for fc in range(g.col_folds)], False
    else:
        mats, diag = [_pad_cols(filt[fr * R : fr * R + R, :].T, R) for fr in range(g.row_folds)], True
    m = np.concatenate(mats, 0)
    if not diag:
        return m.ravel()
    ii, jj = np.meshgrid(np.arange(m.shape[0]), np.arange(m.shape[1]), indexing="ij")
    return m.ravel()[np.lexsort((-ii.ravel(), (ii + jj).ravel()))]


@dataclass
class _UserReadBuffer:
    events: dict[int, list[int]]  # demand row -> completion cycles of the fetches its misses triggered
    dram_reads: int
    dram_start: float
    dram_stop: float

    def offset(self, row: int, cycle: int) -> int:
        """SCALE-Sim's per-row read offset (hit latency 1 plus stalls), quirks included: a fetch that
        completes late adds its lateness twice; one that completes early pulls the offset back."""
        off = 1
        for done in self.events.get(row, ()):
            lateness = done - (cycle + off)
            off += lateness
            if lateness > 0:
                off += lateness
        return off


def _user_read_buffer(g: _Geometry, which: str, layer: Layer, size_words: int, bw: int) -> _UserReadBuffer:
    """SCALE-Sim's USER-mode read buffer (memory/read_buffer.py): a circular window of address sets.

    The operand's fetch order is cut into sets of ceil(size / 100) words; the first half of the SRAM is
    filled before cycle 0, then every request whose set is outside the active window slides it by the
    prefetch half, fetching ceil(half / bw) lines of bw words that complete one line per cycle after the
    previous fetch (+1 cycle latency). Which requests miss does not depend on timing, so it is found by
    a numpy scan of the request stream; only the misses are handled one by one.
    """
    total = size_words
    active = int(math.ceil(total * _ACTIVE_FRAC))
    prefetch = total - active
    per_set = math.ceil(total / _SETS)
    # The prefetch matrix stacks each operand entry once, in blocks padded to the array width.
    operand = layer.ifmap if which == "ifmap" else layer.filt
    n_valid = (
        int(np.count_nonzero(operand != -1)) if isinstance(operand, np.ndarray) else math.prod(operand.shape)
    )
    padded = {
        ("os", "ifmap"): g.row_folds * g.T * g.R,
        ("os", "filter"): g.col_folds * g.T * g.C,
        ("ws", "ifmap"): g.row_folds * g.T * g.R,
        ("ws", "filter"): g.col_folds * g.Sr * g.C,
        ("is", "ifmap"): g.col_folds * g.Sr * g.C,
        ("is", "filter"): g.row_folds * g.T * g.R,
    }[(g.dataflow, which)]
    n_sets = n_valid // per_set + 1
    n_active = min(n_sets, math.ceil(active / per_set))
    n_prefetch = min(n_sets - n_active, math.ceil(prefetch / per_set))
    first_lines = min(math.ceil(active / bw), math.ceil(padded / bw))
    if n_active == n_sets:  # the whole operand fits the active half: no request ever misses
        return _UserReadBuffer({}, first_lines * bw, float(-first_lines), -1.0)
    order = _fetch_order(g, which, layer.ifmap, layer.filt)
    valid = order[order != -1]
    assert valid.size == n_valid and order.size == padded
    position_set = np.arange(valid.size, dtype=np.int64) // per_set
    rows_, addrs = _operand_stream(g, which, layer.ifmap, layer.filt)
    if isinstance(operand, _AffineMatrix):  # GEMM: each address once, dense from the base
        set_of = np.empty(valid.size, dtype=np.int64)
        set_of[valid - operand.base] = position_set
        flat, starts, counts = set_of[addrs - operand.base], None, None
    else:  # conv im2col: an address recurs, so it may sit in several sets (a hit in any will do)
        pairs = np.unique(np.stack([valid, position_set]), axis=1)  # sorted by address, then set
        keys, first = np.unique(pairs[0], return_index=True)
        req = np.searchsorted(keys, addrs)
        flat = pairs[1]
        starts, counts = first[req], np.diff(np.append(first, flat.size))[req]

    def misses(lo: int, hi: int, start: int) -> np.ndarray:
        """Indices (from lo) of requests lo..hi-1 whose sets are all outside the window at `start`."""
        if starts is None:
            return np.flatnonzero((flat[lo:hi] - start) % n_sets >= n_active)
        ct = counts[lo:hi]
        heads = np.cumsum(ct) - ct
        idx = np.arange(int(ct.sum())) - np.repeat(heads, ct) + np.repeat(starts[lo:hi], ct)
        return np.flatnonzero(np.minimum.reduceat((flat[idx] - start) % n_sets, heads) >= n_active)

    def hit(j: int, start: int) -> bool:
        if starts is None:
            return (flat[j] - start) % n_sets < n_active
        return bool((((flat[starts[j] : starts[j] + counts[j]]) - start) % n_sets < n_active).any())

    lines = math.ceil(prefetch / bw)
    reads, last, start = first_lines * bw, -1, 0
    events: dict[int, list[int]] = {}
    p, n = 0, addrs.size
    while p < n:
        width = min(n - p, 4096)
        miss = misses(p, p + width, start)
        if miss.size == 0:
            p += width
            continue
        j = p + int(miss[0])
        slides = 0
        while not hit(j, start):
            start = (start + n_prefetch) % n_sets
            last += lines + 1
            reads += lines * bw
            events.setdefault(int(rows_[j]), []).append(last)
            slides += 1
            if slides > n_sets:
                raise CodesignError(
                    "read-buffer window never reaches an address (SCALE-Sim loops forever here)"
                )
        p = j + 1
    return _UserReadBuffer(events, reads, float(-first_lines), float(last))


@dataclass(frozen=True)
class LayerReport:
    """One layer's row of SCALE-Sim's COMPUTE_REPORT, BANDWIDTH_REPORT and DETAILED_ACCESS_REPORT.

    Cycle fields are floats where SCALE-Sim prints floats, so `str()` of each field reproduces its CSV.
    """

    overall_cycles: int  # "Total Cycles (incl. prefetch)": last ofmap DRAM write - first operand DRAM read
    total_cycles: int  # compute cycles including stalls
    stall_cycles: int
    overall_util: float  # %
    mapping_efficiency: float  # %
    compute_util: float  # %
    ifmap_sram_start: float
    ifmap_sram_stop: float
    ifmap_sram_reads: int
    filter_sram_start: float
    filter_sram_stop: float
    filter_sram_reads: int
    ofmap_sram_start: float
    ofmap_sram_stop: float
    ofmap_sram_writes: int
    ifmap_dram_start: float
    ifmap_dram_stop: float
    ifmap_dram_reads: int
    filter_dram_start: float
    filter_dram_stop: float
    filter_dram_reads: int
    ofmap_dram_start: float
    ofmap_dram_stop: float
    ofmap_dram_writes: int

    def compute_items(self) -> list:
        return [self.overall_cycles, self.total_cycles, self.stall_cycles, self.overall_util,
                self.mapping_efficiency, self.compute_util]  # fmt: skip

    def bandwidth_items(self) -> list:
        """Average words/cycle: SRAM over the compute cycles, DRAM over each stream's own active span."""
        t = self.total_cycles
        return [
            self.ifmap_sram_reads / t,
            self.filter_sram_reads / t,
            self.ofmap_sram_writes / t,
            self.ifmap_dram_reads / (self.ifmap_dram_stop - self.ifmap_dram_start + 1),
            self.filter_dram_reads / (self.filter_dram_stop - self.filter_dram_start + 1),
            self.ofmap_dram_writes / (self.ofmap_dram_stop - self.ofmap_dram_start + 1),
        ]

    def detail_items(self) -> list:
        return [
            self.ifmap_sram_start, self.ifmap_sram_stop, self.ifmap_sram_reads,
            self.filter_sram_start, self.filter_sram_stop, self.filter_sram_reads,
            self.ofmap_sram_start, self.ofmap_sram_stop, self.ofmap_sram_writes,
            self.ifmap_dram_start, self.ifmap_dram_stop, self.ifmap_dram_reads,
            self.filter_dram_start, self.filter_dram_stop, self.filter_dram_reads,
            self.ofmap_dram_start, self.ofmap_dram_stop, self.ofmap_dram_writes,
        ]  # fmt: skip


def _sram_counts(g: _Geometry, px: int, window: int, filters: int) -> tuple[int, int, int]:
    """SRAM (ifmap reads, filter reads, ofmap writes) as SCALE-Sim counts its demand requests.

    Counts include padding requests of conv ifmaps (-1 entries are counted by the shape products), and
    the output-stationary ofmap count adds R + C per fold, as SCALE-Sim's code does.
    """
    mk, kn, mn = px * window, window * filters, px * filters
    if g.dataflow == "os":
        return g.col_folds * mk, g.row_folds * kn, mn + g.folds * (g.R + g.C)
    if g.dataflow == "ws":
        return g.col_folds * mk, kn, g.row_folds * mn
    return mk, g.col_folds * kn, g.row_folds * mn


def _fold_averages(g: _Geometry) -> tuple[float, float]:
    """(mapping efficiency, compute utilisation) averaged over folds in SCALE-Sim's order and float ops."""
    cyc = g.T + g.R + g.C - 2 if g.dataflow == "os" else 2 * g.R + 2 * g.C + g.T - 3
    pes = g.R * g.C
    ru, cu = _used_grid(g)
    mac_used = (ru * cu).ravel()
    # Per-fold values in float64 equal SCALE-Sim's Python floats (all integers are far below 2**53);
    # Python's sum() over them then adds in SCALE-Sim's order, so the averages agree to the last bit.
    maps = (mac_used / pes).tolist()  # ws: (pes - padding) / pes, the same value
    utils = ((mac_used * g.T) / (g.R * g.C * cyc)).tolist()
    return sum(maps) / len(maps), sum(utils) / len(utils)


def simulate_layer(layer: Layer, rows: int, cols: int, dataflow: str, memory: MemoryConfig) -> LayerReport:
    """SCALE-Sim 3.0.0's report for one layer, computed from per-fold closed forms and memory events.

    CALC mode (memory.bandwidth None): every field of COMPUTE_REPORT, BANDWIDTH_REPORT and
    DETAILED_ACCESS_REPORT. USER mode (a DRAM bandwidth): the same fields with SCALE-Sim's stalls.
    Both for GEMM and conv layers.
    """
    _check_array(rows, cols, dataflow)
    sr, sc, t = operand_mapping(layer.px, layer.filters, layer.window, dataflow)
    g = _geometry(sr, sc, t, rows, cols, dataflow)
    orows = _OfmapRows(g)
    ends = {w: _first_last_rows(g, w, layer.ifmap, layer.filt) for w in ("ifmap", "filter")}
    if memory.bandwidth is None:
        wb = _simulate_write_buffer(orows, memory.words("ofmap"), cols)

        def row_cycle(r: int) -> int:  # cycle at which demand row r is issued
            return r + wb.stalls_before(r)

        def read_out(w: str, r: int) -> int:  # cycle at which demand row r's reads are served
            return row_cycle(r) + 1

        dram = {
            w: _estimate_read_buffer(g, w, layer, memory.words(w), row_cycle(ends[w][0]), row_cycle)
            for w in ("ifmap", "filter")
        }
    else:
        rbw = memory.read_bandwidth or (memory.bandwidth, memory.bandwidth)
        dram = {
            w: _user_read_buffer(g, w, layer, memory.words(w), b) for w, b in zip(("ifmap", "filter"), rbw)
        }
        read_rows = sorted(set(dram["ifmap"].events) | set(dram["filter"].events))

        def read_stall(r: int, cycle: int) -> int:
            return max(dram[w].offset(r, cycle) - 1 for w in ("ifmap", "filter"))

        wb = _simulate_write_buffer(orows, memory.words("ofmap"), memory.bandwidth, read_rows, read_stall)

        def read_out(w: str, r: int) -> int:
            cycle = r + wb.stalls_before(r)
            return cycle + dram[w].offset(r, cycle)

    ifr, ffr, ofw = _sram_counts(g, layer.px, layer.window, layer.filters)
    mapping, util = _fold_averages(g)
    total = wb.total_cycles
    overall = int(wb.dram_stop - min(dram["ifmap"].dram_start, dram["filter"].dram_start))
    num_compute = layer.px * layer.filters * layer.window
    return LayerReport(
        overall_cycles=overall,
        total_cycles=total,
        stall_cycles=wb.stall_cycles,
        overall_util=(num_compute * 100) / (total * rows * cols),
        mapping_efficiency=mapping * 100,
        compute_util=util * 100,
        ifmap_sram_start=float(read_out("ifmap", ends["ifmap"][0])),
        ifmap_sram_stop=float(read_out("ifmap", ends["ifmap"][1])),
        ifmap_sram_reads=ifr,
        filter_sram_start=float(read_out("filter", ends["filter"][0])),
        filter_sram_stop=float(read_out("filter", ends["filter"][1])),
        filter_sram_reads=ffr,
        ofmap_sram_start=float(wb.out_cycle(orows.first_valid_row())),
        ofmap_sram_stop=float(wb.out_cycle(orows.last_valid_row())),
        ofmap_sram_writes=ofw,
        ifmap_dram_start=dram["ifmap"].dram_start,
        ifmap_dram_stop=dram["ifmap"].dram_stop,
        ifmap_dram_reads=dram["ifmap"].dram_reads,
        filter_dram_start=dram["filter"].dram_start,
        filter_dram_stop=dram["filter"].dram_stop,
        filter_dram_reads=dram["filter"].dram_reads,
        ofmap_dram_start=wb.dram_start,
        ofmap_dram_stop=wb.dram_stop,
        ofmap_dram_writes=wb.dram_writes,
    )


# --------------------------------------------------------------------------------------------------
# Operator-spec integration.


@dataclass(frozen=True)
class SystolicArray:
    """An R x C MAC array with SCALE-Sim's three double-buffered SRAMs (KiB) and a DRAM link.

    dram_bandwidth None means SCALE-Sim's CALC mode: no stalls, and the cost reports the DRAM bandwidth
    needed for that. An int (words/cycle) is SCALE-Sim's USER mode with that bandwidth for the ofmap drain
    and for the ifmap / filter fills, giving stall cycles. word_bytes None takes each operand's element
    width from the operator spec.
    """

    rows: int = 32
    cols: int = 32
    dataflow: str = "os"
    ifmap_sram_kb: int = 64
    filter_sram_kb: int = 64
    ofmap_sram_kb: int = 64
    dram_bandwidth: int | None = None
    word_bytes: float | None = None
    os_fold: str = "code"

    def __post_init__(self) -> None:
        _check_array(self.rows, self.cols, self.dataflow)
        check_choice("os_fold", self.os_fold, OS_FOLDS)
        for n_ in ("ifmap_sram_kb", "filter_sram_kb", "ofmap_sram_kb"):
            check_positive_int(n_, getattr(self, n_))
        if self.dram_bandwidth is not None:
            check_positive_int("dram_bandwidth", self.dram_bandwidth)
        if self.word_bytes is not None and not (
            isinstance(self.word_bytes, int | float) and self.word_bytes > 0
        ):
            raise CodesignError(f"word_bytes must be a positive number or None, got {self.word_bytes!r}")


@dataclass(frozen=True)
class GemmCost:
    """Cost of one Gemm spec on a SystolicArray (all batches; counts in words unless named bytes)."""

    cycles: int  # compute + stall cycles
    compute_cycles: int  # stall-free
    stall_cycles: int
    utilization: float  # MACs / (cycles * R * C), in [0, 1]
    mapping_efficiency: float  # average fraction of PEs mapped per fold, in [0, 1]
    ifmap_sram_reads: int
    filter_sram_reads: int
    ofmap_sram_writes: int
    ifmap_dram_reads: int
    filter_dram_reads: int
    ofmap_dram_writes: int
    dram_bytes: float
    required_dram_bandwidth: float  # average DRAM words/cycle of the three streams (CALC mode: for no stalls)
    report: LayerReport | None  # SCALE-Sim's per-layer row for one batch (None when M == 0)


def _element_bytes(spec: Gemm) -> tuple[float, float, float]:
    return (
        dtype_bits(spec.act_dtype) / 8,
        spec.weight.code_bits() / 8,
        dtype_bits(spec.out_dtype) / 8,
    )


def gemm_cost(spec: Gemm, array: SystolicArray) -> GemmCost:
    """Cycles, stalls, utilisation and SRAM/DRAM traffic of `spec` on `array`, SCALE-Sim-exact.

    Y[M, N] = X[M, K] @ W[N, K]^T maps to SCALE-Sim's GEMM (M, N, K); batches run back to back. SRAM
    capacities in words are floor(KB * 1024 / element bytes) per operand (act, weight codes, output).
    With os_fold="paper" an output-stationary array adds R cycles per fold (its output drain).
    """
    if not isinstance(spec, Gemm):
        raise CodesignError(f"spec must be a codesign.specs.Gemm, got {type(spec).__name__}")
    if not isinstance(array, SystolicArray):
        raise CodesignError(f"array must be a SystolicArray, got {type(array).__name__}")
    return _gemm_cost(spec, array)


@functools.lru_cache(maxsize=4096)  # a model step repeats the same GEMMs layer after layer
def _gemm_cost(spec: Gemm, array: SystolicArray) -> GemmCost:
    if spec.M == 0:
        return GemmCost(0, 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, None)
    wb = _element_bytes(spec) if array.word_bytes is None else (array.word_bytes,) * 3
    bw = array.dram_bandwidth
    mem = MemoryConfig(
        array.ifmap_sram_kb,
        array.filter_sram_kb,
        array.ofmap_sram_kb,
        wb,
        bw,
        None if bw is None else (bw, bw),
    )
    rep = simulate_layer(Layer.gemm(spec.M, spec.N, spec.K), array.rows, array.cols, array.dataflow, mem)
    extra = 0
    if array.dataflow == "os" and array.os_fold == "paper":
        rf, cf = num_folds(spec.M, spec.N, spec.K, array.rows, array.cols, "os")
        extra = rf * cf * array.rows
    b = spec.batch
    cycles = rep.total_cycles + extra
    bws = rep.bandwidth_items()
    dram = (rep.ifmap_dram_reads * wb[0] + rep.filter_dram_reads * wb[1] + rep.ofmap_dram_writes * wb[2]) * b
    return GemmCost(
        cycles=b * cycles,
        compute_cycles=b * (cycles - rep.stall_cycles),
        stall_cycles=b * rep.stall_cycles,
        utilization=spec.M * spec.N * spec.K / (cycles * array.rows * array.cols),
        mapping_efficiency=rep.mapping_efficiency / 100,
        ifmap_sram_reads=b * rep.ifmap_sram_reads,
        filter_sram_reads=b * rep.filter_sram_reads,
        ofmap_sram_writes=b * rep.ofmap_sram_writes,
        ifmap_dram_reads=b * rep.ifmap_dram_reads,
        filter_dram_reads=b * rep.filter_dram_reads,
        ofmap_dram_writes=b * rep.ofmap_dram_writes,
        dram_bytes=dram,
        required_dram_bandwidth=bws[3] + bws[4] + bws[5],
        report=rep,
    )
