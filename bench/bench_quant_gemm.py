"""CPU benchmarks (pytest-benchmark) of the quantized-GEMM torch paths, the RTN quantizer and importers.

Run: .venv/bin/pytest bench/bench_quant_gemm.py --benchmark-enable
These time the plain-torch CPU implementations (backend "torch") against an fp32 torch.matmul of the
same shape; GPU kernel numbers come from bench/gpu_quant_gemm.py.
"""

from __future__ import annotations

import pytest
import torch

from codesign.backend import use_backend
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import ops as qg

N = K = 1024
FORMATS = {
    "w4a16_g128": (("int4", 128, False), False),
    "w8a16_pc": (("int8", None, True), False),
    "w8a8": (("int8", None, True), True),
    "fp8": (("fp8_e4m3", None, True), False),
}


@pytest.fixture(scope="module")
def weight():
    torch.manual_seed(0)
    return torch.randn(N, K) * 0.02


@pytest.mark.parametrize("m", [1, 64])
def test_bench_fp32_matmul_baseline(benchmark, weight, m):
    x = torch.randn(m, K)
    benchmark(lambda: x @ weight.t())


@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bench_quant_matmul_torch(benchmark, weight, fmt, m):
    args, act_quant = FORMATS[fmt]
    qw = qf.quantize_rtn(weight, *args)
    x = torch.randn(m, K)
    with use_backend("torch"):
        benchmark(lambda: qg.quant_matmul(x, qw, act_quant=act_quant))


@pytest.mark.parametrize("dtype, group", [("int4", 128), ("int8", None), ("fp8_e4m3", None)])
def test_bench_quantize_rtn(benchmark, weight, dtype, group):
    benchmark(lambda: qf.quantize_rtn(weight, dtype, group, True))


def test_bench_act_quant_torch(benchmark):
    x = torch.randn(64, K)
    with use_backend("torch"):
        benchmark(lambda: qg.quantize_per_token_int8(x))
