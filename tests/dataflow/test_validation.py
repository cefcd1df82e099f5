"""The measured-latency validation set (dataflow/measured_latencies.yaml) and the leave-one-source-out check
of the GPU model against it (issue 23 item 4). The fits run once per module (~6 s): `held_out` (one per
source) and `all_terms` (every serving row)."""

from __future__ import annotations

import pytest
import yaml

from codesign.catalog.gpus import load_gpu
from codesign.dataflow.gpu_model import gpu_op_time
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.serving_terms import TERMS_FILE, Terms, parse_terms, serving_efficiencies
from codesign.dataflow.validation import (
    DATA_FILE,
    EAGER_ENGINES,
    MISS,
    _moves,
    breakdown,
    fit,
    held_out_terms,
    leave_one_source_out,
    load_rows,
    predict,
    serving_rows,
    summary,
    write_terms,
)
from codesign.specs import AllReduce, CodesignError, Gemm

# What the report gives (python -m codesign.dataflow.validation): a regression guard with a small margin.
MEAN_ERR, BEYOND_25 = 0.1060, 3


@pytest.fixture(scope="module")
def rows():
    return load_rows()


@pytest.fixture(scope="module")
def held_out(rows):
    return held_out_terms(rows[0])


@pytest.fixture(scope="module")
def loso(rows, held_out):
    return leave_one_source_out(rows[0], held_out=held_out)


@pytest.fixture(scope="module")
def all_terms(rows):
    return fit(serving_rows(rows[0]))


def test_every_row_carries_its_source_and_setting():
    data = yaml.safe_load(DATA_FILE.read_text())
    assert len(data["rows"]) == 99 and len(data["sources"]) == 10
    for r in data["rows"]:
        assert r["source"] in data["sources"] and r["quote"] and r["where"] and r["setting"], r["id"]
        assert isinstance(r["value"], int | float) and r["value"] > 0, r["id"]
        assert r.get("timer", "engine") == "engine" or r["timer_why"], r["id"]


def test_rows_not_predicted_say_why(rows):
    predictable, skipped = rows
    assert len(predictable) == 98
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
    eff = serving_efficiencies(gpu, 1.0, 1.0)
    want = sum(gpu_op_time(d["spec"], gpu, eff, launch="graph") for _, d in g.nodes(data=True))
    assert predict(row, Terms()) == pytest.approx(want, rel=1e-12)
    assert predict(row, Terms(request_s=2e-3)) == pytest.approx(want + 2e-3, rel=1e-12)
    # The compute factor scales the GEMM rate: a compute-bound 2048-token prefill gets slower at 0.5.
    slower = predict(row, Terms(factors=((("compute", "ampere", "fp16"), 0.5),)))
    assert 1.5 * want < slower < 2.0 * want


def test_eager_engines_take_at_least_the_launch_interval_per_kernel(rows):
    by_id = {r.id: r for r in rows[0]}
    ft = by_id["ft-5"]  # FasterTransformer GPT-20B, tp 1 (no collective): every kernel at a 1 s floor
    assert ft.source in EAGER_ENGINES
    kernels = [(w, sum(n for s, n in specs if not isinstance(s, AllReduce))) for _, w, specs in ft.parts]
    assert predict(ft, Terms(launch_s=1.0)) == pytest.approx(sum(w * k for w, k in kernels), rel=1e-12)
    assert predict(ft, Terms(launch_s=1e-6)) == pytest.approx(
        predict(ft, Terms()), rel=1e-12
    )  # below every kernel
    vllm = by_id["vllm-ci-1"]  # CUDA graphs: no floor
    assert predict(vllm, Terms(launch_s=1.0)) == predict(vllm, Terms())


def test_rocm_rows_take_their_stacks_step_term_and_cuda_rows_the_shared_one(rows, held_out):
    by_id = {r.id: r for r in rows[0]}
    amd, a100 = by_id["amd-vllm-mi300x-1"], by_id["gptfast-2"]  # 2047 / 199 decode steps
    t = Terms(step_s=1e-3, steps=(("rocm", 3e-3),))
    assert t.step("cdna3") == 3e-3 and t.step("ampere") == 1e-3 and Terms(step_s=1e-3).step("cdna3") == 1e-3
    assert predict(amd, t) - predict(amd, Terms()) == pytest.approx(2047 * 3e-3, rel=1e-9)
    assert predict(a100, t) - predict(a100, Terms()) == pytest.approx(199 * 1e-3, rel=1e-9)
    # Held out, each MI300X source takes the ROCm term fitted on the other; no ROCm row, no ROCm term.
    assert all(dict(held_out[s].steps).keys() == {"rocm"} for s in held_out)
    assert fit([r for r in serving_rows(rows[0]) if r.source == "gptfast_a100"]).steps == ()


def test_client_term_is_added_once_to_client_timed_rows_only(rows):
    by_id = {r.id: r for r in rows[0]}
    for rid, timed in (
        ("nim-1", True),
        ("ft-1", True),
        ("lmdeploy-2", True),
        ("nim-2", False),
        ("ft-5", False),
    ):
        r = by_id[rid]
        assert r.client_timed is timed
        assert predict(r, Terms(client_s=0.05)) - predict(r, Terms()) == pytest.approx(0.05 if timed else 0.0)


