"""Map and schedule an operator graph onto a target: HEFT list scheduling with a shared-DRAM resource.

Algorithm (Topcuoglu et al., HEFT, 2002, without communication costs since
tensors stay in device memory):
  1. rank_u(n) = mean candidate time of n + max over successors of rank_u;
  2. visit nodes by decreasing rank (a topological order);
  3. each node takes the candidate placement (unit) with the earliest finish
     time, or the least energy / energy x delay when asked, or the pinned unit.
A unit with k instances has k slots. Every placement also holds the shared DRAM
channels for its `dram_seconds`, from its start: two memory-bound operators on
different units therefore serialise on bandwidth, while a compute-bound
operator's tail overlaps the next operator's loads. This is a bandwidth-aware
approximation, not a cycle-level memory simulation.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import networkx as nx

from codesign.dataflow.targets import Placement
from codesign.specs import CodesignError, check_choice

OBJECTIVES = ("latency", "energy", "edp")


@dataclass(frozen=True)
class Slot:
    """One scheduled operator."""

    node: str
    op: str
    layer: int | None
    unit: str
    start: float
    end: float
    placement: Placement


@dataclass
class Schedule:
    target: str
    slots: list[Slot]
    graph_attrs: dict

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.slots), default=0.0)

    @property
    def energy_j(self) -> float:
        return sum(s.placement.energy_j for s in self.slots)


def _upward_ranks(g: nx.DiGraph, mean_cost: dict[str, float]) -> dict[str, float]:
    rank: dict[str, float] = {}
    for n in reversed(list(nx.topological_sort(g))):
        rank[n] = mean_cost[n] + max((rank[s] for s in g.successors(n)), default=0.0)
    return rank


def schedule(
    g: nx.DiGraph,
    target,
    objective: str = "latency",
    pins: dict[str, str] | None = None,
) -> Schedule:
    """Place and schedule every node of `g` on `target`.

    pins: {op role or node id: unit}, e.g. {"attention": "pim"}; a pin naming a
    unit the operator cannot use is an error.
    """
    check_choice("objective", objective, OBJECTIVES)
    if not nx.is_directed_acyclic_graph(g):
        cycle = nx.find_cycle(g)
        raise CodesignError(f"the operator graph has a cycle: {cycle[:4]}")
    pins = pins or {}
    units = target.units()
    for unit in set(pins.values()):
        if unit not in units:
            raise CodesignError(
                f"pinned unit {unit!r} not in target {target.name!r} (units: {', '.join(units)})"
            )
    known = set(g.nodes) | {d["op"] for _, d in g.nodes(data=True)}
    stray = sorted(set(pins) - known)
    if stray:  # (a misspelt role would pin nothing, silently)
        raise CodesignError(f"pins name no operator role or node of this graph: {stray} (roles: "
                            f"{', '.join(sorted({d['op'] for _, d in g.nodes(data=True)}))})")  # fmt: skip
    cands: dict[str, tuple[Placement, ...]] = {}
    for n, d in g.nodes(data=True):
        c = target.candidates(d["spec"])
        pin = pins.get(n, pins.get(d["op"]))
        if pin is not None:
            c = tuple(p for p in c if p.unit == pin)
            if not c:
                raise CodesignError(f"node {n} ({d['op']}) cannot run on pinned unit {pin!r}")
        cands[n] = c
    mean = {n: sum(p.seconds for p in c) / len(c) for n, c in cands.items()}
    rank = _upward_ranks(g, mean)
    topo_index = {n: i for i, n in enumerate(nx.topological_sort(g))}
    order = sorted(g.nodes, key=lambda n: (-rank[n], topo_index[n]))

    # Per unit a min-heap of slot free times; DRAM channels are one more resource.
    free = {u: [0.0] * k for u, k in units.items()}
    for h in free.values():
        heapq.heapify(h)
    dram_free = 0.0
    finish: dict[str, float] = {}
    slots: list[Slot] = []
    for n in order:
        ready = max((finish[p] for p in g.predecessors(n)), default=0.0)
        best = None
        for p in cands[n]:
            unit_free = free[p.unit][0] if p.unit in free else 0.0
            start = max(ready, unit_free, dram_free if p.dram_seconds > 0 else 0.0)
            end = start + p.seconds
            key = {
                "latency": (end, p.energy_j),
                "energy": (p.energy_j, end),
                "edp": (p.energy_j * p.seconds, end),
            }[objective]
            if best is None or key < best[0]:
                best = (key, p, start, end)
        _, p, start, end = best
        if p.unit in free:
            heapq.heapreplace(free[p.unit], end)
        if p.dram_seconds > 0:
            dram_free = max(dram_free, start + p.dram_seconds)
        finish[n] = end
        d = g.nodes[n]
        slots.append(Slot(n, d["op"], d.get("layer"), p.unit, start, end, p))
    slots.sort(key=lambda s: (s.start, s.end))
    return Schedule(target.name, slots, dict(g.graph))
