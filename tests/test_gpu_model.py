"""GPU target model: calibrated efficiencies reproduce the measured A100 latencies (LLMCompass data)."""

from __future__ import annotations

import pytest

from codesign.catalog.gpus import load_gpu
from codesign.dataflow.gpu_model import a100_rows_by_family, error_report, family, gpu_op_time, padded_flops
from codesign.dataflow.llmcompass_ref import GPT3_PREFILL_A100, MATMUL_A100, gpt3_layer_specs
from codesign.dataflow.roofline import op_time
from codesign.specs import AllReduce, Gemm, Norm

A100 = load_gpu("a100-80gb")


@pytest.mark.parametrize("m, n, k, measured", MATMUL_A100)
def test_matmul_within_15_percent(m, n, k, measured):
    assert gpu_op_time(Gemm(m, n, k), A100) == pytest.approx(measured, rel=0.15)


def test_model_never_beats_the_roofline():
    for spec, _ in [r for rows in a100_rows_by_family().values() for r in rows]:
        assert gpu_op_time(spec, A100) >= op_time(spec, A100)[0] * 0.999


def test_family_errors_in_sample_and_held_out():
    rows = a100_rows_by_family()
    rep = error_report({"matmul": rows["matmul"]}, A100)["matmul"]
    assert rep["mean_err"] < 0.05 and rep["loo_mean_err"] < 0.05 and rep["loo_max_err"] < 0.15
    for fam in ("softmax", "norm", "elementwise"):
        errs = [abs(gpu_op_time(s, A100) / t - 1) for s, t in rows[fam]]
        assert sum(errs) / len(errs) < 0.15, fam


def test_wave_quantization():
    # 108 tiles fill one wave of an A100; one more tile needs a second wave.
    one = padded_flops(Gemm(128, 108 * 128, 64), A100)
    two = padded_flops(Gemm(128, 109 * 128, 64), A100)
    assert two == 2 * one


def test_gpt3_prefill_large_gemms_within_15_percent():
    specs = gpt3_layer_specs("prefill")
    for name in ("Q_K_V", "Wo_proj", "W1_proj", "W2_proj", "AllReduce_MHA"):
        meas = GPT3_PREFILL_A100[list(specs).index(name)]
        assert gpu_op_time(specs[name], A100) == pytest.approx(meas, rel=0.15), name


def test_families_and_trivial_allreduce():
    assert family(Norm(2, 8)) == "norm"
    assert gpu_op_time(AllReduce(100, 1), A100) == 0.0
