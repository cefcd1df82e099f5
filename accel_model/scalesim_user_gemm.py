"""SCALE-Sim's USER-mode read buffer on a GEMM operand, walked fold by fold without a request stream.

SCALE-Sim (memory/read_buffer.py) cuts an operand's DRAM fetch order into sets of `per_set` words and
keeps a circular window of `n_active` sets; a request whose set lies outside the window slides it by
`n_prefetch` sets, once per fetch, until it hits. Which requests miss depends only on the order of their
fetch positions, so it suffices to know, inside each fold, where each request sits in the fetch order.

For a GEMM that is arithmetic. The fetch order stacks each operand block (one per row or column fold)
into a matrix of width W (R or C; the last block's columns past its used width are padding, skipped):
  - "stream" operands are read by anti-diagonals, the higher row first within a diagonal. One demand row
    of a fold issues the block's part of one stacked diagonal, in the same order, so it is a contiguous
    run of fetch positions, and runs grow from row to row: positions are monotone in issue order, and
    the first request at or past a position is one binary search over the fold's run ends.
  - "stationary" operands (ws filter, is ifmap) are read row by row; a fold issues its block rows last
    first, each a contiguous run, and together they cover one contiguous range, so a fold whose range
    lies inside the window is skipped in O(1) and only folds that straddle a window edge walk their rows.
Each request that misses is then handled as SCALE-Sim does (one event per slide). Tested against the
request-stream scan in scalesim_memory.py and against SCALE-Sim itself.
"""

from __future__ import annotations

import bisect

import numpy as np

from codesign.specs import CodesignError

_STREAM_BLOCK = {  # (dataflow, operand) -> fold index selecting the block, for anti-diagonal operands
    ("os", "ifmap"): "fr",
    ("os", "filter"): "fc",
    ("ws", "ifmap"): "fr",
    ("is", "filter"): "fr",
}
_STATIONARY = (("ws", "filter"), ("is", "ifmap"))


class _Window:
    """SCALE-Sim's circular set window and the fetch events its slides produce."""

    def __init__(self, n_sets: int, n_active: int, n_prefetch: int, lines: int, bw: int, reads: int):
        self.n_sets, self.n_active, self.n_prefetch = n_sets, n_active, n_prefetch
        self.lines, self.bw = lines, bw
        self.start, self.last, self.reads = 0, -1, reads
        self.events: dict[int, list[int]] = {}

    def hit_end(self, s: int) -> int:
        """First set above `s` outside the window, or -1 if set `s` misses."""
        rel = (s - self.start) % self.n_sets
        return -1 if rel >= self.n_active else s + self.n_active - rel

    def slide_to(self, s: int, row: int) -> None:
        """Slide until set `s` is in the window; each slide is a fetch completing one line later."""
        slides = 0
        while (s - self.start) % self.n_sets >= self.n_active:
            self.start = (self.start + self.n_prefetch) % self.n_sets
            self.last += self.lines + 1
            self.reads += self.lines * self.bw
            self.events.setdefault(row, []).append(self.last)
            slides += 1
            if slides > self.n_sets:
                raise CodesignError(
                    "read-buffer window never reaches an address (SCALE-Sim loops forever here)"
                )


def _walk_runs(win: _Window, per_set: int, first: list[int], end: list[int], row0: int) -> None:
    """Requests in runs [first[k], end[k]) of fetch positions (increasing in k) at demand rows row0 + k."""
    nruns, p_cur, n_sets, n_active = len(first), first[0], win.n_sets, win.n_active
    while True:
        k = bisect.bisect_right(end, p_cur)  # first run still holding positions >= p_cur
        if k == nruns:
            return
        p = first[k] if first[k] > p_cur else p_cur
        s = p // per_set
        rel = (s - win.start) % n_sets
        if rel < n_active:
            p_cur = (s + n_active - rel) * per_set  # every request before that position hits
        else:
            win.slide_to(s, row0 + k)


def _walk_run(win: _Window, per_set: int, p0: int, n: int, row: int) -> None:
    """Requests at fetch positions p0 .. p0 + n - 1, in that order, all at demand row `row`."""
    p, stop_p = p0, p0 + n
    while p < stop_p:
        s = p // per_set
        stop = win.hit_end(s)
        if stop < 0:
            win.slide_to(s, row)
        else:
            p = max(p, stop * per_set)


