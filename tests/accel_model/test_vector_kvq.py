"""Vector unit and KV quant engine: hand-checked cycles; the quantizer against a scalar reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codesign.accel_model.kv_quant_engine import (
    KVQuantEngineSpec,
    dequantize,
    dequantize_oaken,
    kvq_cost,
    pack_codes,
    quantize_oaken,
    quantize_per_token,
    unpack_codes,
)
from codesign.accel_model.vector_unit import VectorUnitSpec, vector_cost
from codesign.specs import (
    CodesignError,
    Elementwise,
    Gemm,
    KVDequantize,
    KVFormat,
    KVWrite,
    Norm,
    RoPE,
    Softmax,
)


def _ref_quantize(vec: np.ndarray, bits: int) -> tuple[list[int], float, float]:
    """Scalar reference of the documented rule: fp32 arithmetic, fp16 metadata, Python round() (half-even)."""
    f32 = np.float32
    mn, mx = f32(min(vec)), f32(max(vec))
    scale = float(np.float16(f32((mx - mn) / f32(2**bits - 1))))
    zero = float(np.float16(mn))
    if scale == 0:
        return [0] * len(vec), scale, zero
    codes = []
    for x in vec:
        q = round(float(f32(f32(f32(x) - f32(zero)) / f32(scale))))
        codes.append(min(max(q, 0), 2**bits - 1))
    return codes, scale, zero


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", [(3, 24), (2, 5, 40), (1, 128)])
def test_quantizer_matches_scalar_reference(bits, shape):
    x = (np.random.randn(*shape) * np.random.uniform(0.1, 10)).astype(np.float32)
    codes, scale, zero = quantize_per_token(x, bits)
    flat = x.reshape(-1, shape[-1])
    for i, vec in enumerate(flat):
        ref_codes, ref_scale, ref_zero = _ref_quantize(vec, bits)
        assert codes.reshape(-1, shape[-1])[i].tolist() == ref_codes
        assert scale.reshape(-1)[i] == ref_scale and zero.reshape(-1)[i] == ref_zero
    # Dequantization error: half a step, plus the fp16 rounding of zero and scale.
    err = np.abs(dequantize(codes, scale, zero) - x)
    bound = scale[..., None] / 2 + np.abs(x) * 2e-3 + 1e-6
    assert (err <= bound).all()


def test_rounding_is_half_to_even_and_clamped():
    # int4 over [0, 15]: scale exactly 1, zero 0; 2.5 -> 2, 3.5 -> 4 (ties to even); ends stay in range.
    x = np.array([[0.0, 2.5, 3.5, 14.5, 15.0]], dtype=np.float32)
    codes, scale, zero = quantize_per_token(x, 4)
    assert scale[0] == 1.0 and zero[0] == 0.0
    assert codes[0].tolist() == [0, 2, 4, 14, 15]
    # A constant vector: scale 0, all codes 0, dequantizes to the constant (fp16-representable here).
    c, s, z = quantize_per_token(np.full((1, 7), 1.5, np.float32), 2)
    assert s[0] == 0 and (c == 0).all() and (dequantize(c, s, z) == 1.5).all()


def test_pack_layout_and_roundtrip():
    codes = np.array([[1, 2, 15, 0]], dtype=np.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x0F]]  # element 0 in the low nibble
    two = np.array([[1, 2, 3, 0]], dtype=np.uint8)
    assert pack_codes(two, 2).tolist() == [[0b00111001]]
    for bits in (2, 4, 8):
        c = np.random.randint(0, 2**bits, size=(3, 4, 64)).astype(np.uint8)
        assert (unpack_codes(pack_codes(c, bits), bits) == c).all()
    with pytest.raises(CodesignError, match="multiple of 2"):
        pack_codes(np.zeros((1, 3), np.uint8), 4)
    with pytest.raises(CodesignError, match="exceed"):
        pack_codes(np.full((1, 2), 16, np.uint8), 4)


def test_oaken_keeps_outliers_exactly():
    x = np.random.randn(4, 6, 64).astype(np.float32)
    x[0, 0, 3] = 40.0
    x[2, 1, 10] = -33.0
    codes, scale, zero, mask, vals = quantize_oaken(x, 4, lo=-2.5, hi=2.5)
    assert mask[0, 0, 3] and mask[2, 1, 10]
    out = dequantize_oaken(codes, scale, zero, mask, vals)
    assert (out[mask] == x[mask].astype(np.float16).astype(np.float32)).all()
    inner = ~mask
    err = np.abs(out - x)[inner]
    assert (err <= np.broadcast_to(scale[..., None], x.shape)[inner] / 2 + 1e-2).all()
    # Scales come from the inner range only: at most (2.5 - -2.5) / 15 (+ fp16 rounding).
    assert scale.max() <= 5 / 15 * 1.001


def test_quantizer_bad_input():
    with pytest.raises(CodesignError, match="bits"):
        quantize_per_token(np.zeros((2, 4)), 3)
    with pytest.raises(CodesignError, match="finite"):
        quantize_per_token(np.array([[1.0, np.nan]]), 4)
    with pytest.raises(CodesignError, match="overflows the fp16"):
        quantize_per_token(np.array([[-1e5, 1e5]], np.float32), 8)
    c, s, z = quantize_per_token(np.array([[-1e5, 1e5]], np.float32), 8, scale_dtype="fp32")
    assert s[0] == np.float32(2e5 / 255)
    with pytest.raises(CodesignError, match="lo <= hi"):
        quantize_oaken(np.zeros((1, 4)), 4, 1.0, -1.0)


def test_kvq_cycles_hand_checked():
    eng = KVQuantEngineSpec(lanes=16, depth=6, count=1, outlier_ports=1)
    # 7 tokens x 3 heads x (K, V) = 42 vectors, beats = 128 / 16 = 8: 42 x 8 + 8 (fill) + 6 (depth) = 350.
    assert kvq_cost(eng, KVWrite(7, 3, 128, KVFormat.parse("int4"))).cycles == 350
    # Oaken, 4% outliers of 128 = 5.12 -> 6 per vector; with 64 lanes beats = 2, so the single-port
    # outlier encoder limits: 42 x 6 + 2 + 6 = 260.
    wide = KVQuantEngineSpec(lanes=64, depth=6, count=1, outlier_ports=1)
    assert kvq_cost(wide, KVWrite(7, 3, 128, KVFormat.parse("int4-oaken"))).cycles == 260
    # 4 engines share the vectors: ceil(42 / 4) = 11 x 8 + 8 + 6 = 102.
    four = KVQuantEngineSpec(lanes=16, depth=6, count=4)
    assert kvq_cost(four, KVWrite(7, 3, 128, KVFormat.parse("int8"))).cycles == 102
    # Dequantize: one pass, 42 x 8 + 6 = 342.
    assert kvq_cost(eng, KVDequantize(7, 3, 128, KVFormat.parse("int4"))).cycles == 342
    assert kvq_cost(eng, KVWrite(0, 3, 128, KVFormat.parse("int4"))).cycles == 0
    with pytest.raises(CodesignError, match="KV quant engine"):
        kvq_cost(eng, Norm(1, 8))
    with pytest.raises(CodesignError, match="lanes"):
        KVQuantEngineSpec(lanes=0)


def test_vector_cycles_hand_checked():
    vu = VectorUnitSpec(lanes=128, count=1, depth=8, sfu_cost=4)
    # RMSNorm 5 x 4096: per row 3 x 4096 + rsqrt 4 + tree log2(128) = 7 -> 12299; x5 = 61495 slots,
    # ceil(61495 / 128) = 481, + depth 8 = 489.
    assert vector_cost(vu, Norm(5, 4096)).cycles == 489
    # Softmax 3 x 1000: per row (4 + 4) x 1000 + 4 + 2 x 7 = 8018; x3 = 24054 -> 188 + 8 = 196.
    assert vector_cost(vu, Softmax(3, 1000)).cycles == 196
    # RoPE 9 tokens x (32 + 8) heads x 128 x 3 = 138240 -> 1080 + 8 = 1088.
    assert vector_cost(vu, RoPE(9, 32, 8, 128)).cycles == 1088
    # silu_mul: 4 + 2 x 4 = 12 slots per element; 1000 elements on 2 units of 128: 12000 / 256 -> 47 + 8.
    assert vector_cost(VectorUnitSpec(128, 2), Elementwise("silu_mul", 1000)).cycles == 55
    assert vector_cost(vu, Elementwise("add", 0)).cycles == 0
    with pytest.raises(CodesignError, match="vector unit"):
        vector_cost(vu, Gemm(1, 2, 3))
    with pytest.raises(CodesignError, match="vector.lanes"):
        VectorUnitSpec(lanes=0)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    hd=st.integers(1, 70),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0, 5e3]),  # |x| stays inside fp16 (65504)
    offset=st.floats(-100, 100),
    data=st.data(),
)
def test_quantizer_properties(bits, hd, magnitude, offset, data):
    seed = data.draw(st.integers(0, 2**32 - 1))
    x = (np.random.default_rng(seed).standard_normal((3, hd)) * magnitude + offset).astype(np.float32)
    codes, scale, zero = quantize_per_token(x, bits)
    assert codes.dtype == np.uint8 and codes.max() <= 2**bits - 1
    # Error bound: half a step, plus what fp16 rounding of zero (|zero| 2^-11) and of scale costs; a scale
    # in fp16's subnormal range (< 2^-14) is rounded to a multiple of 2^-24, absolutely: <= 2^-25 per code.
    err = np.abs(dequantize(codes, scale, zero) - x)
    slack = np.abs(zero)[:, None] * 2**-10 + scale[:, None] * (2**bits) * 2**-10 + (2**bits) * 2**-25 + 1e-6
    assert (err <= scale[:, None] / 2 + slack).all()
