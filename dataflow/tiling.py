"""Tiling and loop-order search for a GEMM on a systolic array with finite buffers (the mapper's per-op search).

A GEMM C[M,N] += A[M,K] B[K,N] runs as tiles (tm, tn, tk) in a loop nest over the tile indices in one
of six orders (outermost first, e.g. "mnk"). Cost model (SCALE-Sim's fold arithmetic, made exact):

* compute: each tile runs as SCALE-Sim folds on the R x C array, ceil(sr/R) * ceil(sc/C) * (F0 + t) - 1
  cycles, with (sr, sc, t) the tile's (Sr, Sc, T) in the dataflow's operand mapping (os: M, N, K; ws:
  K, N, M; is: K, M, N) and F0 = fold_cycles(R, C, t) - t. Summed over tiles it separates:
  S_r * S_c * (n_T * F0 + D_T) - n_tiles, where S_r = sum over Sr-tiles of ceil(sr_i / R).
* DRAM traffic: an operand's tile is re-fetched on every iteration of the loops outside (and at) the
  innermost loop that indexes it; loops inside reuse it. So A (indexed m, k) moves M*K*a_bytes times the
  trip counts of the non-(m, k) loops at or above its innermost index loop; likewise B (k, n). C (m, n) is
  written once if k runs inside both m and n; otherwise its fp32 partial sums are written and read back
  (f - 1) extra times, f the product of the k-trip (and any loop outside C's innermost index loop).
* capacity: a tile of A, B and the fp32 C partials must fit half of its double-buffered buffer.
* latency: max(compute, traffic / bandwidth) + the first A and B tiles' load (the pipeline fill).
* energy: DRAM bytes x pJ/byte + MACs x pJ/MAC.

`brute_force` tries every tile size and order (small GEMMs only); `search` tries, for each dimension,
only sizes that can be optimal: per trip count t the smallest tile ceil(D/t) (for the temporal
dimension, whose compute depends on t only), plus for the two array-mapped dimensions the multiples of
the array edge and the sizes where the last tile's fold count drops (ceil((D - jR) / (t - 1))): within
any other run of sizes the cost is constant in compute and traffic and grows in fill and footprint.
Tests check `search == brute_force` on random small GEMMs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from codesign.accel_model.systolic.model import fold_cycles
from codesign.specs import CodesignError, check_choice, check_positive_int

ORDERS = tuple("".join(p) for p in itertools.permutations("mnk"))
OBJECTIVES = ("latency", "energy", "edp")
INDEX = {"A": set("mk"), "B": set("kn"), "C": set("mn")}


@dataclass(frozen=True)
class TilingProblem:
    M: int
    N: int
    K: int
    rows: int
    cols: int
    dataflow: str = "ws"
    ifmap_bytes: int = 1 << 20
    filter_bytes: int = 1 << 20
    ofmap_bytes: int = 1 << 20
    bw_bytes_per_cycle: float = 64.0
    a_bytes: float = 2.0
    b_bytes: float = 2.0
    out_bytes: float = 2.0
    dram_pj_per_byte: float = 31.2  # 3.9 pJ/bit HBM2 (O'Connor et al., MICRO 2017)
    mac_pj: float = 0.1

    def __post_init__(self) -> None:
        for f in ("M", "N", "K", "rows", "cols", "ifmap_bytes", "filter_bytes", "ofmap_bytes"):
            check_positive_int(f, getattr(self, f))
        check_choice("dataflow", self.dataflow, ("os", "ws", "is"))
        if not self.bw_bytes_per_cycle > 0:
            raise CodesignError(f"bw_bytes_per_cycle must be > 0, got {self.bw_bytes_per_cycle!r}")


@dataclass(frozen=True)
class Tiling:
    tm: int
    tn: int
    tk: int
    order: str
    cycles: float
    compute_cycles: float
    dram_bytes: float
    energy_pj: float

    def score(self, objective: str) -> tuple[float, float]:
        if objective == "latency":
            return (self.cycles, self.energy_pj)
        if objective == "energy":
            return (self.energy_pj, self.cycles)
        return (self.cycles * self.energy_pj, self.cycles)


def _trips(d: int, t: np.ndarray) -> np.ndarray:
    return -(-d // t)


def _fold_sum(d: int, t: np.ndarray, edge: int) -> np.ndarray:
    """sum over the tiles of a dimension of ceil(tile / edge): (n-1) full tiles and one remainder."""
    n = _trips(d, t)
    last = d - (n - 1) * t
    return (n - 1) * (-(-t // edge)) + (-(-last // edge))


def _cost(p: TilingProblem, tm: np.ndarray, tn: np.ndarray, tk: np.ndarray, order: str):
    """Vectorised cost of tile sizes (broadcast arrays) in one loop order: (cycles, compute, bytes, energy, fits)."""
    dims = {"m": (p.M, tm), "n": (p.N, tn), "k": (p.K, tk)}
    trips = {k: _trips(d, t) for k, (d, t) in dims.items()}
    # Compute cycles, separated by the dataflow's operand mapping.
    sr_dim, sc_dim, t_dim = {"os": "mnk", "ws": "knm", "is": "kmn"}[p.dataflow]
    f0 = fold_cycles(p.rows, p.cols, 1, p.dataflow) - 1
    s_r = _fold_sum(dims[sr_dim][0], dims[sr_dim][1], p.rows)
    s_c = _fold_sum(dims[sc_dim][0], dims[sc_dim][1], p.cols)
    n_tiles = trips["m"] * trips["n"] * trips["k"]
    compute = s_r * s_c * (trips[t_dim] * f0 + dims[t_dim][0]) - n_tiles

    def factor(operand: str) -> np.ndarray:
        depth = max(order.index(i) for i in INDEX[operand])
        f = np.ones_like(n_tiles)
        for loop in order[: depth + 1]:
            if loop not in INDEX[operand]:
                f = f * trips[loop]
        return f

    a = p.M * p.K * p.a_bytes * factor("A")
    b = p.K * p.N * p.b_bytes * factor("B")
    # C's tile is revisited once per iteration of the loops outside its innermost index loop (the k loop,
    # unless k runs inside both m and n): each extra visit writes and reads back fp32 partial sums.
    revisits = factor("C")
    c = p.M * p.N * (p.out_bytes + 2 * 4.0 * (revisits - 1))
    traffic = a + b + c
    fill = (tm * tk * p.a_bytes + tk * tn * p.b_bytes) / p.bw_bytes_per_cycle
    cycles = np.maximum(compute, traffic / p.bw_bytes_per_cycle) + fill
    energy = traffic * p.dram_pj_per_byte + float(p.M) * p.N * p.K * p.mac_pj
    fits = (
        (tm * tk * p.a_bytes <= p.ifmap_bytes / 2)
        & (tk * tn * p.b_bytes <= p.filter_bytes / 2)
        & (tm * tn * 4.0 <= p.ofmap_bytes / 2)
    )
    return cycles, compute, traffic, energy, fits


def _best(p: TilingProblem, cand: dict[str, np.ndarray], objective: str) -> Tiling:
    check_choice("objective", objective, OBJECTIVES)
    tm, tn, tk = np.meshgrid(cand["m"], cand["n"], cand["k"], indexing="ij")
    best: Tiling | None = None
    for order in ORDERS:
        cyc, comp, traffic, energy, fits = _cost(p, tm, tn, tk, order)
        if not fits.any():
            continue
        key = {"latency": (cyc, energy), "energy": (energy, cyc), "edp": (cyc * energy, cyc)}[objective]
        primary = np.where(fits, key[0], np.inf)
        cand_idx = np.flatnonzero(primary == primary.min())
        # Ties: the secondary key, then the smallest footprint, then the first in order: deterministic.
        sec = key[1].ravel()[cand_idx]
        cand_idx = cand_idx[sec == sec.min()]
        foot = (tm * tk + tk * tn + tm * tn).ravel()[cand_idx]
        i = int(cand_idx[np.argmin(foot)])
        t = Tiling(
            int(tm.ravel()[i]),
            int(tn.ravel()[i]),
            int(tk.ravel()[i]),
            order,
            float(cyc.ravel()[i]),
            float(comp.ravel()[i]),
            float(traffic.ravel()[i]),
            float(energy.ravel()[i]),
        )
        if best is None or t.score(objective) + ((t.tm * t.tk + t.tk * t.tn + t.tm * t.tn),) < best.score(
            objective
        ) + ((best.tm * best.tk + best.tk * best.tn + best.tm * best.tn),):
            best = t
    if best is None:
        raise CodesignError(
            f"no tile of GEMM {p.M}x{p.N}x{p.K} fits the buffers (ifmap {p.ifmap_bytes} B, filter "
            f"{p.filter_bytes} B, ofmap {p.ofmap_bytes} B, half of each usable with double buffering)"
        )
    return best


def brute_force(p: TilingProblem, objective: str = "latency") -> Tiling:
    """Every tile size 1..D per dimension and every loop order (for small GEMMs)."""
    if p.M * p.N * p.K > 200_000:
        raise CodesignError("brute_force is for small GEMMs (M*N*K <= 200,000); use search()")
    return _best(p, {d: np.arange(1, D + 1) for d, D in (("m", p.M), ("n", p.N), ("k", p.K))}, objective)


def _candidates(d: int, edge: int | None) -> np.ndarray:
    """Tile sizes that can be optimal for a dimension of extent d (see the module docstring)."""
    out = set()
    for t in range(1, d + 1):  # trip count t <-> tile sizes [ceil(d/t), floor((d-1)/(t-1))]
        lo = -(-d // t)
        hi = d if t == 1 else (d - 1) // (t - 1)
        if lo > hi:
            continue
        out.add(lo)
        if edge is None:
            continue
        out.update(range(-(-lo // edge) * edge, hi + 1, edge))
        if t > 1:
            for j in range(0, d // edge + 1):
                v = -(-(d - j * edge) // (t - 1))
                if lo <= v <= hi:
                    out.add(v)
    return np.array(sorted(out))


def search(p: TilingProblem, objective: str = "latency") -> Tiling:
    """The best tiling and loop order: exhaustive over the sizes that can be optimal (exact; see tests)."""
    sr_dim, sc_dim, _ = {"os": "mnk", "ws": "knm", "is": "kmn"}[p.dataflow]
    edges = {sr_dim: p.rows, sc_dim: p.cols}
    ext = {"m": p.M, "n": p.N, "k": p.K}
    cand = {d: _candidates(ext[d], edges.get(d)) for d in "mnk"}
    n = len(cand["m"]) * len(cand["n"]) * len(cand["k"])
    if n > 3_000_000:
        # Large GEMMs: keep the candidates that are multiples of the array edge or full extents
        # (a pruned, heuristic space: optimality is only guaranteed by the exhaustive branch).
        cand = {
            d: np.array(
                sorted(
                    {
                        int(x)
                        for x in c
                        if (edges.get(d) and x % edges[d] == 0)
                        or x == ext[d]
                        or (not edges.get(d) and (x & (x - 1)) == 0)
                    }
                )
            )
            for d, c in cand.items()
        }
    return _best(p, cand, objective)


def problem_for(spec, design) -> TilingProblem:
    """The tiling problem of a Gemm spec on an accel_model design (its array, buffers, DRAM bandwidth)."""
    from codesign.specs import dtype_bytes

    a = design.systolic
    e = dtype_bytes(a.dtype)
    return TilingProblem(
        M=max(spec.M, 1),
        N=spec.N,
        K=spec.K,
        rows=a.rows,
        cols=a.cols,
        dataflow=a.dataflow,
        ifmap_bytes=design.buffer("ifmap").size_bytes,
        filter_bytes=design.buffer("filter").size_bytes,
        ofmap_bytes=design.buffer("ofmap").size_bytes,
        bw_bytes_per_cycle=design.memory.peak_gbps / design.clock_ghz,
        a_bytes=e,
        b_bytes=spec.weight.total_bytes(spec.N, spec.K) / (spec.N * spec.K),
        out_bytes=e,
        dram_pj_per_byte=design.memory.pj_per_bit * 8,
        mac_pj=design.energy.mac_pj(a.dtype),
    )