def test_breakdown_names_the_parts_of_a_prediction(rows):
    ft = next(r for r in rows[0] if r.id == "ft-1")  # GPT-3 175B, tp 8, 128 + 8 tokens
    text = breakdown(ft, Terms())
    # Per rank: 96 layers x 12 h^2 / 8 fp16 weights plus the vocab-parallel head, ~43.6 GB.
    gemm_gb = sum(
        n * s.weight.total_bytes(s.N, s.K) * s.batch for s, n in ft.parts[0][2] if isinstance(s, Gemm)
    )
    assert text.startswith("prefill 1 x ") and "; decode 7 x " in text
    assert text.count(f"weights {gemm_gb / 1e9:.1f} GB") == 2 and 43 < gemm_gb / 1e9 < 44.5


def test_a_term_the_fit_skips_a_row_for_never_moves_that_row(rows, all_terms):
    """`fit` weighs each term on the rows `_moves` names; every other row's prediction must not change with it
    (else the fit would miss errors it should weigh)."""
    serving = serving_rows(rows[0])
    keys = [k for k, _ in all_terms.factors] + [("step", s) for s, _ in all_terms.steps]
    keys += ["step_s", "request_s", "client_s", "launch_s"]
    skipped = 0
    for k in keys:
        moved = all_terms.replace(k, 3.7e-3 if isinstance(k, str) or k[0] == "step" else 0.41)
        for r in serving:
            if not _moves(k, r):
                skipped += 1
                assert predict(r, moved) == predict(r, all_terms), (k, r.id)
    assert skipped > len(keys) * len(serving) // 2  # the filter does skip most pairs


def test_held_out_source_is_judged_by_terms_fitted_without_it(rows, held_out, loso):
    serving = serving_rows(rows[0])
    nvblog = [r for r in serving if r.source == "nvidia_blog_h100_trtllm"]
    others = [r for r in serving if r.source != "nvidia_blog_h100_trtllm"]
    assert held_out["nvidia_blog_h100_trtllm"] == fit(others)
    assert loso[nvblog[0].id] == pytest.approx(predict(nvblog[0], fit(others)) / nvblog[0].seconds)


def test_loso_never_shows_a_source_its_own_rows(rows):
    seen = []

    def spy(train):
        seen.append({r.source for r in train})
        return Terms()

    ratios = leave_one_source_out(rows[0], fitter=spy)
    sources = {r.source for r in serving_rows(rows[0])}
    # One fit per source, each on every other source and never on it.
    assert len(seen) == len(sources) and all(len(sources - s) == 1 for s in seen)
    assert {next(iter(sources - s)) for s in seen} == sources
    assert set(ratios) == {r.id for r in rows[0]}


def test_fitting_on_all_rows_is_a_mutation_the_check_catches(rows, loso, all_terms):
    # Teeth: the same check with the terms fitted on every row (the held-out source included) changes the
    # held-out predictions and flatters the summary.
    leaky = leave_one_source_out(rows[0], fitter=lambda _: all_terms)
    changed = [rid for rid in loso if abs(leaky[rid] - loso[rid]) > 1e-3]
    assert len(changed) > 30 and "trt09-ttft-1" in changed and "amd-vllm-mi300x-1" in changed
    assert summary(leaky, rows[0])["mean"] < summary(loso, rows[0])["mean"] - 0.01


def test_summary_meets_the_issue_target(rows, loso):
    s = summary(loso, rows[0])
    # Issue 23: mean |error| <= 12% leave-one-source-out; the report's 10.6% and 3 rows beyond 25% guarded.
    assert s["rows"] == 84 and s["mean"] <= 0.12
    assert s["mean"] == pytest.approx(MEAN_ERR, abs=0.005) and s["beyond_25"] <= BEYOND_25


def test_every_row_beyond_25_percent_says_why(rows, loso):
    serving = serving_rows(rows[0])
    missed = {r.id for r in serving if abs(loso[r.id] - 1) > MISS}
    explained = {r.id for r in serving if r.known_miss}
    # Reasons exactly on the misses: a reason left on a row the model now meets is stale.
    assert missed == explained, (missed - explained, explained - missed)
    assert all(len(r.known_miss) > 40 for r in serving if r.known_miss)


def test_stored_serving_terms_are_current(all_terms, tmp_path):
    # serving_terms.yaml is generated: `python -m codesign.dataflow.validation --write-terms`.
    stored = parse_terms(TERMS_FILE.read_text())
    assert dict(stored.factors).keys() == dict(all_terms.factors).keys()
    for k, v in all_terms.factors:
        assert stored.factor(k) == pytest.approx(v, abs=1e-4), k
    for k in ("step_s", "request_s", "client_s", "launch_s"):
        assert getattr(stored, k) == pytest.approx(getattr(all_terms, k), abs=1e-9), k
    assert dict(stored.steps).keys() == dict(all_terms.steps).keys() == {"rocm"}
    for k, v in all_terms.steps:
        assert dict(stored.steps)[k] == pytest.approx(v, abs=1e-9), k
    out = tmp_path / "t.yaml"
    write_terms(out, all_terms)
    assert parse_terms(out.read_text()) == stored


def test_bad_file_is_refused(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text(DATA_FILE.read_text().replace("measure: ttft", "measure: vibes", 1))
    with pytest.raises(CodesignError, match="unknown source or measure"):
        load_rows(bad)
    bad.write_text(DATA_FILE.read_text().replace("timer: client", "timer: stopwatch", 1))
    with pytest.raises(CodesignError, match="timer must be engine or client"):
        load_rows(bad)
