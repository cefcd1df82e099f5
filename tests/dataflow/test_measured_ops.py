"""The GPU suite's single-operator timings as GPU model rows (`dataflow.measured_ops`, `gpu_model.suite_fit`).

A GPU run is what fills them; here a report planted with the model's own times at known efficiencies must give
those efficiencies back (every family, leave-one-out included), and its layer rows must be read at the specs the
step graph gives them. The bench that writes real reports runs in `tests/test_gpu_suite_smoke.py`.
"""

from __future__ import annotations

import pytest

from codesign.catalog.gpus import load_gpu
from codesign.dataflow.gpu_model import FamilyEfficiency, gpu_op_time, suite_fit
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.llmcompass_ref import OP_SPECS, op_shapes
from codesign.dataflow.measured_ops import calibration_rows, layer_rows
from codesign.specs import CodesignError, Gemm

# Efficiencies on the fit's grids, unlike the catalogue's for any GPU.
PLANTED = {
    "matmul": FamilyEfficiency(0.8, 0.7, 10e-6, sm_share=1.0),
    "softmax": FamilyEfficiency(0.3, 0.6, 8e-6),
    "norm": FamilyEfficiency(0.3, 0.8, 12e-6, row_cache_bytes=16384.0),
    "elementwise": FamilyEfficiency(0.3, 0.75, 9e-6),
}
NODES = ("L0.qkv_proj", "L0.attention", "L0.attn_norm", "L0.act", "L0.down_proj")


def _report(gpu, slower: float = 1.25) -> dict:
    cal = [{"op": op, "dims": list(d), "ms": gpu_op_time(OP_SPECS[op](*d), gpu, PLANTED) * 1e3}
           for op, shapes in op_shapes().items() for d in shapes]  # fmt: skip
    cal.append({"op": "matmul", "dims": [64, 64, 64], "error": "OutOfMemoryError"})  # an untimed row: left out
    layers = []
    for phase, batch, ctx in (("decode", 16, 4096), ("prefill", 1, 2048)):
        g = build_step_graph("llama-3-8b", phase, batch, ctx)
        rows = [{"node": n, "impl": "torch", "ms": gpu_op_time(g.nodes[n]["spec"], gpu, PLANTED) * 1e3 * slower}
                for n in NODES]  # fmt: skip
        layers.append({"model": "llama-3-8b", "phase": phase, "batch": batch, "context": ctx, "rows": rows})
    return {"env": {"gpu": "NVIDIA H200"}, "ops": {"calibration": cal, "layers": layers}}


def test_the_fit_gives_planted_efficiencies_back_and_validates_on_the_layer():
    gpu = load_gpu("h200")
    rep = _report(gpu)
    assert len(calibration_rows(rep)) == sum(len(s) for s in op_shapes().values()) == 84
    fit = suite_fit(rep, gpu)
    for fam, want in PLANTED.items():
        got = fit["efficiencies"][fam]
        assert got.compute == pytest.approx(want.compute)  # (off GEMMs it never binds: the grid's edge, 0.3)
        assert got.memory == pytest.approx(want.memory) and got.overhead_s == pytest.approx(want.overhead_s)
        c = fit["calibration"][fam]
        assert c["loo_max_err"] < 1e-9 and c["max_err"] < 1e-9, (fam, c)
    assert fit["efficiencies"]["matmul"].sm_share == pytest.approx(1.0)
    assert {(r["phase"], r["node"]) for r in fit["layers"]} == {(p, n) for p in ("decode", "prefill") for n in NODES}
    assert all(r["fitted_ratio"] == pytest.approx(0.8) for r in fit["layers"]), fit["layers"]  # measured 1.25x
    # teeth: the calibration times read as seconds where they are ms must not fit
    bad = _report(gpu)
    for r in bad["ops"]["calibration"]:
        if "ms" in r and r["op"] == "gelu":
            r["ms"] *= 1e3
    assert suite_fit(bad, gpu)["calibration"]["elementwise"]["mean_err"] > 0.1


def test_layer_rows_take_the_step_graphs_specs_and_a_stand_in_model():
    import dataclasses

    from codesign.catalog.models import load_model

    rep = _report(load_gpu("h200"))
    rows = layer_rows(rep)
    qkv = next(r for r in rows if r.phase == "decode" and r.node == "L0.qkv_proj")
    assert isinstance(qkv.spec, Gemm) and (qkv.spec.M, qkv.spec.N, qkv.spec.K) == (16, 6144, 4096)
    tiny = dataclasses.asdict(dataclasses.replace(load_model("llama-3-8b"), name="t", layers=1, hidden=256, heads=4,
                                                  kv_heads=2, head_dim=64, ffn=512, vocab=1024))  # fmt: skip
    rep["ops"]["layers"] = [{"model": tiny, "phase": "decode", "batch": 2, "context": 32,
                             "rows": [{"node": "L0.up_proj", "impl": "torch", "ms": 0.5}]}]  # fmt: skip
    (up,) = layer_rows(rep)
    assert (up.spec.M, up.spec.N, up.spec.K) == (2, 1024, 256) and up.seconds == pytest.approx(5e-4)


@pytest.mark.parametrize(
    "ops, match",
    [
        (None, "no 'ops' section"),
        ({"calibration": [{"op": "conv2d", "dims": [1], "ms": 1.0}]}, "conv2d"),
        ({"layers": [{"model": "llama-3-8b", "phase": "decode", "batch": 1, "context": 8,
                      "rows": [{"node": "L0.nope", "impl": "x", "ms": 1.0}]}]}, "no node 'L0.nope'"),  # fmt: skip
    ],
)
def test_a_report_it_cannot_read_is_refused_by_name(ops, match):
    rep = {} if ops is None else {"ops": ops}
    with pytest.raises(CodesignError, match=match):
        calibration_rows(rep) if "layers" not in (ops or {}) else layer_rows(rep)


def test_the_cli_fits_a_suite_report_on_its_gpu(tmp_path, monkeypatch, capsys):
    import json
    import sys

    from codesign.dataflow import gpu_model

    path = tmp_path / "suite.json"
    path.write_text(json.dumps(_report(load_gpu("h200"))))
    monkeypatch.setattr(sys, "argv", ["gpu_model", "--suite", str(path)])
    gpu_model._main()
    out = capsys.readouterr().out
    assert out.startswith("h200: fitted on") and "matmul: {compute: 0.80, memory: 0.700, overhead_us: 10.0" in out
    assert "decode   L0.qkv_proj" in out and "prefill  L0.down_proj" in out
    rep = json.loads(path.read_text())
    rep["env"]["gpu"] = "Some Future GPU"
    path.write_text(json.dumps(rep))
    with pytest.raises(SystemExit, match="no catalogue GPU matches"):
        gpu_model._main()
    monkeypatch.setattr(sys, "argv", ["gpu_model", "--suite", str(path), "--device", "h100-sxm"])
    gpu_model._main()
    assert capsys.readouterr().out.startswith("h100-sxm: fitted on")
