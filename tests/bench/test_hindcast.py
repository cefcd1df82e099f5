"""bench/hindcast.py from the committed launches of the kernels the H200 timed on 2026-11-30: the bands the docs
quote (measured / predicted over the 51 timings, the issue count's miss on the INT formats) come out of today's
predictor, and the committed report is what it computes."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(BENCH))
    hc = importlib.import_module("hindcast")
    rows = hc.predict_rows(hc.load_launches())
    return hc, rows, hc.summary(rows)


def test_the_scheduler_model_predicts_the_measured_decode_within_its_band(report):
    _, rows, _ = report
    timed = [r for r in rows if r.get("measured_ms") and "predicted_ms" in r]
    kept = [r for r in timed if "kivi" not in r["format"] and "oaken" not in r["format"]]
    assert len(timed) == 56 and len(kept) == 51
    ratio = sorted(r["measured_ms"] / r["predicted_ms"] for r in kept)
    assert 0.65 <= ratio[0] and ratio[-1] <= 2.1 and 0.95 <= ratio[len(ratio) // 2] <= 1.15
    # the issue count alone: 2.3x or more below every measured INT8 / INT4 / INT2 / mixed timing
    ints = [r for r in kept if r["format"] in ("int8", "int4", "int2", "mixed-8/4/4/2")]
    assert len(ints) == 21 and min(r["measured_ms"] / r["issue_model_ms"] for r in ints) >= 2.3
    assert all(r["measured_ms"] / r["predicted_ms"] <= 2.1 for r in ints)


def test_the_committed_report_is_what_the_predictor_computes(report):
    _, _, summary = report
    committed = json.loads((BENCH / "results" / "hindcast_sm90.json").read_text())["summary"]
    assert json.dumps(summary, sort_keys=True) == json.dumps(committed, sort_keys=True)


def test_the_tree_over_extend_ratio_is_predicted(report):
    """The old one-phase tree (64 nodes over 4k, batch 16) ran 3.32x the causal extend beside it; simulated, 3.51x
    (each launch 1.29 / 1.36x below its measured time); the issue count said 2.89x. The committed numbers are these."""
    hc, _, _ = report
    t = hc.tree_rows(hc.load_launches())
    assert t["ratio_measured"] == pytest.approx(3.32, abs=0.01)
    assert 3.3 <= t["ratio_predicted"] <= 3.7 and t["ratio_issue_model"] < 3.0
    assert 1.2 <= t["tree_measured_over_predicted"] <= 1.45 and 1.2 <= t["extend_measured_over_predicted"] <= 1.45
    committed = json.loads((BENCH / "results" / "hindcast_sm90.json").read_text())["tree"]
    assert json.dumps(t, sort_keys=True) == json.dumps(committed, sort_keys=True)
