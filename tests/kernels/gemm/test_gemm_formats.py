"""Native quantized-weight layout: pack/unpack, RTN quantizer error bounds, dequantize, bad input."""

from __future__ import annotations

import pytest
import torch

from codesign.kernels.gemm import formats as qf
from codesign.specs import CodesignError


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip_is_exact(bits):
    k, n = 8 * 7, 13
    codes = torch.randint(0, 1 << bits, (k, n))
    packed = qf.pack_codes(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (k * bits // 32, n)
    assert torch.equal(qf.unpack_codes(packed, bits), codes)


def test_pack_layout_matches_the_documented_bit_order():
    # Column of codes 1..8 along K -> word 0x87654321 (code k at bits 4k); 0x87654321 as int32 is negative.
    codes = torch.arange(1, 9).view(8, 1)
    assert qf.pack_codes(codes, 4).item() == 0x87654321 - 2**32
    codes8 = torch.tensor([[0x01], [0x23], [0x45], [0xF7]])
    assert qf.pack_codes(codes8, 8).item() == 0xF7452301 - 2**32


@pytest.mark.parametrize("dtype", ["int4", "int8"])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_rtn_error_is_within_half_a_step(dtype, group_size, symmetric, scale_dtype):
    n, k = 24, 256
    w = torch.randn(n, k) * torch.rand(n, 1) * 3
    qw = qf.quantize_rtn(w, dtype, group_size, symmetric, scale_dtype)
    bits = 4 if dtype == "int4" else 8
    assert qw.scales.dtype == scale_dtype and qw.qweight.dtype == torch.int32
    g = k if group_size is None else group_size
    s = qw.scales.to(torch.float64).repeat_interleave(g, dim=0).t()  # [N, K]
    err = (qw.dequantize(torch.float64) - w.double()).abs()
    # Symmetric: absmax maps to +-qmax, so every value is within s/2. Asymmetric: the rounded zero point
    # can push an extreme value one step out of range (clamped): within s.
    bound = 0.5 if symmetric else 1.0
    assert (err <= s * bound * (1 + 1e-6)).all()
    codes = qf.unpack_codes(qw.qweight, bits)
    assert codes.min() >= 0 and codes.max() < (1 << bits)
    if symmetric:
        assert qw.zeros is None and codes.min() >= 1  # q = -(2**(b-1) - 1) is the lowest code used
    else:
        assert qw.zeros.dtype == scale_dtype and torch.equal(qw.zeros, qw.zeros.round())


def test_all_zero_group_gets_unit_scale_and_dequantizes_to_zero():
    w = torch.randn(4, 64)
    w[1, :32] = 0
    for sym in (True, False):
        qw = qf.quantize_rtn(w, "int4", 32, symmetric=sym)
        assert qw.scales[0, 1].item() == 1.0
        assert torch.equal(qw.dequantize()[1, :32], torch.zeros(32))


@pytest.mark.parametrize("group_size", [None, -1])
def test_fp8_quantizer_rounds_to_within_e4m3_precision(group_size):
    w = torch.randn(16, 40) * 5
    qw = qf.quantize_rtn(w, "fp8_e4m3", group_size)
    assert qw.qweight.dtype == torch.float8_e4m3fn and qw.qweight.shape == (40, 16)
    s = qw.scales.double().t()  # [N, 1] or [1, 1]
    v = w.double() / s
    q = qw.qweight.double().t()
    # e4m3 keeps 3 mantissa bits: |v - q| <= 2**-4 |v| for normals, half a subnormal step (2**-10) below.
    assert ((v - q).abs() <= torch.maximum(v.abs() * 2**-4, torch.full_like(v, 2**-10))).all()
    assert v.abs().max() <= qf.FP8_MAX * (1 + 1e-6)


def test_per_token_reference_quantizer():
    x = torch.randn(5, 33) * 4
    x[2] = 0
    q, s = qf.quantize_per_token(x, "int8")
    assert q.dtype == torch.int8 and s.shape == (5,)
    assert s[2].item() == 1.0 and (q[2] == 0).all()
    assert (q.abs().amax(dim=1)[[0, 1, 3, 4]] == 127).all()
    assert ((q.double() * s.double()[:, None] - x.double()).abs() <= s.double()[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype="int3"), "dtype"),
        (dict(group_size=48), "group_size"),
        (dict(group_size=128, k=96), "divisible by group_size"),
        (dict(group_size=None, k=100), "divisible by 8"),
        (dict(dtype="fp8_e4m3", group_size=128), "fp8"),
        (dict(dtype="fp8_e4m3", group_size=None, symmetric=False), "symmetric"),
        (dict(scale_dtype=torch.int8), "scale_dtype"),
    ],
)
def test_quantizer_refuses_bad_arguments(kwargs, match):
    k = kwargs.pop("k", 128)
    w = torch.randn(8, k)
    with pytest.raises(CodesignError, match=match):
        qf.quantize_rtn(w, **{"dtype": "int4", "group_size": 32, **kwargs})


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantizer_refuses_nonfinite_weights(bad):
    w = torch.randn(8, 64)
    w[3, 5] = bad
    with pytest.raises(CodesignError, match="NaN/inf"):
        qf.quantize_rtn(w, "int4", 32)


def test_quantizer_refuses_scale_overflow():
    with pytest.raises(CodesignError, match="overflows"):
        qf.quantize_rtn(torch.full((2, 32), 1e6), "int4", 32, scale_dtype=torch.float16)


def _good(**over):
    qw = qf.quantize_rtn(torch.randn(8, 64), "int4", 32, symmetric=False)
    fields = dict(
        qweight=qw.qweight, scales=qw.scales, zeros=qw.zeros, dtype="int4", group_size=32, N=8, K=64
    )
    fields.update(over)
    return fields


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(scales=torch.full((2, 8), float("nan"), dtype=torch.float16)), "finite"),
        (dict(scales=torch.full((2, 8), float("inf"), dtype=torch.float16)), "finite"),
        (dict(scales=torch.zeros(2, 8, dtype=torch.float16)), "> 0"),
        (dict(scales=torch.ones(3, 8, dtype=torch.float16)), "scales must have shape"),
        (dict(qweight=torch.zeros(4, 8, dtype=torch.int32)), "qweight must have shape"),
        (dict(qweight=torch.zeros(8, 8, dtype=torch.int64)), "qweight must have"),
        (dict(zeros=torch.full((2, 8), 0.5, dtype=torch.float16)), "integers"),
        (dict(zeros=torch.full((2, 8), 17.0, dtype=torch.float16)), "integers"),
        (dict(perm=torch.zeros(64, dtype=torch.int64)), "permutation"),
        (dict(K=60), "divisible"),
        (dict(N=0), "positive"),
    ],
)
def test_quantized_weight_refuses_inconsistent_fields(over, match):
    with pytest.raises(CodesignError, match=match):
        qf.QuantizedWeight(**_good(**over))


def test_quantized_weight_refuses_noncontiguous_qweight():
    f = _good()
    f["qweight"] = f["qweight"].t().contiguous().t()  # same shape, column-major
    with pytest.raises(CodesignError, match="contiguous"):
        qf.QuantizedWeight(**f)


def test_dequantize_applies_the_k_permutation():
    w = torch.randn(8, 64)
    perm = torch.randperm(64)
    base = qf.quantize_rtn(w[:, perm], "int8", 32)
    qw = qf.QuantizedWeight(base.qweight, base.scales, None, "int8", 32, 8, 64, perm=perm)
    assert torch.equal(qw.dequantize()[:, perm], base.dequantize())
