"""The exploration's fast path (shared operator costs, cached designs) gives exactly the reference numbers.

The reference path is the uncached one kept callable: `point_target(space, point)` (no cache) validates
the point's design mapping and calls `accel_model.evaluate` for every (design variant, operator). The
fast path must give bit-identical metrics (same float operations, only computed once), whatever order
points are evaluated in, so every comparison here is `==`, not approximate.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from codesign.accel_model.evaluate import design_fields_read, evaluate
from codesign.dataflow.explore.eval import EvalCache, _interp, evaluate_point, point_target
from codesign.dataflow.explore.space import load_space, space_from_dict
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.targets import DesignTarget

MODEL = "llama-3-8b"
# b1 takes the PIM GEMV path (gemv_max_batch 4 in the spaces below), b64 the arrays; prefill the dense
# attention; the short trace probes decode/prefill costs at many batch sizes and contexts.
WORKLOADS = ["decode:b1:c1024", "decode:b16:c4096", "decode:b64:c2048", "prefill:b1:c512"]
TRACE = "trace:synthetic:40:20"

# Varies every design field evaluate reads, so a wrong cost key in design_fields_read shows up.
WIDE = {
    "base": "tpu_like",
    "params": {
        "node_nm": [7, 16],
        "clock_ghz": [0.8, 1.05],
        "systolic.rows": [64, 128],
        "systolic.cols": [64, 128],
        "systolic.count": [2, 4],
        "systolic.dataflow": ["ws", "os"],
        "memory.preset": ["HBM2e", "HBM3"],
        "memory.units": [2, 4],
        "sram.filter.size_kib": [512, 8192],
        "sram.ofmap.word_bits": [128, 256],
        "vector.lanes": [256, 1024],
        "links.noc_mm": [5, 10],
        "pim": [None, {"preset": "HBM2e", "units": 4, "banks_per_unit": 2, "lanes": 16, "gemv_max_batch": 4}],
        "kv_quant": [None, {"lanes": 64, "depth": 6, "count": 16, "outlier_ports": 2}],
        "format.kv": ["fp16", "int8", "int4-kivi"],
        "format.weight": ["fp16", "int4"],
    },
}


def _pairs(space, n: int, rng: random.Random) -> list[tuple[dict, str]]:
    return [(space.sample(rng), rng.choice(WORKLOADS)) for _ in range(n)]


def _reference(space, point, workload):
    return evaluate_point(space, point, workload, MODEL, point_target(space, point))


def _fast(space, point, workload, cache):
    return evaluate_point(space, point, workload, MODEL, point_target(space, point, cache))


@pytest.mark.parametrize("which", ["default", "wide"])
def test_fast_path_equals_reference(which):
    """~24 (point, workload) pairs: identical metric dicts, cold and warm shared caches, any order."""
    space = load_space() if which == "default" else space_from_dict(WIDE, "wide")
    rng = random.Random(random.getrandbits(32))
    pairs = _pairs(space, 24, rng)
    ref = [_reference(space, p, w) for p, w in pairs]
    assert any(m["fits"] for m in ref) and len({m["step_s"] for m in ref}) > 12  # varied, real numbers
    cache = EvalCache()
    cold = [_fast(space, p, w, cache) for p, w in pairs]
    order = list(range(len(pairs)))
    rng.shuffle(order)
    warm = {i: _fast(space, *pairs[i], cache) for i in order}
    for i, r in enumerate(ref):
        assert cold[i] == r, pairs[i]
        assert warm[i] == r, pairs[i]


def test_fast_path_equals_reference_on_trace():
    """Serving traces query many step shapes through one target: same metrics as the reference."""
    space = load_space()
    rng = random.Random(random.getrandbits(32))
    for point in (space.sample(rng), space.sample(rng)):
        assert _fast(space, point, TRACE, EvalCache()) == _reference(space, point, TRACE)


def test_fast_design_equals_validated_design():
    """The cached, renamed design is the design the point's mapping validates to (name included)."""
    space = space_from_dict(WIDE, "wide")
    rng = random.Random(random.getrandbits(32))
    point = space.sample(rng)
    other_fmt = {**point, "format.kv": "int8" if point["format.kv"] != "int8" else "fp16"}
    cache = EvalCache()
    for p in (point, other_fmt, point):
        fast, ref = point_target(space, p, cache), point_target(space, p)
        assert fast.design == ref.design and fast.name == ref.name
        assert fast.design.area_mm2() == ref.design.area_mm2()
    assert point_target(space, point, cache).name != point_target(space, other_fmt, cache).name


