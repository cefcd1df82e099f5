"""Benchmarks: build, map and schedule whole model steps (issue targets: 7B decode < 1 s, 70B prefill < 10 s).

Run: .venv/bin/pytest bench/bench_mapper.py --benchmark-enable
Each round builds a fresh target, so no cost cache survives between rounds.
"""

from __future__ import annotations

import pytest

from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.schedule import schedule
from codesign.dataflow.targets import make_target


def _map(model: str, phase: str, design: str, **kw):
    g = build_step_graph(model, phase, **kw)
    return schedule(g, make_target(design))


@pytest.mark.parametrize("design", ["tpu_like", "hbm_pim", "h100-sxm"])
def test_llama2_7b_decode_step(benchmark, design):
    s = benchmark(_map, "llama-2-7b", "decode", design, batch=8, context=2048)
    assert s.makespan > 0


def test_llama2_70b_prefill_step(benchmark):
    s = benchmark.pedantic(
        _map,
        args=("llama-2-70b", "prefill", "tpu_like"),
        kwargs=dict(batch=1, context=2048, tp=8),
        rounds=1,
        iterations=1,
    )
    assert s.makespan > 0
