"""Design-space exploration: spaces, durable store (resume, kill -9, versions), search, serving sim, report."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from codesign.cli import main
from codesign.dataflow.explore.engine import run_sweep, score
from codesign.dataflow.explore.eval import Workload, evaluate_point, point_target, step_cost
from codesign.dataflow.explore.report import pareto
from codesign.dataflow.explore.search import make_strategy
from codesign.dataflow.explore.space import load_space, point_key, space_from_dict
from codesign.dataflow.explore.store import ResultStore
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.schedule import schedule
from codesign.dataflow.serving import Trace, load_azure_trace, simulate, synthetic_trace
from codesign.dataflow.targets import make_target
from codesign.specs import CodesignError

SMALL = {
    "base": "tpu_like",
    "params": {
        "systolic.rows": [64, 128],
        "systolic.cols": {"same_as": "systolic.rows"},
        "memory.units": [2, 4],
        "format.kv": ["fp16", "int4-kivi"],
    },
    "constraints": {"max_area_mm2": 1000},
}
WL = ["decode:b8:c1024", "trace:synthetic:60:20"]


def test_space_grid_and_validation(tmp_path):
    s = space_from_dict(SMALL)
    assert s.size() == 8 and len({point_key(p) for p in s.grid()}) == 8
    assert all(p["systolic.cols"] == p["systolic.rows"] for p in s.grid())
    assert load_space().size() >= 100
    bad = [
        ({**SMALL, "params": {}}, "non-empty"),
        ({**SMALL, "params": {"systolic.rows": []}}, "no values"),
        ({**SMALL, "params": {"memory.units": {"min": 8, "max": 2}}}, "empty"),
        ({**SMALL, "params": {"systolic.rowz": [64]}}, "rowz"),
        ({**SMALL, "params": {"format.foo": ["x"]}}, "format parameters"),
        # format values are parsed with the space (an unknown one refused only later left a store behind)
        ({**SMALL, "params": {"format.kv": ["fp16", "int9"]}}, "params.format.kv: kv format 'int9'"),
        ({**SMALL, "params": {"format.weight": ["int5-g128"]}}, "params.format.weight"),
        ({**SMALL, "params": {"format.act": ["banana"]}}, "params.format.act"),
        ({**SMALL, "params": {"systolic.cols": {"same_as": "nope"}}}, "unknown parameter"),
        ({**SMALL, "constraints": {"max_speed": 3}}, "constraints.max_speed"),
        ({**SMALL, "extra": 1}, "unknown top-level"),
    ]
    for data, match in bad:
        with pytest.raises(CodesignError, match=match):
            space_from_dict(data, "bad.yaml")


def test_space_file_errors(tmp_path):
    with pytest.raises(CodesignError, match="design space file .*missing.yaml' does not exist"):
        load_space(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("params: [1,\n")
    with pytest.raises(CodesignError, match="broken.yaml: not valid YAML"):
        load_space(tmp_path / "broken.yaml")
    (tmp_path / "base.yaml").write_text("systolic: {rows: [\n")
    with pytest.raises(CodesignError, match="base.yaml: not valid YAML"):
        space_from_dict({**SMALL, "base": str(tmp_path / "base.yaml")}, "space.yaml")


def test_fast_step_cost_matches_schedule():
    """The sequential evaluator equals the HEFT schedule's busy time sum on a chain-shaped decode graph."""
    t = make_target("tpu_like")
    fmt = {"weight": "fp16", "kv": "fp16", "act": "fp16"}
    fast = step_cost(t, "llama-2-7b", "decode", 4, 2048, fmt)["seconds"]
    full = schedule(build_step_graph("llama-2-7b", "decode", 4, 2048), t).makespan
    assert fast == pytest.approx(full, rel=0.02)


