"""Reference KV quantizers (`codesign.kernels.kvcache.quantizers`): bit-exact against the accelerator model's
quantizer (`accel_model.kv_quant_engine`, independent numpy code), round-trip bounds, KIVI residual
boundaries, Oaken thresholds and outlier-capacity overflow, bits per token, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codesign.accel_model import kv_quant_engine as eng
from codesign.kernels.kvcache import quantizers as kvq
from codesign.specs import CodesignError, KVFormat


def _outlier_kv(t: int, h: int, d: int) -> torch.Tensor:
    """Gaussian K with a few channels 8x larger (the channel outliers real keys show)."""
    x = torch.randn(t, h, d)
    x[:, :, torch.randperm(d)[:3]] *= 8.0
    return x


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("scale_dtype", ["fp16", "fp32"])
def test_per_token_bit_exact_vs_engine(bits, scale_dtype):
    x = _outlier_kv(37, 3, 20) * 5 + 2
    x[4, 1] = 1.25  # a constant vector: scale 0
    x[5, 0, :] = torch.arange(20) * 0.5  # codes hit exact .5 ties at some bit widths
    c, s, z = kvq.quantize_per_token(x, bits, scale_dtype)
    ce, se, ze = eng.quantize_per_token(x.numpy(), bits, scale_dtype)
    assert np.array_equal(c.numpy(), ce) and np.array_equal(s.numpy(), se) and np.array_equal(z.numpy(), ze)
    assert np.array_equal(kvq.dequantize_asym(c, s, z).numpy(), eng.dequantize(ce, se, ze))
    assert (kvq.dequantize_asym(c, s, z)[4, 1] == z[4, 1]).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_matches_engine_and_round_trips(bits):
    c = torch.randint(0, 2**bits, (5, 3, 16), dtype=torch.uint8)
    p = kvq.pack_codes(c, bits)
    assert p.shape[-1] == 16 * bits // 8
    assert np.array_equal(p.numpy(), eng.pack_codes(c.numpy(), bits))
    assert torch.equal(kvq.unpack_codes(p, bits), c)
    empty = torch.zeros(0, 3, 16 * bits // 8, dtype=torch.uint8)  # e.g. no cache block at this width
    assert kvq.unpack_codes(empty, bits).shape == (0, 3, 16)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_per_token_round_trip_bound(bits):
    x = _outlier_kv(41, 2, 28) * 3
    c, s, z = kvq.quantize_per_token(x, bits)
    err = (kvq.dequantize_asym(c, s, z) - x).abs()
    mn, mx = x.amin(-1), x.amax(-1)
    # half a step, plus what rounding scale and zero to fp16 can add at the clamped ends
    bound = s / 2 + (mx - mn) * 2.0**-10 + (z - mn).abs() + 1e-6 * x.abs().amax(-1)
    assert (err <= bound[..., None]).all()
    assert err.max() > 0  # it does quantize


def test_fp8_matches_e4m3_grid_and_bound():
    x = torch.randn(30, 3, 16) * 4
    hs = kvq.fp8_head_scales(x)
    assert torch.allclose(hs, x.abs().amax(dim=(0, 2)) / 448)
    c = kvq.quantize_fp8(x, hs)
    xh = kvq.dequantize_fp8(c, hs)
    y = x / hs[:, None]
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= 2^-10 in the subnormals
    assert ((xh / hs[:, None] - y).abs() <= torch.maximum(y.abs() * 2.0**-4, torch.tensor(2.0**-10))).all()
    # ties go to the even mantissa: 100 sits between 96 and 104 -> 96; 104+4=108 -> 112 (even)
    tie = kvq.dequantize_fp8(
        kvq.quantize_fp8(torch.tensor([[100.0, 108.0, -100.0]]), torch.ones(1)), torch.ones(1)
    )
    assert tie.tolist() == [[96.0, 112.0, -96.0]]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_kivi_residual_boundaries(bits, extra):
    g, r = 8, 8
    t = 2 * g + r + extra  # just below, at and above the point where a second group fills
    k, v = _outlier_kv(t, 2, 16), torch.randn(t, 2, 16)
    kh, vh = kvq.kivi_fake_quant(k, v, bits, g, r)
    nq = kvq.kivi_split(t, g, r)
    assert nq == (g if extra < 0 else 2 * g)
    assert torch.equal(kh[nq:], k[nq:]) and torch.equal(vh[nq:], v[nq:])  # the residual window is exact
    assert not torch.equal(kh[:nq], k[:nq])
    # keys per channel over each group of G tokens = the engine's per-vector rule on the transposed group
    kg = k[:nq].reshape(nq // g, g, 2, 16).permute(0, 2, 3, 1).numpy()
    ce, se, ze = eng.quantize_per_token(kg, bits)
    ref = torch.from_numpy(eng.dequantize(ce, se, ze)).permute(0, 3, 1, 2).reshape(nq, 2, 16)
    assert torch.equal(kh[:nq], ref)
    # values per token over groups of min(G, D) = 8 elements
    ce, se, ze = eng.quantize_per_token(v[:nq].reshape(nq, 2, 2, 8).numpy(), bits)
    assert torch.equal(vh[:nq], torch.from_numpy(eng.dequantize(ce, se, ze)).reshape(nq, 2, 16))


def test_kivi_short_sequence_all_residual():
    k = torch.randn(5, 1, 8)
    kh, vh = kvq.kivi_fake_quant(k, k, 4, 8, 0)  # 5 tokens < one group: nothing quantized yet
    assert torch.equal(kh, k) and torch.equal(vh, k)


def test_calibrate_thresholds_shape_and_fraction():
    layers = [(torch.randn(200, 2, 16), torch.randn(200, 2, 16) * 3) for _ in range(3)]
    thr = kvq.calibrate_kv_thresholds(layers, 0.04)
    assert thr.shape == (3, 2, 2, 2) and thr.dtype == torch.float32
    for li, (k, v) in enumerate(layers):
        for kv, x in enumerate((k, v)):
            for h in range(2):
                lo, hi = thr[li, kv, h]
                frac = ((x[:, h] < lo) | (x[:, h] > hi)).float().mean()
                assert 0.03 <= frac <= 0.05
    assert (thr[:, 1, :, 1] > thr[:, 0, :, 1]).all()  # V was 3x wider


@pytest.mark.parametrize("bits", [2, 4])
def test_oaken_no_overflow_bit_exact_vs_engine(bits):
    x = _outlier_kv(8, 2, 16)
    thr = kvq.calibrate_kv_thresholds([(x, x)], 0.05)[0, 0]
    blk = kvq.oaken_quantize_block(x, bits, thr, capacity=8 * 16)
    assert int(blk.overflow.sum()) == 0
    xh = kvq.oaken_dequantize_block(blk)
    for h in range(2):
        lo, hi = thr[h].tolist()
        c, s, z, m, ov = eng.quantize_oaken(x[:, h].numpy(), bits, lo, hi)
        assert np.array_equal(blk.codes[:, h].numpy(), c)
        assert np.array_equal(blk.scale[:, h].numpy(), s) and np.array_equal(blk.zero[:, h].numpy(), z)
        assert np.array_equal(xh[:, h].numpy(), eng.dequantize_oaken(c, s, z, m, ov))
        assert int(blk.count[h]) == int(m.sum())


def test_oaken_overflow_clamps_excess_and_counts():
    bs, h, d, cap = 4, 2, 16, 3
    x = torch.randn(bs, h, d) * 0.1
    thr = torch.tensor([[-1.0, 1.0], [-1.0, 1.0]])
    x[0, 0, :6] = torch.tensor([5.0, -9.0, 2.0, 7.0, -3.0, 1.5])  # six outliers in head 0, capacity 3
    x[2, 1, 4] = 4.0  # one in head 1
    x[3, 0, 9] = 50.0  # head 0 is full by now: clamped even though it is the farthest (online rule)
    blk = kvq.oaken_quantize_block(x, 4, thr, cap)
    assert blk.count.tolist() == [3, 1] and blk.overflow.tolist() == [4, 0]
    assert sorted(blk.out_pos[0].tolist()) == [0, 1, 3]  # the farthest three: -9, 7, 5
    assert blk.out_pos[1].tolist() == [2 * d + 4, -1, -1]
    xh = kvq.oaken_dequantize_block(blk)
    assert xh[0, 0, [0, 1, 3]].tolist() == [5.0, -9.0, 7.0]  # stored exactly (fp16-representable)
    # the excess ones land in the dense range: within a quantization step of the clamp
    for t, i, want in ((0, 2, 1.0), (0, 4, -1.0), (0, 5, 1.0), (3, 9, 1.0)):
        assert abs(float(xh[t, 0, i]) - want) <= float(blk.scale[t, 0]) / 2 + 1e-3
    over_total = kvq.oaken_fake_quant(torch.cat([x, x]), 4, thr, bs, cap)[1]
    assert over_total == 8


def test_layout_bits_agree_with_kvformat():
    d = 128
    for name, scheme in (("int8", "per_token"), ("int4", "per_token"), ("int2", "per_token")):
        f = KVFormat.parse(name)
        assert kvq.layout_bits_per_element(scheme, int(name[3:]), d) == f.bits_per_element(d)
    f = KVFormat.parse("int4-kivi")
    assert kvq.layout_bits_per_element("kivi", 4, d, group=f.group_size) == f.bits_per_element(d)
    assert kvq.layout_bits_per_element("fp8", 8, d) == KVFormat.parse("fp8").bits_per_element(d)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: kvq.quantize_per_token(torch.randn(3, 8), 3), "bits must be one of"),
        (lambda: kvq.quantize_per_token(torch.tensor([[1.0, float("nan")]]), 4), "finite"),
        (lambda: kvq.quantize_per_token(torch.randn(3, 8), 4, "bf8"), "scale_dtype"),
        (lambda: kvq.pack_codes(torch.zeros(2, 6, dtype=torch.uint8), 2), "multiple of 4"),
        (lambda: kvq.pack_codes(torch.full((2, 4), 4, dtype=torch.uint8), 2), "exceed 2 bits"),
        (lambda: kvq.kivi_fake_quant(torch.randn(9, 1, 8), torch.randn(9, 1, 8), 4, 0, 0), "group"),
        (lambda: kvq.kivi_fake_quant(torch.randn(9, 1, 12), torch.randn(9, 1, 12), 4, 8, 0), "multiple"),
        (lambda: kvq.oaken_quantize_block(torch.randn(4, 2, 8), 4, torch.zeros(3, 2), 2), r"shape \(2, 2\)"),
        (
            lambda: kvq.oaken_quantize_block(torch.randn(4, 1, 8), 4, torch.tensor([[float("nan"), 1.0]]), 2),
            "finite",
        ),
        (
            lambda: kvq.oaken_quantize_block(torch.randn(4, 1, 8), 4, torch.tensor([[1.0, -1.0]]), 2),
            "lo <= hi",
        ),
        (
            lambda: kvq.oaken_quantize_block(
                torch.randn(4, 1, 8), 4, torch.zeros(1, 2, dtype=torch.float64), 2
            ),
            "float32",
        ),
        (
            lambda: kvq.calibrate_kv_thresholds([(torch.randn(5, 2, 4), torch.randn(5, 2, 4))], 1.5),
            "outlier_fraction",
        ),
        (
            lambda: kvq.calibrate_kv_thresholds(
                [(torch.randn(5, 2, 4), torch.full((5, 2, 4), float("nan")))]
            ),
            "finite",
        ),
        (lambda: kvq.quantize_fp8(torch.randn(2, 3, 4), torch.ones(3, dtype=torch.float16)), "float32"),
        (lambda: kvq.quantize_fp8(torch.randn(2, 3, 4), torch.zeros(3)), "> 0"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(CodesignError, match=match):
        call()