def _specs() -> list:
    out = {}
    for phase, batch, ctx, kv, wf in (
        ("decode", 2, 1024, "fp16", "fp16"),
        ("decode", 16, 4096, "int4-kivi", "int4"),
        ("prefill", 1, 256, "int8", "fp16"),
    ):
        g = build_step_graph("mixtral-8x7b", phase, batch, ctx, weight_format=wf, kv_format=kv, tp=2)
        for _, d in g.nodes(data=True):
            out.setdefault(type(d["spec"]).__name__ + str(len(out) % 3), d["spec"])
    return list(out.values())


def test_design_fields_read_contract():
    """Designs that read the same fields for a spec and agree on them give equal evaluate(spec)."""
    space = space_from_dict(WIDE, "wide")
    rng = random.Random(random.getrandbits(32))
    specs = _specs()
    kinds = {type(s).__name__ for s in specs}
    assert {"Gemm", "PagedDecodeAttention", "AllReduce", "MoERouter", "KVWrite", "Embedding"} <= kinds
    checked = 0
    for _ in range(6):
        a = point_target(space, space.sample(rng)).design
        b = point_target(space, space.sample(rng)).design
        for spec in specs:
            fields = design_fields_read(a.pim is not None, a.pim_gemv_max_batch, spec)
            mixed = dataclasses.replace(b, name="mixed", **{f: getattr(a, f) for f in fields})
            # The cost key holds the field list too: designs reading other fields never share a cost.
            if design_fields_read(mixed.pim is not None, mixed.pim_gemv_max_batch, spec) != fields:
                continue
            assert evaluate(mixed, spec) == evaluate(a, spec), (type(spec).__name__, fields)
            checked += 1
    assert checked >= 4 * len(specs)


def test_shared_cache_clear_keeps_old_targets_correct():
    """Tokens are never reused: a target made before a clear still gets its own design's costs."""
    space = load_space()
    pts = space.grid()
    cache = EvalCache()
    t_old = point_target(space, pts[0], cache)
    evaluate_point(space, pts[0], WORKLOADS[1], MODEL, t_old)
    cache.clear()
    evaluate_point(space, pts[-1], WORKLOADS[1], MODEL, point_target(space, pts[-1], cache))
    fresh = DesignTarget(t_old.design, cache=cache.costs)  # new candidates, old interned tokens
    fresh._tokens = dict(t_old._tokens)
    assert evaluate_point(space, pts[0], WORKLOADS[2], MODEL, fresh) == _reference(
        space, pts[0], WORKLOADS[2]
    )


def test_interp_is_bit_identical_to_numpy():
    """The serving simulator's scalar interpolation equals float(np.interp(...)) bit for bit."""
    rng = np.random.default_rng(random.getrandbits(32))
    for xs in ([1, 4, 16, 64, 256], [128, 512, 2048, 8192], [1, 2]):
        for _ in range(300):
            ys = list(rng.standard_normal(len(xs)) * 10.0 ** rng.integers(-12, 3))
            if rng.random() < 0.3:
                ys[1] = ys[0]  # flat segment
            queries = [*xs, 0, int(rng.integers(1, xs[-1] + 1)), float(rng.uniform(0, xs[-1])), math.nan]
            for x in queries:
                want = float(np.interp(x, xs, ys))
                got = _interp(xs, ys, x)
                assert got == want or (math.isnan(got) and math.isnan(want)), (xs, ys, x, got, want)
    assert _interp([1, 4], [1.0, 2.0], 8) == 2.0 * 8 / 4  # beyond the last point: through the origin