def test_store_resume_and_version_refusal(tmp_path):
    s = space_from_dict(SMALL)
    db = tmp_path / "r.sqlite"
    store = ResultStore(db, version="v1")
    st = run_sweep(
        s, "llama-3-8b", WL, make_strategy("grid", s, None), store, engine="inline", progress=False
    )
    assert (st.evaluated, st.reused) == (16, 0) and len(store) == 16
    store.close()
    store = ResultStore(db, version="v1")
    st2 = run_sweep(
        s, "llama-3-8b", WL, make_strategy("grid", s, None), store, engine="inline", progress=False
    )
    assert (st2.evaluated, st2.reused) == (0, 16)
    store.close()
    with pytest.raises(CodesignError, match="written by code version v1"):
        ResultStore(db, version="v2")
    ro = ResultStore(db, version="v2", allow_other_version=True)
    assert ro.read_only and len(ro) == 16
    with pytest.raises(CodesignError, match="read-only"):
        ro.put("k", "w", {}, {})
    n = ro.export_csv(tmp_path / "r.csv")
    assert n == 16 and (tmp_path / "r.csv").read_text().startswith("point_key,workload")
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(CodesignError, match="not a codesign result store"):
        ResultStore(tmp_path / "junk.sqlite")


def test_kill_minus_9_loses_nothing(tmp_path):
    """SIGKILL the explore driver mid-sweep; every stored row survives and the rerun only fills the gap."""
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({**SMALL, "params": {**SMALL["params"], "systolic.count": [1, 2, 4]}}))
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "codesign.cli",
        "explore",
        "--space",
        str(space),
        "--out",
        str(out),
        "--engine",
        "inline",
        "--no-progress",
        "--workload",
        "decode:b8:c1024",
        "--workload",
        "prefill:b1:c512",
    ]
    env = {**os.environ, "CODESIGN_STORE_VERSION": "kill-test"}
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    db = out / "results.sqlite"
    deadline = time.time() + 120
    seen = 0
    while time.time() < deadline and p.poll() is None:
        if db.exists():
            try:
                seen = len(ResultStore(db, version="kill-test"))
            except Exception:
                seen = 0
            if seen >= 4:
                break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    before = ResultStore(db, version="kill-test")
    n_before = len(before)
    keys_before = {(r["point_key"], r["workload"]) for r in before.rows()}
    before.close()
    assert n_before >= min(seen, 4)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    after = ResultStore(db, version="kill-test")
    assert len(after) == 48  # 24 points x 2 workloads, no duplicates
    assert keys_before <= {(r["point_key"], r["workload"]) for r in after.rows()}
    assert f"{48 - n_before} evaluations computed, {n_before} reused" in r.stdout


def test_pool_engine_matches_inline(tmp_path):
    s = space_from_dict(SMALL)
    a = ResultStore(tmp_path / "a.sqlite", version="x")
    b = ResultStore(tmp_path / "b.sqlite", version="x")
    run_sweep(s, "llama-3-8b", WL[:1], make_strategy("grid", s, None), a, engine="inline", progress=False)
    run_sweep(
        s, "llama-3-8b", WL[:1], make_strategy("grid", s, None), b, engine="pool", workers=2, progress=False
    )
    ra = {(r["point_key"], r["workload"]): r["metrics"] for r in a.rows()}
    rb = {(r["point_key"], r["workload"]): r["metrics"] for r in b.rows()}
    assert ra == rb


@pytest.mark.parametrize("strategy", ["random", "tpe"])
def test_budgeted_search_finds_good_points(tmp_path, strategy):
    pytest.importorskip("optuna") if strategy == "tpe" else None
    s = space_from_dict({**SMALL, "params": {**SMALL["params"], "systolic.count": [1, 2, 4, 8]}})
    best_all = max(
        score({w: evaluate_point(s, p, w, "llama-3-8b") for w in WL[:1]}, "throughput", {}) for p in s.grid()
    )
    store = ResultStore(tmp_path / "s.sqlite", version="x")
    st = run_sweep(
        s,
        "llama-3-8b",
        WL[:1],
        make_strategy(strategy, s, 16, seed=1),
        store,
        engine="inline",
        progress=False,
    )
    assert st.points <= 16 and len(store) <= 16
    found = max(score({r["workload"]: r["metrics"]}, "throughput", {}) for r in store.rows())
    assert found >= 0.8 * best_all