def user_read_events(
    dataflow: str,
    which: str,
    R: int,
    C: int,
    Sr: int,
    Sc: int,
    T: int,
    L: int,
    per_set: int,
    n_sets: int,
    n_active: int,
    n_prefetch: int,
    lines: int,
    bw: int,
    first_reads: int,
) -> tuple[dict[int, list[int]], int, int]:
    """(events, DRAM words read, last fetch cycle) of SCALE-Sim's USER read buffer on a GEMM operand.

    Geometry as in scalesim_geometry.py: Sr x Sc mapped onto R x C in folds (column folds outer), T temporal
    steps, L demand rows per fold. events maps a demand row to the completion cycles of the fetches its
    misses triggered; the first `first_reads` words were prefetched before cycle 0.
    """
    row_folds, col_folds = -(-Sr // R), -(-Sc // C)
    win = _Window(n_sets, n_active, n_prefetch, lines, bw, first_reads)
    key = (dataflow, which)
    if key in _STATIONARY:  # stacked blocks of Sr rows x C columns per column fold, read row by row
        for fc in range(col_folds):
            w = min(C, Sc - fc * C)
            base = fc * Sr * C  # earlier blocks are full width
            for fr in range(row_folds):
                ru = min(R, Sr - fr * R)
                lo = base + fr * R * w
                s_lo, s_hi = lo // per_set, (lo + ru * w - 1) // per_set
                stop = win.hit_end(s_lo)
                if stop > s_hi:  # the whole fold hits
                    continue
                f0 = (fc * row_folds + fr) * L
                for j in range(ru - 1, -1, -1):  # block row j is issued at local row R - 1 - j
                    _walk_run(win, per_set, lo + j * w, w, f0 + R - 1 - j)
        return win.events, win.reads, win.last
    if key not in _STREAM_BLOCK:
        raise CodesignError(f"unknown operand {key!r}")
    by_row = _STREAM_BLOCK[key] == "fr"
    W, size, nb = (R, Sr, row_folds) if by_row else (C, Sc, col_folds)
    prefix = 0 if dataflow == "os" else R
    wl = size - (nb - 1) * W  # used width of the last block; the rest of its columns are padding
    H, H0 = nb * T, (nb - 1) * T

    # Valid entries on each stacked diagonal (all W columns, less the last block's padding), summed:
    # before[d] = valid entries on diagonals < d.
    dg = np.arange(H + W - 1, dtype=np.int64)
    per_diag = np.minimum(H - 1, dg) - np.maximum(0, dg - W + 1) + 1
    if wl < W:
        per_diag -= np.maximum(0, np.minimum(H - 1, dg - wl) - np.maximum(H0, dg - W + 1) + 1)
    before = np.concatenate(([0], np.cumsum(per_diag)))

    def valid_above(d: np.ndarray, lo: np.ndarray) -> np.ndarray:  # valid rows >= lo on diagonal d
        full = np.maximum(0, np.minimum(H - 1, d) - np.maximum(lo, d - W + 1) + 1)
        if wl == W:
            return full
        pad = np.maximum(0, np.minimum(H - 1, d - wl) - np.maximum(np.maximum(lo, H0), d - W + 1) + 1)
        return full - pad

    # Run k of block b is stacked diagonal bT + k, rows hi down to lo (all blocks at once; the last,
    # narrower block has only T + wl - 1 runs).
    b = np.arange(nb, dtype=np.int64)[:, None]
    d = b * T + np.arange(T + W - 1, dtype=np.int64)[None, :]
    hi = np.minimum(b * T + T - 1, d)
    lo = np.maximum(b * T, d - np.minimum(W, size - b * W) + 1)
    firsts = before[d] + valid_above(d, hi + 1)
    ends = (firsts + (hi - lo + 1)).tolist()
    firsts = firsts.tolist()
    runs = {b_: (firsts[b_], ends[b_]) for b_ in range(nb - 1)}
    runs[nb - 1] = (firsts[-1][: T + wl - 1], ends[-1][: T + wl - 1])
    for fc in range(col_folds):
        for fr in range(row_folds):
            b_ = fr if by_row else fc
            first, end = runs[b_]
            s_lo, s_hi = first[0] // per_set, (end[-1] - 1) // per_set
            stop = win.hit_end(s_lo)
            if stop > s_hi:  # the whole fold hits
                continue
            f0 = (fc * row_folds + fr) * L + prefix
            _walk_runs(win, per_set, first, end, f0)
    return win.events, win.reads, win.last
