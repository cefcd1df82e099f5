"""The measured-latency validation set (dataflow/measured_latencies.yaml) and the leave-one-source-out check
of the GPU model against it (issue 23 item 4)."""

from __future__ import annotations

import pytest
import yaml

from codesign.catalog.gpus import load_gpu
from codesign.dataflow.gpu_model import gpu_op_time
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.validation import (
    DATA_FILE,
    Terms,
    fit,
    leave_one_source_out,
    load_rows,
    predict,
    summary,
)
from codesign.specs import CodesignError


@pytest.fixture(scope="module")
def rows():
    return load_rows()


def test_every_row_carries_its_source_and_setting():
    data = yaml.safe_load(DATA_FILE.read_text())
    assert len(data["rows"]) == 87 and len(data["sources"]) == 9
    for r in data["rows"]:
        assert r["source"] in data["sources"] and r["quote"] and r["where"] and r["setting"], r["id"]
        assert isinstance(r["value"], int | float) and r["value"] > 0, r["id"]


def test_rows_not_predicted_say_why(rows):
    predictable, skipped = rows
    assert len(predictable) == 86
    assert skipped == [("gptfast-6", "no catalogue GPU for MI250X (1 GCD) (codesign/catalog/gpus.yaml)")]


def test_throughputs_become_generation_times(rows):
    by_id = {r.id: r for r in rows[0]}
    # Static batch (TRT-LLM's out_tps = output x batch / latency / tp): 2048 x 120 / (6944 x 1) s.
    assert by_id["trt09-tput-1"].seconds == pytest.approx(2048 * 120 / 6944)
    # Batch-1 generation throughput: 2048 tokens / 98.92 tok/s, prefill included.
    assert by_id["lmdeploy-6"].seconds == pytest.approx(2048 / 98.92)
    assert by_id["nim-2"].seconds == pytest.approx(18.58e-3)


def test_a_ttft_is_the_gpu_models_prefill_step(rows):
    row = next(r for r in rows[0] if r.id == "trt09-ttft-10")  # A100, Llama-2-7B fp16, batch 1, 2048 tokens
    gpu = load_gpu("a100-80gb")
    g = build_step_graph("llama-2-7b", "prefill", 1, 2048)
    want = sum(gpu_op_time(d["spec"], gpu, launch="graph") for _, d in g.nodes(data=True))
    assert predict(row, Terms()) == pytest.approx(want, rel=1e-12)
    assert predict(row, Terms(request_s=2e-3)) == pytest.approx(want + 2e-3, rel=1e-12)


def test_held_out_source_is_judged_by_terms_fitted_without_it(rows):
    serving = [r for r in rows[0] if r.measure != "op"]
    nvblog = [r for r in serving if r.source == "nvidia_blog_h100_trtllm"]
    others = [r for r in serving if r.source != "nvidia_blog_h100_trtllm"]
    loso = leave_one_source_out(rows[0])
    assert loso[nvblog[0].id] == pytest.approx(predict(nvblog[0], fit(others)) / nvblog[0].seconds)
    s = summary(loso, rows[0])
    # Measured (see the report): mean |error| 12.5%, 9 of 72 serving rows beyond 25%. A regression guard.
    assert s["rows"] == 72 and s["mean"] <= 0.13 and s["beyond_25"] <= 9


def test_bad_file_is_refused(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text(DATA_FILE.read_text().replace("measure: ttft", "measure: vibes", 1))
    with pytest.raises(CodesignError, match="unknown source or measure"):
        load_rows(bad)