def test_pareto_equals_brute_force():
    rng = np.random.default_rng(0)
    pts = [(float(x), float(y), i) for i, (x, y) in enumerate(rng.random((200, 2)))]
    front = pareto(pts, maximize_x=False, maximize_y=True)
    brute = [
        p
        for p in pts
        if not any((q[0] <= p[0] and q[1] >= p[1]) and (q[0] < p[0] or q[1] > p[1]) for q in pts)
    ]
    assert sorted(p[2] for p in front) == sorted(p[2] for p in brute)


def test_serving_simulator_properties():
    tr = synthetic_trace(300, 5.0, seed=3)
    const = simulate(tr, lambda b, c: 0.02, lambda n: 0.0, 10**9)
    assert const.served == 300 and const.rejected == 0
    assert const.tpot_p50_s == pytest.approx(0.02)  # one token per 20 ms iteration
    # Output tokens / time can never exceed max batch / iteration time.
    assert const.throughput_tok_s <= 256 / 0.02
    # A smaller KV cache admits fewer requests at once: lower peak batch, more queueing.
    small = simulate(tr, lambda b, c: 0.02 + 1e-4 * b, lambda n: 1e-5 * n, 3000)
    big = simulate(tr, lambda b, c: 0.02 + 1e-4 * b, lambda n: 1e-5 * n, 10**7)
    assert small.max_batch < big.max_batch and small.ttft_p99_s > big.ttft_p99_s
    huge = Trace(np.array([0.0, 1.0]), np.array([10, 10**6]), np.array([5, 5]))
    assert simulate(huge, lambda b, c: 0.01, lambda n: 0.0, 1000).rejected == 1


def test_serving_10k_requests_quickly():
    tr = synthetic_trace(10_000, 50.0, seed=1)
    t0 = time.perf_counter()
    r = simulate(tr, lambda b, c: 0.005 + 2e-5 * b + 1e-9 * c, lambda n: 2e-5 * n, 400_000)
    assert r.served == 10_000
    assert time.perf_counter() - t0 < 10


def test_azure_trace(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
    )
    tr = load_azure_trace(p)
    assert list(tr.prompt) == [374, 396] and tr.arrival_s[1] == pytest.approx(4.314579, abs=1e-5)
    (tmp_path / "bad.csv").write_text("TIMESTAMP,ContextTokens\n1,2\n")
    with pytest.raises(CodesignError, match="missing column"):
        load_azure_trace(tmp_path / "bad.csv")
    (tmp_path / "neg.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,-2,3\n")
    with pytest.raises(CodesignError, match="line 2: negative"):
        load_azure_trace(tmp_path / "neg.csv")
    with pytest.raises(CodesignError, match="expected decode"):
        Workload.parse("decode:16")


