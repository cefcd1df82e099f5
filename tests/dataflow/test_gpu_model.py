"""GPU target model: calibrated efficiencies reproduce the measured A100 latencies (LLMCompass data).

The GPT-3 layer rows (transformer*_A100.csv) are validation only: nothing is fitted on them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from codesign.catalog.gpus import load_gpu
from codesign.dataflow.gpu_model import (
    a100_rows_by_family,
    by_family,
    efficiencies,
    error_report,
    family,
    fit_family,
    gpu_op_time,
    padded_flops,
)
from codesign.dataflow.llmcompass_ref import (
    GPT3_DECODE_A100,
    GPT3_PREFILL_A100,
    LAYER_ROWS,
    MATMUL_A100,
    gpt3_layer_specs,
    load_llmcompass_csvs,
    measured_a100,
)
from codesign.dataflow.roofline import op_time
from codesign.specs import AllReduce, Gemm, Norm

A100 = load_gpu("a100-80gb")
SHARED = Path(__file__).resolve().parents[3] / "shared" / "reference-data" / "llmcompass-a100-mi210"
# Decode A_mul_V (batched M=1 GEMM, K=2048, N=head_dim=128): the per-op CSVs hold no batched GEMV, and
# the measured 139 us is 1.3x the same-bytes Q_mul_K; see gpu_model's module docstring.
KNOWN_MISSES = {("decode", "A_mul_V")}
GPT3_ROWS = [
    (phase, name, meas)
    for phase, measured in (("prefill", GPT3_PREFILL_A100), ("decode", GPT3_DECODE_A100))
    for name, meas in zip(LAYER_ROWS, measured)
]


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
        meas = GPT3_PREFILL_A100[LAYER_ROWS.index(name)]
        assert gpu_op_time(specs[name], A100) == pytest.approx(meas, rel=0.15), name


def test_families_and_trivial_allreduce():
    assert family(Norm(2, 8)) == "norm"
    assert gpu_op_time(AllReduce(100, 1), A100) == 0.0


@pytest.mark.parametrize(
    "phase, name, measured",
    [
        pytest.param(*r, marks=pytest.mark.xfail(strict=True, reason="no batched-GEMV term"))
        if r[:2] in KNOWN_MISSES
        else r
        for r in GPT3_ROWS
    ],
)
def test_gpt3_layer_rows_within_25_percent(phase, name, measured):
    assert gpu_op_time(gpt3_layer_specs(phase)[name], A100) == pytest.approx(measured, rel=0.25)


def test_stored_efficiencies_are_the_fit():
    # A stale YAML (model changed, not refitted) would silently carry the old calibration.
    stored = efficiencies(A100)
    for fam, rows in a100_rows_by_family().items():
        got, want = fit_family(rows, A100, fam), stored[fam]
        assert got.compute == pytest.approx(want.compute, abs=0.005), fam
        assert got.memory == pytest.approx(want.memory, abs=0.0005), fam
        assert got.overhead_s == pytest.approx(want.overhead_s, abs=1e-8), fam
        for extra in ("sm_share", "row_cache_bytes"):
            g, w = getattr(got, extra), getattr(want, extra)
            assert (g is None) == (w is None) and (w is None or g == pytest.approx(w, rel=1e-3)), (fam, extra)


def test_few_tiles_cannot_draw_the_whole_bandwidth():
    # M=8 decode projections, one wave of 16x128 tiles each: 72 tiles on 108 SMs stream at 72/108 of the
    # bandwidth, so they take as long as 96 tiles with the same per-tile bytes (the measured GPT-3
    # decode QKV, 72 tiles, is slower than W1, 96 tiles with 33% more weight bytes: 212 vs 186 us).
    k = 12288
    few, more = Gemm(8, 72 * 128, k), Gemm(8, 96 * 128, k)
    eff = efficiencies(A100)["matmul"]
    per_tile_s = (128 * k * 2 + 8 * k * 2 * 128 / (72 * 128)) / (A100.mem_bw / A100.sms)
    expect = eff.overhead_s + per_tile_s / eff.sm_share + 8 * 72 * 128 * 2 / (A100.mem_bw * eff.memory)
    assert gpu_op_time(few, A100) == pytest.approx(expect, rel=1e-9)
    assert gpu_op_time(few, A100) > 0.97 * gpu_op_time(more, A100)


def test_wide_norm_rows_cost_more_per_element():
    # Measured A100 LayerNorm (layernorm_A100.csv): 4096 rows of 16384 run at 210 G elements/s, 16384 rows
    # of 4096 at 346 (1.65x the time): the wide rows miss L1 on the second pass. The re-read explains
    # part of it (1.2x); the rest is the family's largest remaining error.
    wide, narrow = Norm(4096, 16384, "layer"), Norm(16384, 4096, "layer")
    assert gpu_op_time(wide, A100) > 1.15 * gpu_op_time(narrow, A100)
    # Rows within the on-chip share are read once: the time is the plain streaming cost.
    e = efficiencies(A100)["norm"]
    small = Norm(1000, 1024, "layer")
    assert gpu_op_time(small, A100) == pytest.approx(
        e.overhead_s + small.min_bytes() / (A100.mem_bw * e.memory), rel=1e-12
    )


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/reference-data/llmcompass-a100-mi210 not present")
def test_copied_rows_match_the_artifact_csvs():
    got = measured_a100()
    want = load_llmcompass_csvs(SHARED, "A100")
    assert [s for s, _ in got] == [s for s, _ in want]
    for (s, t), (_, u) in zip(got, want):
        assert t == pytest.approx(u, rel=2e-3), s


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/reference-data/llmcompass-a100-mi210 not present")
def test_model_form_fits_mi210_too():
    # The same terms refitted on the MI210 CSVs (104 CUs, 1.6 TB/s): the form is not A100-specific.
    mi210 = load_gpu("mi210")
    rows = by_family(load_llmcompass_csvs(SHARED, "MI210"))
    fitted = {**efficiencies(mi210), **{f: fit_family(r, mi210, f) for f, r in rows.items()}}
    rep = error_report({"matmul": rows["matmul"], "norm": rows["norm"]}, mi210, fitted)
    assert rep["matmul"]["mean_err"] < 0.04 and rep["matmul"]["max_err"] < 0.15
    assert rep["norm"]["mean_err"] < 0.10
