"""bench/merge_predict.py: a layer's projections apart and merged, summed as stated (the launch gap between launches
apart, none inside a merged one), and the committed prediction reproduced from the sm_90 lowering (compile-only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "merge_predict.py"
COMMITTED = ROOT / "bench" / "results" / "merge_predict_sm90.json"


@pytest.fixture(scope="module")
def mp():
    return load_script(SCRIPT, "merge_predict")


def test_sums_apart_and_merged(mp, monkeypatch):
    """Stand-in predictions by shape: q / k / v apart = q + 2 kv + 2 gaps, merged = qkv; the step saves 32 layers'
    difference; only the default variant's rows count."""
    times = {"8b-q": 4.0, "8b-kv": 2.0, "8b-qkv": 5.0, "8b-gate": 10.0, "8b-gate_up": 19.0}

    def fake(ops, ms, shapes, variants, log, extra_shapes):
        assert extra_shapes == mp.SHAPES and set(shapes) == set(mp.SHAPES)
        cases = [{"shape": s, "op": o, "M": m, "variant": v, "default": v == "gemv",
                  "predicted_ms": t if v == "gemv" else t / 10} for s, t in times.items() for o in ops for m in ms
                 for v in ("gemv", "splitk")]  # fmt: skip
        return {"gpu": "test", "launch_gap_ms": 0.5, "cases": cases}

    monkeypatch.setattr(mp.gp, "predict", fake)
    (row,) = mp.predict(("w4a16_g128",), (1,), log=None)["rows"]
    qkv, gu = row["groups"]["q / k / v"], row["groups"]["gate / up"]
    assert (qkv["apart_ms"], qkv["merged_ms"], gu["apart_ms"], gu["merged_ms"]) == (9.0, 5.0, 20.5, 19.0)
    assert row["apart_ms"] == 29.5 and row["merged_ms"] == 24.0
    assert row["saved_ms_per_step"] == pytest.approx(5.5 * 32) and row["speedup"] == pytest.approx(29.5 / 24)


def test_committed_report_is_consistent():
    rows = json.loads(COMMITTED.read_text())["rows"]
    assert {(r["op"], r["M"]) for r in rows} == {(o, m) for o in ("w4a16_g128", "w8a16_pc", "w8a8_int8", "fp8")
                                                 for m in (1, 16)}  # fmt: skip
    for r in rows:
        assert r["merged_ms"] < r["apart_ms"]
        assert r["saved_ms_per_step"] == pytest.approx((r["apart_ms"] - r["merged_ms"]) * 32)


@pytest.mark.lowering
def test_reproduces_the_committed_prediction(tmp_path):
    """W4A16 at M = 1 from the sm_90 lowering: the committed rows (the GEMV apart and merged)."""
    out = tmp_path / "m.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = [sys.executable, str(SCRIPT), "--ops", "w4a16_g128", "--ms", "1", "--out", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (got,) = json.loads(out.read_text())["rows"]
    want = next(r for r in json.loads(COMMITTED.read_text())["rows"] if (r["op"], r["M"]) == ("w4a16_g128", 1))
    assert got["groups"]["q / k / v"]["merged_variant"] == "gemv"
    assert got["apart_ms"] == pytest.approx(want["apart_ms"], rel=1e-9)
    assert got["merged_ms"] == pytest.approx(want["merged_ms"], rel=1e-9)


def test_the_docs_table_is_the_committed_prediction():
    """docs/results.md's merged-projection table: every row's times, ratios and step savings from the JSON."""
    names = {"W4A16 g128": "w4a16_g128", "W8A16": "w8a16_pc", "W8A8": "w8a8_int8", "FP8": "fp8"}
    rows = {(r["op"], r["M"]): r for r in json.loads(COMMITTED.read_text())["rows"]}
    lines = [ln for ln in (ROOT / "docs" / "results.md").read_text().splitlines()
             if ln.startswith("| ") and ln.split("|")[1].strip() in names and ln.count("|") == 10]  # fmt: skip
    assert len(lines) == len(names)
    for ln in lines:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        for m, (apart, merged, ratio, step) in ((1, cells[1:5]), (16, cells[5:9])):
            r = rows[(names[cells[0]], m)]
            assert float(apart) == round(r["apart_ms"] * 1e3, 1) and float(merged) == round(r["merged_ms"] * 1e3, 1)
            assert float(ratio) == round(r["speedup"], 2)
            assert step == f"−{r['saved_ms_per_step'] * 1e3:.0f} us"