def test_explore_cli_report(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SMALL))
    args = [
        "explore",
        "--space",
        str(space),
        "--out",
        str(tmp_path / "o"),
        "--engine",
        "inline",
        "--no-progress",
        "--workload",
        "decode:b8:c1024",
        "--workload",
        "trace:synthetic:60:20",
        "--export",
        str(tmp_path / "x.csv"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "8 points: 16 evaluations computed" in out
    html = (tmp_path / "o" / "report.html").read_text()
    assert "Pareto front" in html and "h100-sxm" in html and "data:image/png;base64," in html
    assert (tmp_path / "o" / "pareto_throughput_vs_area.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["explore", "--space", str(tmp_path / "missing.yaml")]) == 2
    assert main(["explore", "--model", "llama-99"]) == 2
    assert main(["explore", "--workload", "decode:x"]) == 2


def test_ray_engine_matches_inline(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray", reason="Ray is optional (the [dist] extra)")
    import tempfile

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
    try:
        s = space_from_dict(SMALL)
        a = ResultStore(tmp_path / "a.sqlite", version="x")
        b = ResultStore(tmp_path / "b.sqlite", version="x")
        run_sweep(s, "llama-3-8b", WL[:1], make_strategy("grid", s, None), a, engine="inline", progress=False)
        st = run_sweep(
            s, "llama-3-8b", WL[:1], make_strategy("grid", s, None), b, engine="ray", progress=False
        )
        assert st.evaluated == 8
        ra = {(r["point_key"], r["workload"]): r["metrics"] for r in a.rows()}
        rb = {(r["point_key"], r["workload"]): r["metrics"] for r in b.rows()}
        assert ra == rb
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def test_pim_logic_area_is_its_own_metric():
    # PIM logic sits on the DRAM dies: reported as pim_logic_mm2 (pim.area_mm2), never in area_mm2.
    from codesign.accel_model.pim import area_mm2 as pim_area

    pim = {"preset": "HBM2e", "units": 4, "banks_per_unit": 2, "lanes": 16, "gemv_max_batch": 4}
    deq = {**pim, "dequant": {"bits": [8, 4], "elems_per_cmd": 64, "mac_lanes": 64}}
    s = space_from_dict({"base": "tpu_like", "params": {"pim": [None, pim, deq]}})
    m = {
        p["pim"] and ("dequant" in p["pim"]): evaluate_point(s, p, "decode:b8:c1024", "llama-3-8b")
        for p in s.grid()
    }
    none, plain, front = m[None], m[False], m[True]
    assert none["pim_logic_mm2"] == 0.0
    assert none["area_mm2"] == plain["area_mm2"] == front["area_mm2"]
    assert 0 < plain["pim_logic_mm2"] < front["pim_logic_mm2"]
    designs = {("dequant" in p["pim"]): point_target(s, p).design for p in s.grid() if p["pim"]}
    for k, row in ((False, plain), (True, front)):
        assert row["pim_logic_mm2"] == pytest.approx(sum(pim_area(designs[k].pim).values()))


def test_findings_compare_a_pim_dequant_front_end_with_plain_pim():
    from codesign.dataflow.explore.report import findings

    pim = {"preset": "HBM2e", "units": 4, "banks_per_unit": 2, "lanes": 16, "gemv_max_batch": 4}
    deq = {**pim, "dequant": {"bits": [8, 4], "elems_per_cmd": 64, "mac_lanes": 64}}
    s = space_from_dict(
        {"base": "tpu_like", "params": {"pim": [None, pim, deq], "format.kv": ["fp16", "int4-kivi"]}}
    )
    w = "decode:b16:c4096"  # fits the base design with an fp16 cache too
    rows = [
        {
            "point_key": point_key(p),
            "point": p,
            "workload": w,
            "metrics": evaluate_point(s, p, w, "llama-3-8b"),
        }
        for p in s.grid()
    ]
    got = findings(rows)
    # "Adding PIM" compares the plain PIM with none (fp16 KV), whatever order the points come in.
    assert any(f.startswith(f"{w}: adding PIM units") for f in got)
    deq_line = [f for f in got if "dequant front end vs plain PIM with KV int4-kivi" in f]
    assert len(deq_line) == 1
    ratio = float(deq_line[0].split("tokens/s ")[1].split("x")[0])
    by = {
        (json.dumps(r["point"]["pim"], sort_keys=True), r["point"]["format.kv"]): r["metrics"] for r in rows
    }
    want = by[(json.dumps(deq, sort_keys=True), "int4-kivi")]["tokens_per_s"]
    want /= by[(json.dumps(pim, sort_keys=True), "int4-kivi")]["tokens_per_s"]
    assert (
        ratio == pytest.approx(want, abs=0.006) and ratio > 1.05
    )  # the quantized cache streams from the PIM
