"""The tiled weight-only GEMM at its large-M defaults: the 256-row tile (`_GPU_DEFAULTS["tiled_wide"]`, chosen by
`triton_gemm.tiled_kind` once the 128-row grid is more than one wave) in the interpreter against fp64 on shapes no
tile divides (M > 256, N not a multiple of 128) into a NaN-poisoned output, fp16 and bf16 activations, with and
without zeros and bias; the group of a K tile by a shift (`group_shift`), per-channel K not a power of two
included; the dequantization by bit patterns (`magic_dequant`, MAGIC_DQ) bit for bit against the fp32 one where
the interpreter runs it (fp16), and its bf16 bit patterns on the host; and mutations (a wrong zero, a wrong group)
that these comparisons must catch."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from helpers import assert_rel_close

from codesign.autotune.lookup import forced_config
from codesign.backend import DeviceView, use_backend
from codesign.kernels.gemm import formats as qf
from codesign.kernels.gemm import triton_gemm as qt
from codesign.specs import CodesignError

BOUND = {torch.float16: 2e-3, torch.bfloat16: 8e-3}
WIDE = {**qt._GPU_DEFAULTS["tiled_wide"], "num_stages": 1}  # the GPU's 256-row tile, in the interpreter


def _ref(x, qw, bias):
    y = x.double() @ qw.dequantize(torch.float64).t()
    return y if bias is None else y + bias.double()


def _run(x, qw, bias, zeros="keep", cfg=None):
    out = torch.full((x.shape[0], qw.N), float("nan"), dtype=x.dtype)
    z = qw.zeros if zeros == "keep" else zeros
    with (
        use_backend("triton"),
        forced_config(qt.wq_variant_op(qw.bits), qt.wq_variant_entry("tiled")),
        forced_config(qt.wq_table_op(qw.bits, "tiled"), cfg or WIDE),
    ):
        qt.wq_gemm(x, qw.qweight, qw.scales, z, bias, qw.bits, qw.group, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group", "sym", "n", "k", "m", "bias"),
                         [(4, 128, False, 131, 256, 261, True), (4, 64, True, 200, 192, 300, False),
                          (8, None, False, 131, 200, 259, False), (8, 32, True, 72, 96, 257, True)])  # fmt: skip
def test_the_256_row_tile_matches_fp64(bits, group, sym, n, k, m, bias, dtype):
    torch.manual_seed(m + n)
    qw = qf.quantize_rtn(torch.randn(n, k), f"int{bits}", group, sym, dtype)
    x = torch.randn(m, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    out = _run(x, qw, b)
    assert_rel_close(out, _ref(x, qw, b), BOUND[dtype], f"tiled 256 rows int{bits} g{group} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_comparisons_have_teeth(monkeypatch, dtype):
    """A zero off by one and a group misplaced by the shift (shift + 1: K tiles 2j and 2j + 1 both reading group j's
    scales and zeros; shift - 1 would read past the last group) must fail the fp64 comparison the tests above pass
    (fp16: through the bit-pattern dequantization)."""
    qw = qf.quantize_rtn(torch.randn(131, 256), "int4", 64, False, dtype)
    x = torch.randn(261, 256).to(dtype)
    ref = _ref(x, qw, None)
    assert_rel_close(_run(x, qw, None), ref, BOUND[dtype])
    with pytest.raises(AssertionError):
        assert_rel_close(_run(x, qw, None, zeros=qw.zeros + 1), ref, BOUND[dtype])
    real = qt.group_shift
    monkeypatch.setattr(qt, "group_shift", lambda g, k: real(g, k) + 1)
    with pytest.raises(AssertionError):
        assert_rel_close(_run(x, qw, None), ref, BOUND[dtype])


@pytest.mark.parametrize(("bits", "group", "sym", "n", "k", "m", "bias"),
                         [(4, 128, False, 131, 256, 261, True), (8, None, False, 77, 200, 70, False),
                          (8, 64, True, 40, 128, 19, True), (4, None, True, 33, 96, 130, False)])  # fmt: skip
@pytest.mark.parametrize("tile", ["tiled", "tiled_wide", "tiled_wide_wg", "tiled_w4"])
def test_bit_pattern_dequantization_is_the_fp32_one_bit_for_bit(monkeypatch, bits, group, sym, n, k, m, bias, tile):
    """fp16 activations and scales: the weight tile by bit patterns and packed fp16 arithmetic gives the same fp16
    weights as the fp32 path's single rounding, so the same outputs bit for bit (the interpreter's fp16 dot)."""
    qw = qf.quantize_rtn(torch.randn(n, k) * 3, f"int{bits}", group, sym, torch.float16)
    x = torch.randn(m, k).to(torch.float16)
    b = torch.randn(n).to(torch.float16) if bias else None
    cfg = {**qt._GPU_DEFAULTS[tile], "num_stages": 1}
    assert qt.magic_dequant(bits, torch.float16, tl.float16)
    fast = _run(x, qw, b, cfg=cfg)
    monkeypatch.setattr(qt, "magic_dequant", lambda *a: False)
    slow = _run(x, qw, b, cfg=cfg)
    assert torch.equal(fast, slow)
    assert_rel_close(fast, _ref(x, qw, b), BOUND[torch.float16])


def test_where_the_bit_patterns_are_exact():
    """bf16 (a GPU's path only: the interpreter computes bf16 dots in fp32): 0x4300 | c is 128 + c for 4-bit codes,
    128 + z is exact for zeros 0 .. 16, so c - z is exact and (c - z) s rounds once, to what the fp32 path gives.
    8-bit codes overflow bf16's 7 mantissa bits (they keep the fp32 path); fp16's 0x6400 | c = 1024 + c holds them."""
    c = torch.arange(16, dtype=torch.int16)
    assert torch.equal((c | 0x4300).view(torch.bfloat16).float(), 128 + c.float())
    assert not torch.equal((torch.arange(256, dtype=torch.int16) | 0x4300).view(torch.bfloat16).float(),
                           128 + torch.arange(256).float())  # fmt: skip
    c8 = torch.arange(256, dtype=torch.int16)
    assert torch.equal((c8 | 0x6400).view(torch.float16).float(), 1024 + c8.float())
    s = torch.randn(4096).to(torch.bfloat16)
    for z in range(17):
        wq = (c | 0x4300).view(torch.bfloat16)
        diff = wq - torch.tensor(128.0 + z, dtype=torch.bfloat16)
        assert torch.equal(diff.float(), c.float() - z)
        got = diff[:, None] * s[None, :]  # one bf16 rounding of the exact product
        want = ((c.float() - z)[:, None] * s.float()[None, :]).to(torch.bfloat16)
        assert torch.equal(got, want)
    # where it runs: 16-bit scales of the dot's type; bf16 for 4-bit codes only; never for fp32 (the interpreter's bf16)
    assert qt.magic_dequant(8, torch.float16, tl.float16) and qt.magic_dequant(4, torch.bfloat16, tl.bfloat16)
    assert not qt.magic_dequant(8, torch.bfloat16, tl.bfloat16)
    assert not qt.magic_dequant(4, torch.float32, tl.float16) and not qt.magic_dequant(4, torch.bfloat16, tl.float32)


def test_group_shift():
    assert [qt.group_shift(g, 8192) for g in (32, 64, 128, 8192)] == [5, 6, 7, 13]
    assert qt.group_shift(200, 200) == 31  # per-channel, K not a power of two: every K offset in group 0
    with pytest.raises(CodesignError):
        qt.group_shift(96, 192)


def test_tiled_kind_takes_256_rows_past_one_wave_of_128_row_tiles():
    h200 = DeviceView(gpu=True, gpu_name="NVIDIA H200", sms=132, capability=(9, 0), min_dot_rows=16, bf16_dot=True)
    bf16 = torch.bfloat16
    assert qt.tiled_kind(256, 8192, bf16, h200) == "tiled"  # 128 programs: one wave
    a100 = DeviceView(gpu=True, gpu_name="NVIDIA A100", sms=108, capability=(8, 0), min_dot_rows=16, bf16_dot=True)
    assert qt.tiled_kind(257, 8192, bf16, h200) == "tiled_wide_wg"  # (on 16 warps: warpgroup MMA)
    assert qt.tiled_kind(1024, 8192, torch.float16, h200) == "tiled_wide_wg"
    assert qt.tiled_kind(256, 57344, bf16, h200) == "tiled_wide_wg"  # gate_up: 896 programs
    assert qt.tiled_kind(1024, 8192, bf16, a100) == "tiled_wide"  # mma.sync: 8 warps
    assert qt.tiled_kind(128, 1 << 20, bf16, h200) == "tiled"  # 256 rows would be half empty
    assert qt.tiled_kind(4096, 8192, torch.float32, h200) == "tiled"  # fp32: the correctness path
    assert qt.tiled_kind(4096, 8192, bf16, DeviceView(interpreted=True)) == "tiled"  # no GPU: no wave


def test_tiled_kind_takes_64_row_tiles_for_4_bit_weights_on_hopper():
    """4-bit weights on sm_90 up to W4_TILE_MAX_M rows: "tiled_w4" (64 x 128 x 128), whatever the wave (gate_up at
    256 too); past it the 256-row tile; 8-bit weights, mma.sync GPUs, fp32 and the interpreter as before."""
    h200 = DeviceView(gpu=True, gpu_name="NVIDIA H200", sms=132, capability=(9, 0), min_dot_rows=16, bf16_dot=True)
    a100 = DeviceView(gpu=True, gpu_name="NVIDIA A100", sms=108, capability=(8, 0), min_dot_rows=16, bf16_dot=True)
    bf16 = torch.bfloat16
    for m, n in ((17, 8192), (256, 8192), (256, 57344)):
        assert qt.tiled_kind(m, n, bf16, h200, bits=4) == "tiled_w4"
    assert qt.tiled_kind(qt.W4_TILE_MAX_M + 1, 8192, bf16, h200, bits=4) == "tiled_wide_wg"
    assert qt.tiled_kind(256, 8192, bf16, h200, bits=8) == "tiled"
    assert qt.tiled_kind(128, 8192, bf16, a100, bits=4) == "tiled"
    assert qt.tiled_kind(256, 8192, torch.float32, h200, bits=4) == "tiled"
    assert qt.tiled_kind(256, 8192, bf16, DeviceView(interpreted=True), bits=4) == "tiled"
    cfg = qt._GPU_DEFAULTS["tiled_w4"]
    assert cfg["BLOCK_K"] == 128 and cfg["BLOCK_M"] == 64  # one group of 128 a K step
    # split-K likewise: 8 warps for 4-bit weights on sm_90+, else as before
    assert qt.splitk_kind(bf16, h200, bits=4) == "splitk_w4" and qt._GPU_DEFAULTS["splitk_w4"]["num_warps"] == 8
    assert qt.splitk_kind(bf16, h200, bits=8) == qt.splitk_kind(bf16, a100, bits=4) == "splitk"
    assert qt.splitk_kind(torch.float32, h200, bits=4) == "splitk_fp32"
    assert qt.splitk_kind(bf16, DeviceView(interpreted=True), bits=4) == "splitk"
