"""Search strategies against a deterministic synthetic GEMM cost model (no GPU, no kernel).

The cost model is written here, independent of the code under test: wave quantization over 132
SMs, a math/memory max per tile with an efficiency that depends on tile size and warps, latency
hiding by pipeline stages, split-K reduction cost, and +-1% deterministic per-config noise. Its
optimum is found by brute force in the test; a strategy must come within 5% of it.
"""

from __future__ import annotations

import math
import time
import zlib

import pytest

from codesign.autotune.space import ConfigSpace, DeviceLimits, config_id, gemm_resources
from codesign.autotune.strategies import Budget, search
from codesign.specs import CodesignError

SHAPES = [(1, 4096, 4096), (16, 11008, 4096), (256, 4096, 11008)]


def _space(k: int) -> ConfigSpace:
    return ConfigSpace(
        params={"BLOCK_M": [16, 32, 64, 128], "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [32, 64, 128],
                "num_warps": [2, 4, 8], "num_stages": [2, 3, 4], "SPLIT_K": [1, 4]},
        valid=lambda c: c["BLOCK_K"] * c["SPLIT_K"] <= k,
        resources=gemm_resources(2, 0.5),
    )  # fmt: skip


def _cost(c: dict, m: int, n: int, k: int, sms: int = 132) -> float:
    bm, bn, bk, w, st, sk = (
        c[x] for x in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K")
    )
    waves = math.ceil(math.ceil(m / bm) * math.ceil(n / bn) * sk / sms)
    eff = min(1.0, bm * bn / 8192) ** 0.5 * max(0.2, 1.0 - abs(math.log2(w * 1024 / (bm * bn))) * 0.15)
    t_math = bm * bn * (k / sk) / (eff * 2e6)
    hide = 1.0 - 0.5 * (1 - 1 / st) - 0.1 * (bk / 128)
    t_mem = (bm * k / sk * 2 + bn * k / sk * 0.5) / 2.5e4 * hide + (k / sk / bk) * 0.05
    t = waves * max(t_math, t_mem) + 0.3 * (sk - 1) * m * n / 1e5 + 0.1 * st * (bk / 64) * (bm + bn) / 256
    return t * (1 + 0.02 * ((zlib.crc32(config_id(c).encode()) % 1000) / 1000 - 0.5))


def _setup(shape):
    cands = _space(shape[2]).candidates(DeviceLimits())
    costs = {config_id(c): _cost(c, *shape) for c in cands}
    return cands, costs, min(costs.values())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tpe_reaches_5pct_of_exhaustive_optimum_with_a_quarter_of_the_evaluations(shape):
    cands, costs, opt = _setup(shape)
    # The function is not trivially flat: under 1% of configs are within 5% of the optimum.
    assert sum(v <= 1.05 * opt for v in costs.values()) < 0.01 * len(cands)
    calls = []

    def evaluate(c):
        calls.append(config_id(c))
        return costs[config_id(c)]

    # 10% of the evaluations (the issue asks for <= 25%). At this budget random search misses the 5%
    # band in most seeds (best/optimum 1.11, 1.44, 1.01, 1.39 for seeds 0-3 on 1x4096x4096), so the
    # test tells a guided search from a blind one.
    budget = len(cands) // 10
    res = search("tpe", cands, evaluate, Budget(max_evals=budget), seed=0)
    assert res.n_new == len(calls) <= budget <= 0.25 * len(cands)
    assert len(set(calls)) == len(calls), "a point was evaluated twice"
    assert res.best[1] <= 1.05 * opt, f"tpe best {res.best[1]:.4f} vs optimum {opt:.4f}"


def test_exhaustive_finds_the_optimum_and_random_respects_its_budget():
    cands, costs, opt = _setup(SHAPES[0])
    res = search("exhaustive", cands, lambda c: costs[config_id(c)])
    assert res.n_new == len(cands) and res.best[1] == opt
    seen = []
    res = search(
        "random", cands, lambda c: seen.append(config_id(c)) or costs[config_id(c)], Budget(max_evals=37)
    )
    assert res.n_new == 37 and len(set(seen)) == 37
    assert res.best[1] == min(costs[s] for s in seen)


@pytest.mark.parametrize("strategy", ["exhaustive", "random", "tpe"])
def test_known_points_are_not_reevaluated_and_failures_never_win(strategy):
    cands, costs, _ = _setup(SHAPES[1])
    cands = cands[:60]
    known = {config_id(c): costs[config_id(c)] for c in cands[:20]}
    fastest = min(cands[20:], key=lambda c: costs[config_id(c)])
    seen = []

    def evaluate(c):
        seen.append(config_id(c))
        return math.inf if c is fastest else costs[config_id(c)]  # the fastest one "fails its check"

    res = search(strategy, cands, evaluate, Budget(max_evals=40), seed=3, known=known)
    assert not set(seen) & set(known), "a cached point was measured again"
    assert res.n_new == len(seen) == 40
    assert res.best[0] is not fastest and math.isfinite(res.best[1])


def test_time_budget_and_bad_arguments():
    cands, costs, _ = _setup(SHAPES[0])

    def slow(c):
        time.sleep(0.02)
        return costs[config_id(c)]

    t0 = time.monotonic()
    res = search("exhaustive", cands, slow, Budget(max_seconds=0.2))
    assert time.monotonic() - t0 < 2.0 and 3 <= res.n_new < 30  # 0.2 s budget; slack for a loaded machine
    with pytest.raises(CodesignError, match="strategy"):
        search("annealing", cands, slow)
    with pytest.raises(CodesignError, match="no config left"):
        search("tpe", [], slow)
    with pytest.raises(CodesignError, match="max_evals"):
        Budget(max_evals=0)


def test_replayed_cache_of_an_exhaustive_run(tmp_path):
    """The replay path: an exhaustive run recorded in a cache, strategies replayed on its timings."""
    from codesign.autotune.cache import TuningCache
    from codesign.autotune.replay import replay

    cands, costs, opt = _setup(SHAPES[0])
    cache = TuningCache(tmp_path / "c.jsonl")
    ident = {
        "gpu": "G",
        "triton": "3.9.0",
        "source_hash": "h",
        "op": "op",
        "key": "K=4096,N=4096",
        "dtype": "f16",
    }
    for c in cands:
        cache.append({**ident, "m": 1, "config": c, "ok": True, "time_ms": costs[config_id(c)]})
    cache.append(
        {**ident, "m": 1, "config": {**cands[0], "BLOCK_M": 512}, "ok": False, "time_ms": None}
    )  # a failed point
    (row,) = replay(cache.load().records, fraction=0.1, seeds=2)
    assert row["candidates"] == len(cands) + 1 and row["optimum_ms"] == opt
    assert row["tpe"]["within"] == 2 and all(x >= 1.0 for x in row["random"]["best_over_optimum"])
