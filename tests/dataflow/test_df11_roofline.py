"""DF11 weights on GPUs in the roofline and the mapper: compressed bytes, plus a decode-throughput roof
when one is given (off by default: the roofline stays a lower bound until a GPU measures the decoder).

Numbers are re-derived by hand from the catalogue figures (H100 SXM: 3.35 TB/s HBM3, 989.4 TFLOP/s
dense fp16) and issue 11's decode figure (roofline.DF11_DECODE_BW, 200 GB/s of bf16 output).
"""

from __future__ import annotations

import pytest

from codesign.catalog.gpus import load_gpu
from codesign.dataflow.graph import build_step_graph
from codesign.dataflow.roofline import DF11_DECODE_BW, df11_decode_s, op_time, roofline
from codesign.dataflow.targets import GPUTarget
from codesign.specs import Gemm, Norm, WeightFormat

DF11 = WeightFormat("df11", avg_bits=10.75)
H100 = load_gpu("h100-sxm")


def test_decode_roof_for_df11_gemv():
    spec = Gemm(1, 4096, 4096, weight=DF11)
    # 4096^2 weights x 2 B / 200 GB/s = 167.77 us; the stream 8192 + 22,544,384 + 8192 B / 3.35 TB/s = 6.735 us.
    assert DF11_DECODE_BW == 200e9
    assert df11_decode_s(spec, DF11_DECODE_BW) == pytest.approx(4096**2 * 2 / 200e9)
    assert df11_decode_s(spec, None) == 0.0
    assert op_time(spec, H100, DF11_DECODE_BW) == (pytest.approx(167.77216e-6), "decode")
    assert op_time(spec, H100) == (pytest.approx(22_560_768 / 3.35e12), "memory")  # default: no decoder roof
    # With a decoder as fast as the memory (the fused-kernel goal), only the compressed bytes count:
    # 22,560,768 / 33,570,816 B of the bf16 GEMV = 0.672 of its time.
    t, bound = op_time(spec, H100, decode_bw=1e15)
    dense, _ = op_time(Gemm(1, 4096, 4096, weight=WeightFormat("bf16")), H100)
    assert bound == "memory" and t == pytest.approx(22_560_768 / 3.35e12)
    assert t / dense == pytest.approx(22_560_768 / 33_570_816)


def test_decode_roof_only_for_df11_gemms():
    assert df11_decode_s(Gemm(1, 64, 64), DF11_DECODE_BW) == 0.0 and df11_decode_s(Norm(4, 64), 1e9) == 0.0
    # A big prefill GEMM stays compute-bound: 2 x 16384 x 4096^2 / 989.4e12 = 555.7 us > 167.8 us decode.
    t, bound = op_time(Gemm(16384, 4096, 4096, weight=DF11), H100, DF11_DECODE_BW)
    assert bound == "compute" and t == pytest.approx(2 * 16384 * 4096**2 / 989.4e12)


def test_roofline_report_and_mapper_use_the_decode_roof():
    g = build_step_graph("llama-3-8b", "decode", 1, 1024, weight_format=DF11)
    rep = roofline(g, H100, decode_bw=DF11_DECODE_BW)
    df11_rows = [r for r in rep.rows if "df11" in r.example]  # the projections; lm_head stays fp16
    assert {r.op for r in df11_rows} == {"qkv_proj", "o_proj", "up_proj", "down_proj"}
    assert all(r.bound == "decode" for r in df11_rows)
    fast = roofline(g, H100, decode_bw=1e15)
    assert all(r.bound != "decode" for r in fast.rows) and fast.total_time_s < rep.total_time_s
    assert roofline(g, H100).total_time_s == pytest.approx(fast.total_time_s)  # default: no decoder roof
    target = GPUTarget(H100, df11_decode_bw=DF11_DECODE_BW)
    spec = Gemm(1, 4096, 4096, weight=DF11)
    (p,) = target.candidates(spec)
    assert p.bound == "decode" and p.seconds == pytest.approx(df11_decode_s(spec, DF11_DECODE_BW))
    (d,) = GPUTarget(H100).candidates(spec)
    assert d.bound != "decode" and d.seconds < p.seconds
    assert p.traffic["dram"] == spec.min_bytes()
    (q,) = target.candidates(Gemm(1, 4096, 4096, weight=WeightFormat("bf16")))
    assert q.bound != "decode" and q.seconds < p.seconds
