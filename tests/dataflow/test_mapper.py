"""Mapping and scheduling of step graphs: dependencies, unit exclusivity, placement by cost, pins, reports."""

from __future__ import annotations

import json

import networkx as nx
import pytest

from codesign.catalog.gpus import load_gpu
from codesign.cli import main
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.reports import check_fits, chrome_trace, per_op, per_unit, totals
from codesign.dataflow.roofline import roofline
from codesign.dataflow.schedule import schedule
from codesign.dataflow.targets import GPUTarget, Placement, make_target
from codesign.specs import CodesignError, Elementwise


def _check_valid(g: nx.DiGraph, s, units: dict[str, int]) -> None:
    end = {sl.node: sl.end for sl in s.slots}
    start = {sl.node: sl.start for sl in s.slots}
    assert set(end) == set(g.nodes)
    for u, v in g.edges:
        assert start[v] >= end[u] - 1e-15, f"{v} starts before its input {u} ends"
    for unit, k in units.items():
        iv = sorted((sl.start, sl.end) for sl in s.slots if sl.unit == unit)
        # at most k operators on a unit at any time
        events = sorted([(a, 1) for a, _ in iv] + [(b, -1) for _, b in iv], key=lambda e: (e[0], e[1]))
        live = 0
        for _, d in events:
            live += d
            assert live <= k, f"unit {unit} oversubscribed"


@pytest.mark.parametrize("target", ["h100-sxm", "tpu_like", "hbm_pim"])
def test_schedule_respects_dependencies_and_units(target):
    t = make_target(target)
    g = build_step_graph("llama-2-7b", "decode", batch=2, context=[300, 1000], tp=1)
    s = schedule(g, t)
    _check_valid(g, s, t.units())
    assert s.makespan >= max(sl.end - sl.start for sl in s.slots)
    assert s.energy_j > 0


def test_parallel_branches_do_not_share_a_units_instances():
    # Qwen-MoE's shared expert runs beside the routed experts. The evaluator spreads each GEMM over all
    # of the design's systolic arrays, so the two branches must take turns: no unit is busy more than
    # 100 % of the step, and the step is no shorter than the sum of its systolic work.
    t = make_target("tpu_like")
    g = build_step_graph("qwen1.5-moe-a2.7b", "decode", batch=8, context=2048)
    s = schedule(g, t)
    _check_valid(g, s, {u: 1 for u in t.units()})
    for row in per_unit(s):
        assert row["utilisation"] <= 1 + 1e-9, row
    systolic = sum(sl.end - sl.start for sl in s.slots if sl.unit == "systolic")
    assert s.makespan >= systolic * (1 - 1e-9)


def test_gpu_target_sits_above_roofline_and_overlaps_links():
    gpu = load_gpu("h100-sxm")
    g = build_step_graph("llama-2-7b", "decode", batch=1, context=4096)
    s = schedule(g, GPUTarget(gpu))
    roof = roofline(g, gpu).total_time_s
    assert roof <= s.makespan <= 1.6 * roof  # 4.6 ms roofline; CUDA-graph launches + measured efficiencies
    g4 = build_step_graph("llama-2-70b", "decode", batch=8, context=2048, tp=4)
    s4 = schedule(g4, GPUTarget(gpu))
    assert {sl.unit for sl in s4.slots} == {"gpu", "link"}


def test_placement_by_cost_and_pins():
    t = make_target("hbm_pim")
    g = build_step_graph("llama-2-7b", "decode", batch=4, context=4096)
    free = schedule(g, t)
    alt = [p.unit for p in t.candidates(g.nodes["L0.attention"]["spec"]) if p.unit != "pim"]
    assert len(alt) == 1  # the design without its PIM units gives the other placement
    pinned = schedule(g, t, pins={"attention": alt[0]})
    units = {sl.op: sl.unit for sl in free.slots}
    assert units["attention"] == "pim"  # long-context decode attention goes near memory
    assert {sl.unit for sl in pinned.slots if sl.op == "attention"} == {alt[0]}
    assert pinned.makespan > free.makespan
    with pytest.raises(CodesignError, match="cannot run on pinned unit"):
        schedule(g, t, pins={"attn_norm": "pim"})
    with pytest.raises(CodesignError, match="not in target"):
        schedule(g, t, pins={"attention": "tpu"})


