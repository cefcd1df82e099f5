"""Where SCALE-Sim 3.0.0's demand matrices put each SRAM request and ofmap write, per fold, in closed form.

A GEMM or convolution layer (`Layer`: operand address matrices, GEMM ones affine and never
materialised) is mapped onto an R x C array in folds (`_Geometry`, dataflows as in systolic.py). This
module says where inside a fold each operand request is issued (the "stream" / "stationary" block
shapes below), in which order, and how many ofmap writes each demand row holds (`_OfmapRows`, closed
forms per fold kind). The memory models in memory.py and the report in model.py use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from codesign.specs import CodesignError, check_positive_int

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
        _, kind, prefix, h, w = _gemm_block(g, which, 0, 0)  # the first fold, then the last
        first = prefix if kind == "stream" else g.R - h
        _, kind, prefix, h, w = _gemm_block(g, which, g.row_folds - 1, g.col_folds - 1)
        last = prefix + (h - 1) + (w - 1) if kind == "stream" else g.R - 1
        return first, (g.folds - 1) * g.L + last
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


def _box_pairs(n: int, a: int, b: int) -> int:
    """#{(p, q): 0 <= p < a, 0 <= q < b, p + q < n}, by inclusion-exclusion over the quarter plane."""
    x, y = n - a, n - b  # twice the triangle numbers, inlined: this runs per write-buffer event
    z = x - b
    return (
        (n * (n + 1) if n > 0 else 0)
        - (x * (x + 1) if x > 0 else 0)
        - (y * (y + 1) if y > 0 else 0)
        + (z * (z + 1) if z > 0 else 0)
    ) // 2


def _box_pairs_reaching(x: int, a: int, b: int) -> int:
    """Smallest n with _box_pairs(n, a, b) >= x, for 1 <= x <= a * b (three closed-form pieces)."""
    m, big = min(a, b), max(a, b)
    t = m * (m + 1) // 2
    if x <= t:  # n <= m: n(n + 1) / 2 >= x; (isqrt(8x + 1) - 1) // 2 is the largest n with tri(n) <= x
        n = (math.isqrt(8 * x + 1) - 1) // 2
        return n if n * (n + 1) // 2 == x else n + 1
    if x <= t + (big - m) * m:  # m < n <= big: t + (n - m) m >= x
        return m + -(-(x - t) // m)
    # n > big: a b - tri(a + b - 1 - n) >= x, i.e. the largest k = a + b - 1 - n with tri(k) <= a b - x
    return a + b - 1 - (math.isqrt(8 * (a * b - x) + 1) - 1) // 2


def _ofmap_fold_shape(g: _Geometry, ru: int) -> tuple[int, int]:
    """(a, start): a fold's writes are an a-row block skewed over its columns from local row start."""
    if g.dataflow == "os":
        return ru, g.T - 1 + (g.R - ru)
    return g.T, 2 * g.R - 1


class _OfmapRows:
    """Per-demand-row ofmap write counts over all folds, in closed form over fold kinds (no big arrays).

    A fold's write pattern depends only on whether it is the last row fold (os: rows used) and the last
    column fold (columns used): kind = last_row + 2 * last_col. Folds before fold (fc, fr) are fc full
    columns of folds and fr non-last folds of column fc, so prefix sums need no per-fold array.
    """

    def __init__(self, g: _Geometry):
        self.g = g
        os_ = g.dataflow == "os"  # ws/is write every column's outputs each fold; rows used do not matter
        last_r = g.Sr - (g.row_folds - 1) * g.R if os_ else g.R
        last_c = g.Sc - (g.col_folds - 1) * g.C
        shapes = [(g.R, g.C), (last_r, g.C), (g.R, last_c), (last_r, last_c)]  # (ru, cu) by kind
        # (a, start, cu) by kind: a fold's writes are an a-row block skewed over cu columns from local
        # row start, so rows 0..loc hold _box_pairs(loc - start + 1, a, cu) writes.
        self._box = [(*_ofmap_fold_shape(g, ru), cu) for ru, cu in shapes]
        self._tot = [a * cu for a, _, cu in self._box]
        self._col = (g.row_folds - 1) * self._tot[0] + self._tot[1]  # writes of a non-last column
        self.total = (g.col_folds - 1) * self._col + (g.row_folds - 1) * self._tot[2] + self._tot[3]
        self.nrows = g.folds * g.L
        self._L, self._rf, self._last_r, self._last_c = g.L, g.row_folds, g.row_folds - 1, g.col_folds - 1

    def through(self, r: int) -> int:
        """Writes in demand rows 0..r inclusive (r may be -1)."""
        if r < 0:
            return 0
        if r >= self.nrows:
            return self.total
        f, loc = divmod(r, self._L)
        fc, fr = divmod(f, self._rf)
        lc = 2 if fc == self._last_c else 0
        a, start, b = self._box[lc + (fr == self._last_r)]
        n = loc - start + 1
        if n <= 0:
            return fc * self._col + fr * self._tot[lc]
        return fc * self._col + fr * self._tot[lc] + _box_pairs(n, a, b)

    def first_row_reaching(self, x: int) -> int:
        """Smallest demand row r with through(r) >= x (x >= 1), or nrows if none."""
        if x > self.total:
            return self.nrows
        g = self.g
        fc = min((x - 1) // self._col, g.col_folds - 1)
        x -= fc * self._col
        lc = 2 if fc == g.col_folds - 1 else 0
        fr = min((x - 1) // self._tot[lc], g.row_folds - 1)
        x -= fr * self._tot[lc]
        a, start, b = self._box[lc + (fr == g.row_folds - 1)]
        return (fc * g.row_folds + fr) * g.L + start - 1 + _box_pairs_reaching(x, a, b)

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
