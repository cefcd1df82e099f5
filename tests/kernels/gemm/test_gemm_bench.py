"""The quantized-GEMM GPU benchmark entry imports and computes its metrics right (without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_script

from codesign.catalog.gpus import load_gpu
from codesign.specs import Gemm, WeightFormat

BENCH = Path(__file__).resolve().parents[3] / "bench" / "gpu_quant_gemm.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH, "gpu_quant_gemm")


def test_row_metrics_follow_the_spec(bench):
    gpu = load_gpu("h200")
    spec = Gemm(1, 8192, 8192, WeightFormat("int4", 128, False, "bf16"), "bf16", "bf16")
    row = bench._row("square", "8192", 1, 8192, 8192, "w4a16_g128", 0.02, 0.07, 1e-3, spec, gpu)
    # 8192^2 int4 codes + bf16 scale and zero per 128 = 4.25 bits/weight; M=1 activations and output.
    want_bytes = 8192 * 8192 * 4.25 / 8 + 8192 * 2 + 8192 * 2
    assert row["gbs"] == pytest.approx(want_bytes / 0.02e-3 / 1e9)
    assert row["tflops"] == pytest.approx(2 * 8192 * 8192 / 0.02e-3 / 1e12)
    assert row["speedup_vs_bf16"] == pytest.approx(3.5)
    assert row["pct_roofline"] == pytest.approx(100 * want_bytes / gpu.mem_bw / 0.02e-3)


def test_targets_read_the_right_rows(bench):
    """Issue 20's targets: the worst speed-up of each over the rows it names, and W4A16 against gemlite."""
    rows = [
        dict(kernel="w4a16_g128", model="square", layer="8192", M=m, ms=0.01, speedup_vs_bf16=s)
        for m, s in ((1, 2.1), (16, 1.4), (256, 0.95), (4096, 0.92))
    ]
    # W4A16 at another shape does not count toward its N = K = 8192 targets.
    rows += [dict(kernel="w4a16_g128", model="llama2-70b", layer="gate_up", M=256, ms=0.1, speedup_vs_bf16=0.5)]
    rows += [dict(kernel="w8a8_int8", model=mo, layer=la, M=1024, ms=0.1, speedup_vs_bf16=s)
             for mo, la, s in (("square", "8192", 1.7), ("llama2-70b", "gate_up", 1.3))]  # fmt: skip
    # A kernel that failed leaves an error row without a timing: it must not count.
    rows += [dict(kernel="w4a16_g128", model="square", layer="8192", M=1, error="boom", speedup_vs_bf16=0.1)]
    compare = [dict(format="w4a16_g128", model="square", layer="8192", M=m, ours_ms=1.0, peers_ms={"gemlite": g})
               for m, g in ((1, 1.2), (16, 0.9))]  # fmt: skip
    t = bench._targets(rows, compare)
    assert t["w4a16_m1"] == dict(measured=2.1, target=2.0, met=True, at="square 8192 M=1")
    assert t["w4a16_m16"]["measured"] == 1.4 and t["w4a16_m16"]["met"] is False
    assert t["w4a16_m256_up"] == dict(measured=0.92, target=0.9, met=True, at="square 8192 M=4096")
    assert t["w8a8_int8_m1024_up"] == dict(measured=1.3, target=1.4, met=False, at="llama2-70b gate_up M=1024")
    assert t["fp8_m16"] == dict(measured=None, target=1.0, met=None, at=None)  # nothing timed: not met, not missed
    assert t["w4a16_vs_gemlite"] == dict(measured=0.9, target=1.0, met=False, at="M=16")
    assert set(t) == set(bench.TARGETS) | {"w4a16_vs_gemlite"}


def test_run_without_gpu_records_a_skip(bench):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real run belongs to bench/gpu_suite.py")
    report: dict = {}
    bench.run(report)
    assert report == {"quant_gemm": {"skipped": "no CUDA device"}}