class _TwoUnitTarget:
    """A toy target with a fast, hungry unit and a slow, frugal one."""

    name = "toy"

    def units(self):
        return {"fast": 1, "slow": 1}

    def candidates(self, spec):
        return (Placement("fast", 1.0, 0.0, 10.0), Placement("slow", 3.0, 0.0, 1.0))


def test_objectives_and_parallel_branches():
    g = nx.DiGraph(model="toy", phase="decode", batch=1, tokens=1)
    for n in "abc":
        g.add_node(n, spec=Elementwise("add", 1), op=n, layer=None)
    lat = schedule(g, _TwoUnitTarget())
    # Three independent ops: HEFT uses both units (fast, fast, slow in parallel) -> makespan 3.
    assert lat.makespan == pytest.approx(3.0)
    en = schedule(g, _TwoUnitTarget(), objective="energy")
    assert {sl.unit for sl in en.slots} == {"slow"} and en.makespan == pytest.approx(9.0)
    g.add_edge("a", "b")
    g.add_edge("b", "a")
    with pytest.raises(CodesignError, match="cycle"):
        schedule(g, _TwoUnitTarget())


def test_does_not_fit():
    g = build_step_graph("llama-2-70b", "decode", batch=1, context=4096)
    with pytest.raises(CodesignError, match=r"does not fit on rtx-4090: weights 13\d\.\d GB"):
        check_fits(g, load_gpu("rtx-4090").mem_bytes, "rtx-4090")
    check_fits(build_step_graph("llama-2-7b", "decode", 1, 1024), load_gpu("rtx-4090").mem_bytes, "rtx-4090")


def test_reports_and_trace():
    g = build_step_graph("llama-3-8b", "decode", batch=2, context=512)
    s = schedule(g, make_target("h100-sxm"))
    rows = per_op(s)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert {u["unit"] for u in per_unit(s)} == {"gpu"}
    t = totals(s)
    assert t["tokens_per_s"] == pytest.approx(2 / s.makespan)
    tr = chrome_trace(s)
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == g.number_of_nodes() and all(e["dur"] >= 0 for e in xs)
    json.dumps(tr)


def test_map_cli(tmp_path, capsys):
    rc = main(
        [
            "map",
            "--design",
            "h100-sxm",
            "--model",
            "llama-2-7b",
            "--context",
            "1024",
            "--json",
            str(tmp_path / "m.json"),
            "--trace",
            str(tmp_path / "t.json"),
            "--plot",
            str(tmp_path / "g.png"),
        ]
    )
    assert rc == 0
    assert "tokens/s" in capsys.readouterr().out
    assert json.loads((tmp_path / "m.json").read_text())["totals"]["latency_s"] > 0
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["map", "--design", "rtx-4090", "--model", "llama-2-70b"]) == 2
    assert main(["map", "--pin", "attention"]) == 2
    assert main(["map", "--design", "no_such_design"]) == 2


def test_map_cli_tiling(tmp_path, capsys):
    assert (
        main(
            [
                "map",
                "--design",
                "tpu_like",
                "--model",
                "llama-2-7b",
                "--batch",
                "4",
                "--context",
                "256",
                "--tiling",
                "--json",
                str(tmp_path / "m.json"),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "m.json").read_text())["tilings"]
    assert {r["op"] for r in rows} >= {"qkv_proj", "o_proj", "up_proj", "down_proj", "lm_head"}
    assert "order" in capsys.readouterr().out
    assert main(["map", "--design", "h100-sxm", "--tiling"]) == 2
