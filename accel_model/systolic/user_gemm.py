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
request-stream scan in memory.py and against SCALE-Sim itself.

The walk is one numba kernel (it was ~40% of a bandwidth-limited layer's time in Python); its first call
in a fresh process loads the compiled code from numba's on-disk cache (cache=True), or compiles it once
(~2 s) when no cache exists yet.
"""

from __future__ import annotations

import numba
import numpy as np

from codesign.specs import CodesignError

_STREAM_BLOCK = {  # (dataflow, operand) -> fold index selecting the block, for anti-diagonal operands
    ("os", "ifmap"): "fr",
    ("os", "filter"): "fc",
    ("ws", "ifmap"): "fr",
    ("is", "filter"): "fr",
}
_STATIONARY = (("ws", "filter"), ("is", "ifmap"))
_NEVER_REACHES = -1  # kernel status: the window slid more than n_sets times without reaching a set


@numba.njit(cache=True)
def _slide_to(st, s, row, ev_row, ev_done, n_sets, n_active, n_prefetch, lines, bw):  # pragma: no cover
    """Slide SCALE-Sim's circular set window until set `s` is in it; each slide is a fetch completing
    `lines` + 1 cycles after the previous one. st = [window start, last completion, reads, events, status]."""
    slides = 0
    while (s - st[0]) % n_sets >= n_active:
        st[0] = (st[0] + n_prefetch) % n_sets
        st[1] += lines + 1
        st[2] += lines * bw
        n = st[3]
        if n == ev_row.size:  # grow the event arrays
            ev_row = np.concatenate((ev_row, np.empty_like(ev_row)))
            ev_done = np.concatenate((ev_done, np.empty_like(ev_done)))
        ev_row[n] = row
        ev_done[n] = st[1]
        st[3] = n + 1
        slides += 1
        if slides > n_sets:
            st[4] = _NEVER_REACHES
            break
    return ev_row, ev_done


@numba.njit(cache=True)
def _fold_hits(st, s_lo, s_hi, n_sets, n_active):  # pragma: no cover - compiled
    """True if every set s_lo..s_hi lies in the window (the window is contiguous from s_lo's place on)."""
    rel = (s_lo - st[0]) % n_sets
    return rel < n_active and s_lo + n_active - rel > s_hi


@numba.njit(cache=True)
def _walk_stationary(st, ev_row, ev_done, R, C, Sr, Sc, L, per_set, n_sets, n_active, n_prefetch, lines, bw):
    """Stacked blocks of Sr rows x C columns per column fold, read row by row; a fold issues its block
    rows last first (block row j at local row R - 1 - j), each a contiguous run of fetch positions."""
    row_folds, col_folds = -(-Sr // R), -(-Sc // C)
    for fc in range(col_folds):
        w = min(C, Sc - fc * C)
        base = fc * Sr * C  # earlier blocks are full width
        for fr in range(row_folds):
            ru = min(R, Sr - fr * R)
            lo = base + fr * R * w
            if _fold_hits(st, lo // per_set, (lo + ru * w - 1) // per_set, n_sets, n_active):
                continue
            f0 = (fc * row_folds + fr) * L
            for j in range(ru - 1, -1, -1):
                p, stop_p, row = lo + j * w, lo + j * w + w, f0 + R - 1 - j
                while p < stop_p:
                    s = p // per_set
                    rel = (s - st[0]) % n_sets
                    if rel >= n_active:
                        ev_row, ev_done = _slide_to(
                            st, s, row, ev_row, ev_done, n_sets, n_active, n_prefetch, lines, bw
                        )
                        if st[4] != 0:
                            return ev_row, ev_done
                    else:  # every request before the window's end hits
                        p = max(p, (s + n_active - rel) * per_set)
    return ev_row, ev_done


@numba.njit(cache=True)
def _valid_above(d, lo, H, H0, W, wl):  # pragma: no cover - compiled
    """Valid rows >= lo on stacked diagonal d (all W columns, less the last block's padding columns)."""
    full = max(0, min(H - 1, d) - max(lo, d - W + 1) + 1)
    if wl == W:
        return full
    return full - max(0, min(H - 1, d - wl) - max(max(lo, H0), d - W + 1) + 1)


@numba.njit(cache=True)
def _walk_stream(st, ev_row, ev_done, by_row, prefix, R, C, Sr, Sc, T, L, per_set, n_sets, n_active,
                 n_prefetch, lines, bw):  # fmt: skip
    """Anti-diagonal operands: run k of block b is stacked diagonal bT + k, fetch positions
    [first, end) in issue order, all at local demand row prefix + k of a fold that uses block b."""
    row_folds, col_folds = -(-Sr // R), -(-Sc // C)
    W, size, nb = (R, Sr, row_folds) if by_row else (C, Sc, col_folds)
    wl = size - (nb - 1) * W  # used width of the last block; the rest of its columns are padding
    H, H0 = nb * T, (nb - 1) * T
    before = np.zeros(H + W, np.int64)  # before[d]: valid entries on stacked diagonals < d
    for d in range(H + W - 1):
        before[d + 1] = before[d] + _valid_above(d, 0, H, H0, W, wl)
    nk = T + W - 1
    first = np.empty((nb, nk), np.int64)
    end = np.empty((nb, nk), np.int64)
    for b in range(nb):
        used = min(W, size - b * W)
        for k in range(nk):
            d = b * T + k
            hi, lo = min(b * T + T - 1, d), max(b * T, d - used + 1)
            first[b, k] = before[d] + _valid_above(d, hi + 1, H, H0, W, wl)
            end[b, k] = first[b, k] + (hi - lo + 1)
    for fc in range(col_folds):
        for fr in range(row_folds):
            b = fr if by_row else fc
            nr = nk if b < nb - 1 else T + wl - 1  # the last, narrower block has fewer runs
            if _fold_hits(st, first[b, 0] // per_set, (end[b, nr - 1] - 1) // per_set, n_sets, n_active):
                continue
            row0 = (fc * row_folds + fr) * L + prefix
            ends = end[b, :nr]
            p_cur = first[b, 0]
            while True:
                k = np.searchsorted(ends, p_cur, side="right")  # first run still holding positions >= p_cur
                if k == nr:
                    break
                p = max(first[b, k], p_cur)
                s = p // per_set
                rel = (s - st[0]) % n_sets
                if rel < n_active:
                    p_cur = (s + n_active - rel) * per_set  # every request before that position hits
                else:
                    ev_row, ev_done = _slide_to(
                        st, s, row0 + k, ev_row, ev_done, n_sets, n_active, n_prefetch, lines, bw
                    )
                    if st[4] != 0:
                        return ev_row, ev_done
    return ev_row, ev_done


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

    Geometry as in geometry.py: Sr x Sc mapped onto R x C in folds (column folds outer), T temporal
    steps, L demand rows per fold. events maps a demand row to the completion cycles of the fetches its
    misses triggered; the first `first_reads` words were prefetched before cycle 0.
    """
    key = (dataflow, which)
    st = np.array([0, -1, first_reads, 0, 0], dtype=np.int64)
    ev_row, ev_done = np.empty(64, np.int64), np.empty(64, np.int64)
    win = (per_set, n_sets, n_active, n_prefetch, lines, bw)
    if key in _STATIONARY:
        ev_row, ev_done = _walk_stationary(st, ev_row, ev_done, R, C, Sr, Sc, L, *win)
    elif key in _STREAM_BLOCK:
        prefix = 0 if dataflow == "os" else R
        by_row = _STREAM_BLOCK[key] == "fr"
        ev_row, ev_done = _walk_stream(st, ev_row, ev_done, by_row, prefix, R, C, Sr, Sc, T, L, *win)
    else:
        raise CodesignError(f"unknown operand {key!r}")
    if st[4] == _NEVER_REACHES:
        raise CodesignError("read-buffer window never reaches an address (SCALE-Sim loops forever here)")
    events: dict[int, list[int]] = {}
    for row, done in zip(ev_row[: st[3]].tolist(), ev_done[: st[3]].tolist()):
        events.setdefault(row, []).append(done)
    return events, int(st[2]), int(st[1])
