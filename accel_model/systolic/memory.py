"""SCALE-Sim 3.0.0's memory model: double-buffered ifmap / filter / ofmap SRAMs fed from DRAM, by events.

SCALE-Sim steps per cycle through per-cycle demand matrices; this module reaches the same numbers
without building them:
  - the ofmap write buffer jumps from drain event to drain event over per-fold write-count closed forms;
  - CALC-mode read buffers: a closed form when the operand fits half the SRAM, else (GEMM) an O(folds)
    window walk, or (conv, with repeated im2col addresses) a numpy replay of the request addresses;
  - USER-mode read buffers: which requests miss is timing-independent, so a per-fold walk (GEMM,
    user_gemm.py) or a numpy scan of the request addresses (conv) finds the misses; only misses
    and drains are stepped one by one.
SCALE-Sim's quirks are reproduced and pointed out where they are
(tests/accel_model/systolic/test_scalesim_compat.py checks every report field byte for byte).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from codesign.accel_model.systolic.geometry import (
    Layer,
    _AffineMatrix,
    _fold_order,
    _gemm_block,
    _Geometry,
    _OfmapRows,
    _operand_stream,
    _position_row,
    _used_grid,
)
from codesign.specs import CodesignError, check_positive_int

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


class _WriteBuffer:
    """The state of SCALE-Sim's ofmap write buffer between drain events (`_simulate_write_buffer`)."""

    def __init__(self, rows: _OfmapRows, size_words: int, drain_bw: int):
        self.rows, self.total, self.drain_bw = rows, size_words, drain_bw
        self.active = int(math.ceil(size_words * _ACTIVE_FRAC))
        self.lines_per_drain = int(math.ceil((size_words - self.active) / drain_bw))
        self.free, self.drain_end, self.g = size_words, 0, 0  # g: ofmap words written so far
        self.nlines, self.line_idx, self.drain_start_line = 0, 0, 0
        self.partial: dict[int, int] = {}
        self.accesses = 0
        self.first_drain: float | None = None
        self.last_drain = -math.inf
        self._through: dict[int, int] = {}

    def through(self, row: int) -> int:
        """Words written up to and including `row` (the loop asks for the same rows again)."""
        hit = self._through.get(row)
        if hit is None:
            hit = self._through[row] = self.rows.through(row)
        return hit

    def close_line(self) -> None:
        if self.line_idx:
            self.partial[self.nlines] = self.line_idx
            self.nlines += 1
            self.line_idx = 0

    def drain(self, start: int) -> int:
        """Drain up to lines_per_drain lines from cycle `start`, one per cycle; the last drain cycle."""
        n = min(self.drain_start_line + self.lines_per_drain, self.nlines) - self.drain_start_line
        if n <= 0:
            raise CodesignError("ofmap drain with nothing to drain (SCALE-Sim fails here too)")
        last = self.drain_start_line + n - 1
        data = (n - 1) * self.drain_bw + self.partial.get(last, self.drain_bw)
        self.accesses += data
        self.free += data
        self.drain_start_line += n
        self.first_drain = start if self.first_drain is None else min(self.first_drain, start)
        self.last_drain = max(self.last_drain, start + n - 1)
        return start + n - 1

    def store(self, k: int) -> None:
        self.nlines += (self.line_idx + k) // self.drain_bw
        self.line_idx = (self.line_idx + k) % self.drain_bw
        self.free -= k
        self.g += k

    def next_event_row(self, r: int, stall: int) -> float:
        """The first row at or after `r` whose writes fill the SRAM or start a drain (inf: none left)."""
        rows = self.rows
        if self.g >= rows.total:
            return math.inf
        e_drain_free = self.g + max(1, self.free - self.active + 1)  # first write leaving < `active` free
        r_due = max(r, self.drain_end - stall)  # first row issued at or after the drain in flight ends
        e_due = self.through(r_due - 1) + 1
        e_full = self.g + max(1, self.free)  # first write that fills the SRAM
        event = e_full if e_full < e_due else max(e_drain_free, e_due)
        return rows.first_row_reaching(event) if event <= rows.total else math.inf

    def write_row(self, row: int, cycle: int) -> int:
        """Write `row`'s words issued at `cycle`; returns the cycle its last write goes in (stall = difference)."""
        self.store(self.through(row - 1) - self.g)
        n = self.through(row) - self.g
        current = cycle
        while n:  # the row's writes, in chunks that end where a write meets the full SRAM or drains
            if current < self.drain_end:  # a drain is in flight: a write that fills the SRAM waits for it
                m = max(1, self.free)
                if m > n:
                    self.store(n)
                    break
                self.store(m)
                current = self.drain_end
            else:  # no drain in flight: a write leaving less than `active` free starts one
                m = max(1, self.free - self.active + 1)
                if m > n:
                    self.store(n)
                    break
                self.store(m)
                self.close_line()
                self.drain_end = self.drain(current)
            n -= m
        return current

    def finish(self, cycle: int) -> None:
        """Store the remaining words and drain everything from `cycle` on."""
        self.store(self.rows.total - self.g)
        self.close_line()
        while self.drain_start_line < self.nlines:
            self.drain_end = self.drain(cycle)
            cycle = self.drain_end + 1


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
    wb = _WriteBuffer(rows, size_words, drain_bw)
    stall, stall_rows, offsets = 0, [], {}
    r, ri = 0, 0
    while True:
        next_read = read_rows[ri] if ri < len(read_rows) else math.inf
        row = min(wb.next_event_row(r, stall), next_read)
        if row == math.inf:
            break
        cycle = row + stall
        current = wb.write_row(row, cycle)
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
    wb.finish(rows.nrows - 1 + stall)
    return _WriteBufferResult(
        rows.nrows - 1 + stall, stall, wb.accesses, float(wb.first_drain), float(wb.last_drain), stall_rows, offsets
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


def _user_read_buffer(
    g: _Geometry, which: str, layer: Layer, size_words: int, bw: int, scan: bool = False
) -> _UserReadBuffer:
    """SCALE-Sim's USER-mode read buffer (memory/read_buffer.py): a circular window of address sets.

    The operand's fetch order is cut into sets of ceil(size / 100) words; the first half of the SRAM is
    filled before cycle 0, then every request whose set is outside the active window slides it by the
    prefetch half, fetching ceil(half / bw) lines of bw words that complete one line per cycle after the
    previous fetch (+1 cycle latency). Which requests miss does not depend on timing: for a GEMM it is
    found fold by fold in closed form (user_gemm.py); otherwise (conv, or scan=True) by a numpy
    scan of the request stream. Only the misses are handled one by one.
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
    if isinstance(operand, _AffineMatrix) and not scan:  # GEMM: per-fold walk, no request stream
        # Imported here: the walk is a numba kernel, and importing numba (~0.3 s) is needed only when a
        # USER-mode operand misses, not by CALC-mode runs or the rest of the model.
        from codesign.accel_model.systolic.user_gemm import user_read_events

        events, reads, last = user_read_events(
            g.dataflow, which, g.R, g.C, g.Sr, g.Sc, g.T, g.L, per_set, n_sets, n_active, n_prefetch,
            math.ceil(prefetch / bw), bw, first_lines * bw,
        )  # fmt: skip
        return _UserReadBuffer(events, reads, float(-first_lines), float(last))
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
