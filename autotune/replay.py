"""Replay a cache of measured timings to compare search strategies without a GPU.

Given a cache holding an exhaustive run of one shape (every candidate measured, e.g.
`codesign tune --strategy exhaustive` on a GPU), each strategy is re-run with `evaluate` looking
the time up in the cache, for several seeds and a budget of `fraction` of the candidates. The
report says, per strategy, best/optimum per seed and how many seeds came within `within` of it.

    python -m codesign.autotune.replay CACHE.jsonl [--fraction 0.25] [--seeds 5]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from typing import Any

from codesign.autotune.cache import TuningCache
from codesign.autotune.space import config_id
from codesign.autotune.strategies import STRATEGIES, Budget, search


def replay(
    records: list[dict[str, Any]], fraction: float = 0.25, seeds: int = 5, within: float = 0.05
) -> list[dict[str, Any]]:
    """One row per (gpu, op, key, m, dtype) group of `records`: strategies replayed on its timings.

    Failed records count as infinitely slow (a strategy that picks one learns nothing from it).
    """
    groups: dict[tuple, dict[str, tuple[dict, float]]] = defaultdict(dict)
    for r in records:
        g = (r["gpu"], r["op"], r["key"], r["m"], r["dtype"], r["triton"], r["source_hash"])
        groups[g].setdefault(config_id(r["config"]), (r["config"], r["time_ms"] if r["ok"] else math.inf))
    rows = []
    for g, points in sorted(groups.items(), key=lambda kv: str(kv[0])):
        cands = [c for c, _ in points.values()]
        times = {cid: t for cid, (_, t) in points.items()}
        opt = min(times.values())
        if not math.isfinite(opt):
            continue
        budget = Budget(max_evals=max(1, int(fraction * len(cands))))
        row: dict[str, Any] = {"gpu": g[0], "op": g[1], "key": g[2], "m": g[3], "dtype": g[4],
                               "candidates": len(cands), "budget": budget.max_evals, "optimum_ms": opt}  # fmt: skip
        for strat in STRATEGIES:
            if strat == "exhaustive":
                continue
            ratios = [
                search(strat, cands, lambda c, t=times: t[config_id(c)], budget, seed=s).best[1] / opt
                for s in range(seeds)
            ]
            row[strat] = {"best_over_optimum": ratios, "within": sum(x <= 1 + within for x in ratios)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the replay rows as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cache")
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args(argv)
    print(json.dumps(replay(TuningCache(args.cache).load().records, args.fraction, args.seeds), indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
