"""PIM model: calibration to HBM-PIM's 1.2 TFLOPS and AttAcc's up-to-2.81x, hand-checked GEMV timing."""

from __future__ import annotations

import pytest

from codesign.accel_model.design import load_design
from codesign.accel_model.dram import dram_preset, stream_access
from codesign.accel_model.evaluate import evaluate
from codesign.accel_model.pim import PIMSpec, decode_attention, gemv, supports
from codesign.specs import (
    AllReduce,
    CodesignError,
    Elementwise,
    Gemm,
    KVFormat,
    KVWrite,
    Norm,
    PagedDecodeAttention,
    WeightFormat,
)


def hbm_pim(stacks: int = 1) -> PIMSpec:
    return PIMSpec(dram_preset("HBM2", stacks), banks_per_unit=2, lanes=16)


def test_hbm_pim_peak_is_1_2_tflops():
    # Kwon et al., ISSCC 2021: "1.2 TFLOPS" FP16 per stack at 300 MHz; 128 units (one per bank pair).
    p = hbm_pim()
    assert p.units == 128
    assert 1e3 / p.t_col_ns == pytest.approx(300.0)  # MHz: the tCCD_L pace
    assert p.peak_gflops == pytest.approx(1200, rel=0.03)


def test_gemv_time_matches_hand_calculation():
    # 4096 x 4096 fp16 = 32 MiB over 128 units: 262144 B each = 8192 columns of 32 B, 256 rows of 1 KB.
    # t = 8192 x 3.333 ns + 256 x (nRP 17 + nRCD 17) x 0.8333 ns (each row: ACT, its columns, PRE)
    #   = 27306.7 + 7253.3 = 34560.0 ns, / (1 - (6 + 17 + 192 + 17) / 4680) refresh = 36362.6 ns.
    r = gemv(hbm_pim(), Gemm(1, 4096, 4096))
    assert r.pim_ns == pytest.approx(34560.0 / (1 - 232 / 4680), rel=1e-5)
    assert r.macs == 4096 * 4096
    # Input broadcast: 8 KiB to every pseudo-channel in parallel at 19.2 GB/s = 426.7 ns; outputs 8 KiB
    # at 307.2 GB/s = 26.7 ns.
    assert r.io_ns == pytest.approx(8192 / 19.2 + 8192 / 307.2, rel=1e-6)


def test_gemv_beats_host_streaming_by_less_than_internal_bandwidth_ratio():
    p = hbm_pim()
    spec = Gemm(1, 4096, 4096)
    host_ns = stream_access(p.memory, int(spec.min_bytes())).ns
    speedup = host_ns / gemv(p, spec).ns
    ratio = p.internal_gbps / p.memory.peak_gbps  # 4x for HBM-PIM
    assert 2.0 < speedup < ratio
    # Batch 4 costs 4 MAC slots per column: PIM loses its edge as the batch grows.
    assert gemv(p, Gemm(4, 4096, 4096)).pim_ns > 3 * gemv(p, spec).pim_ns


def _gpt3_layer_share(b: int, ctx: int, tp: int = 8) -> list:
    """One GPT-3 175B layer on one of 8 tensor-parallel devices (hidden 12288, 96 heads of 128)."""
    h, heads, d = 12288, 96 // tp, 128
    return [
        Norm(b, h),
        Gemm(b, 3 * h // tp, h),
        KVWrite(b, heads, d),
        PagedDecodeAttention(heads, heads, d, context_lens=(ctx,) * b),
        Gemm(b, h, h // tp),
        AllReduce(b * h, tp),
        Norm(b, h),
        Gemm(b, 4 * h // tp, h),
        Elementwise("gelu", b * 4 * h // tp),
        Gemm(b, h, 4 * h // tp),
        AllReduce(b * h, tp),
    ]


def test_attacc_speedup_lands_near_published_2_81x():
    # AttAcc (Park et al., ASPLOS 2024): up to 2.81x decode throughput over the DGX A100 baseline on
    # GPT-3 175B. Here: gpu_like (an A100) vs attacc_like (the same A100 + HBM3 PIM per bank for
    # attention), one tensor-parallel layer share, over the regime AttAcc targets (batch 64-128,
    # context 2048-4096). This is not a reproduction of AttAcc's set-up (its gain also comes from the
    # larger batches its PIM capacity allows), so the check is a range: the published figure lies
    # inside the model's range of speedups, and the model's best case is within 1.5x of it.
    gpu, att = load_design("gpu_like"), load_design("attacc_like")
    ratios = []
    for b in (64, 128):
        for ctx in (2048, 4096):
            ops = _gpt3_layer_share(b, ctx)
            ratios.append(
                sum(evaluate(gpu, o).seconds for o in ops) / sum(evaluate(att, o).seconds for o in ops)
            )
    assert min(ratios) < 2.81 < max(ratios) < 1.5 * 2.81
    # The attention op alone can gain at most the PIM's internal over the GPU's external bandwidth.
    attn = _gpt3_layer_share(128, 4096)[3]
    gain = evaluate(gpu, attn).seconds / evaluate(att, attn).seconds
    assert 1 < gain < att.pim.internal_gbps / gpu.memory.peak_gbps


def test_decode_attention_phases_and_gqa_reuse():
    p = PIMSpec(dram_preset("HBM3", 2), banks_per_unit=1)
    mha = decode_attention(p, PagedDecodeAttention(32, 32, 128, context_lens=(1000, 37, 2049)))
    gqa = decode_attention(p, PagedDecodeAttention(32, 8, 128, context_lens=(1000, 37, 2049)))
    tokens = 1000 + 37 + 2049
    assert mha.bank_bytes == 2 * tokens * 32 * 128 * 2  # K and V, fp16
    assert gqa.bank_bytes == mha.bank_bytes / 4
    assert gqa.macs == mha.macs  # same arithmetic, 4x less KV read
    assert gqa.pim_ns < mha.pim_ns
    assert mha.host_ops[0].cols == tokens * 32  # softmax over every score on the host


def test_unsupported_formats_are_refused():
    p = hbm_pim()
    q = PagedDecodeAttention(8, 8, 64, context_lens=(10,), kv_format=KVFormat.parse("int4"))
    assert not supports(q)
    with pytest.raises(CodesignError, match="fp16/bf16 KV"):
        decode_attention(p, q)
    w4 = Gemm(1, 64, 128, weight=WeightFormat.parse("int4-g128"))
    with pytest.raises(CodesignError, match="fp16/bf16 weights"):
        gemv(p, w4)
    with pytest.raises(CodesignError, match="banks_per_unit"):
        PIMSpec(dram_preset("HBM2"), banks_per_unit=3)
    with pytest.raises(CodesignError, match="lanes"):
        PIMSpec(dram_preset("HBM2"), lanes=0)
