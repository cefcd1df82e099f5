"""PIM units with a dequantizing front end (pim.dequant): hand-checked costs, refusals, placement, energy,
and the functional front end bit-exact against a reference built from codesign.kernels.kvcache.quantizers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import yaml

from codesign.accel_model import pim_mac
from codesign.accel_model.design import DESIGN_DIR, design_from_dict, load_design
from codesign.accel_model.dram import dram_preset
from codesign.accel_model.energy import PIM_DEQUANT_ELEM_PJ
from codesign.accel_model.evaluate import design_fields_read, evaluate
from codesign.accel_model.pim import (
    PIMDequantSpec,
    PIMSpec,
    area_mm2,
    decode_attention,
    gemv,
    kv_streams,
    supports,
    weight_stream,
    why_not,
)
from codesign.accel_model.pim_dequant import dequant_operand, e4m3_to_float32, fp8_operand, gemv_codes
from codesign.kernels.kvcache import quantizers as kv_quant
from codesign.specs import CodesignError, Gemm, KVFormat, PagedDecodeAttention, WeightFormat

# HBM2, one stack: 16 pseudo-channels x 16 banks / 2 = 128 units; 32 B columns, 1 KB rows = 32 columns;
# tCK 0.8333 ns, tCCD_L 4 cycles = 3.3333 ns per slot, row switch (nRP 17 + nRCD 17) = 28.333 ns;
# every time is divided by (1 - 232 / 4680) for refresh.
T_COL = 4 / 1.2
ROW = 34 / 1.2
REFRESH = 1 - 232 / 4680


def hbm2(**dequant) -> PIMSpec:
    dq = PIMDequantSpec(**dequant) if dequant else None
    return PIMSpec(dram_preset("HBM2", 1), banks_per_unit=2, lanes=16, dequant=dq)


def attn(kv: str, **kw) -> PagedDecodeAttention:
    # 1024 tokens, 2 kv heads of 128, GQA group G = 8 / 2 = 4.
    return PagedDecodeAttention(8, 2, 128, context_lens=(1000, 24), kv_format=KVFormat.parse(kv), **kw)


def kv_bytes(spec: PagedDecodeAttention) -> float:
    return spec.kv_tokens() * spec.kv_format.bytes_per_token(spec.kv_heads, spec.head_dim)


# ---- cost model: golden numbers by hand ---------------------------------------------------------------


def test_int4_int8_fp16_attention_by_hand():
    p = hbm2(bits=(8, 4), elems_per_cmd=32)  # MAC lanes 16 (not widened)
    # int4 per token. K codes 1024 x 2 x 128 x 0.5 B = 131072 B -> 1024 B per unit = 32 columns.
    # K metadata: a (scale, zero) fp16 pair per (token, kv head) = 1024 x 2 x 4 B = 8192 B -> 64 B per
    # unit = 2 columns. A column holds 64 codes; min(elems_per_cmd 32, lanes 16) = 16 per slot -> 4 slots.
    # Commands: 32 x 4 slots x G 4 + 2 metadata = 514; rows ceil(34 / 32) = 2.
    # t = 514 x 3.3333 + 2 x 28.333 = 1713.33 + 56.67 = 1770.0 ns (before refresh).
    sk, sv = kv_streams(p, attn("int4"))
    assert (sk.code_bytes, sk.meta_bytes) == (131072, 8192)
    assert (sk.code_cols, sk.meta_cols, sk.slots, sk.reuse, sk.rows) == (32, 2, 4, 4, 2)
    assert sk.ns == pytest.approx(1770.0 / REFRESH, rel=1e-9)
    assert sv == sk  # per-token values: the same stream
    r = decode_attention(p, attn("int4"))
    assert r.pim_ns == pytest.approx(2 * 1770.0 / REFRESH, rel=1e-9)
    assert r.bank_bytes == 2 * (131072 + 8192) == kv_bytes(attn("int4"))  # 1024 tokens x 272 B
    assert r.dequant_elems == 2 * 262144 * 4  # K and V codes, dequantized once per reuse pass
    # int8: 262144 B -> 2048 B per unit = 64 columns, 2 metadata columns; 32 codes / 16 = 2 slots;
    # 64 x 2 x 4 + 2 = 514 commands (the same MAC time: the lanes limit); rows ceil(66 / 32) = 3:
    # 1713.33 + 85.0 = 1798.33 ns.
    s8, _ = kv_streams(p, attn("int8"))
    assert (s8.code_cols, s8.meta_cols, s8.slots, s8.rows) == (64, 2, 2, 3)
    assert s8.ns == pytest.approx((514 * T_COL + 3 * ROW) / REFRESH, rel=1e-9)
    # fp16: 524288 B -> 4096 B per unit = 128 columns, 1 slot, 512 commands, 4 rows: 1706.67 + 113.33.
    s16, _ = kv_streams(p, attn("fp16"))
    assert (s16.code_cols, s16.meta_cols, s16.slots, s16.rows) == (128, 0, 1, 4)
    assert s16.ns == pytest.approx(1820.0 / REFRESH, rel=1e-9)


def test_kivi_metadata_by_hand():
    p = hbm2(bits=(8, 4), elems_per_cmd=32)
    # int4 KIVI, G = 32. Keys: one pair per (channel, group of 32 tokens, kv head):
    # 1024 / 32 x 128 x 2 x 4 B = 32768 B -> 256 B per unit = 8 columns. Values: one pair per (token,
    # group of min(32, 128) = 32 channels) = 1024 x 4 x 2 x 4 B = 32768 B, also 8 columns.
    # K: 32 x 4 x 4 + 8 = 520 commands, rows ceil(40 / 32) = 2: 1733.33 + 56.67 = 1790.0 ns.
    spec = attn("int4-kivi")
    sk, sv = kv_streams(p, spec)
    assert (sk.meta_bytes, sv.meta_bytes) == (32768, 32768)
    assert (sk.code_cols, sk.meta_cols, sk.rows) == (32, 8, 2)
    assert sk.ns == pytest.approx(1790.0 / REFRESH, rel=1e-9)
    # KVFormat: (4 + 32/32 + 4 + 32/32) / 2 = 5 bits per element, 320 B per token.
    assert sk.code_bytes + sk.meta_bytes + sv.code_bytes + sv.meta_bytes == kv_bytes(spec) == 1024 * 320


def test_w4a16_gemv_by_hand():
    p = hbm2(bits=(8, 4), elems_per_cmd=32)
    # 4096 x 4096 int4, groups of 128, symmetric (fp16 scale only): codes 8 MiB -> 65536 B per unit
    # = 2048 columns; scales 4096 x 32 x 2 B = 262144 B -> 2048 B per unit = 64 columns. 4 slots.
    # (2048 x 4 x 1 + 64) = 8256 commands x 3.3333 = 27520 ns; rows ceil(2112 / 32) = 66 x 28.333 =
    # 1870 ns: 29390 ns (fp16: 34560 ns, test_pim.py).
    spec = Gemm(1, 4096, 4096, weight=WeightFormat.parse("int4-g128"))
    ws = weight_stream(p, spec)
    assert (ws.code_cols, ws.meta_cols, ws.slots, ws.rows) == (2048, 64, 4, 66)
    assert ws.code_bytes + ws.meta_bytes == spec.weight.total_bytes(4096, 4096)
    r = gemv(p, spec)
    assert r.pim_ns == pytest.approx(29390.0 / REFRESH, rel=1e-9)
    assert r.pim_ns < gemv(p, Gemm(1, 4096, 4096)).pim_ns
    assert r.dequant_elems == 4096 * 4096


@pytest.mark.parametrize(
    "kv", ["int8", "int4", "int2", "int8-kivi", "int4-kivi", "int2-kivi", "fp8", "fp16", "bf16"]
)
def test_bank_bytes_are_the_formats_bytes(kv):
    """Codes + metadata read = KVFormat's bytes (no double counting, no free metadata), odd contexts."""
    p = hbm2(bits=(8, 4, 2), elems_per_cmd=16, fp8=True)
    spec = PagedDecodeAttention(12, 4, 64, context_lens=(77, 1, 300), kv_format=KVFormat.parse(kv))
    assert decode_attention(p, spec).bank_bytes == pytest.approx(kv_bytes(spec), rel=1e-12)


def test_int4_beats_int8_beats_fp16_when_lanes_suffice():
    # Widened: 64 lanes, 64 codes per slot -> int4 and int8 columns take 1 slot.
    # int4: 32 x 1 x 4 + 2 = 130 commands, 2 rows: 433.33 + 56.67 = 490 ns;
    # int8: 64 x 4 + 2 = 258, 3 rows: 860 + 85 = 945 ns; fp16: 1820 ns.
    p = hbm2(bits=(8, 4), elems_per_cmd=64, mac_lanes=64)
    t = {kv: kv_streams(p, attn(kv))[0].ns * REFRESH for kv in ("int4", "int8", "fp16")}
    assert t["int4"] == pytest.approx(490.0) and t["int8"] == pytest.approx(945.0)
    assert t["int4"] < t["int8"] < t["fp16"] == pytest.approx(1820.0)
    # 16 lanes (not widened): the MAC slots are the same for all three; only row switches differ.
    p16 = hbm2(bits=(8, 4), elems_per_cmd=64)
    t16 = {kv: kv_streams(p16, attn(kv))[0].ns for kv in ("int4", "int8", "fp16")}
    assert t16["int4"] < t16["int8"] < t16["fp16"] < 1.05 * t16["int4"]


def test_narrow_front_end_makes_quantized_kv_slower():
    # elems_per_cmd 8 < 16 lanes: int8 32 / 8 = 4 slots: 64 x 4 x 4 + 2 = 1026 commands, 3 rows =
    # 3420 + 85 = 3505 ns; int4 64 / 8 = 8 slots: 32 x 8 x 4 + 2 = 1026, 2 rows = 3476.67 ns. Both
    # slower than fp16 (1820 ns), and int4 gains under 1% on int8.
    p = hbm2(bits=(8, 4), elems_per_cmd=8)
    t = {kv: kv_streams(p, attn(kv))[0].ns * REFRESH for kv in ("int4", "int8", "fp16")}
    assert t["int8"] == pytest.approx(3505.0) and t["int4"] == pytest.approx(3420 + 170 / 3)
    assert t["fp16"] < t["int4"] < t["int8"] < 1.01 * t["int4"]


# ---- refusals ---------------------------------------------------------------------------------------------


def test_refusals_say_why():
    full = hbm2(bits=(8, 4), elems_per_cmd=32)
    for kv in ("int4-oaken", "int4-oaken_offline"):
        spec = attn(kv)
        assert not supports(spec, full)
        assert "scatter" in why_not(spec, full) and "outlier" in why_not(spec, full)
        with pytest.raises(CodesignError, match="scatter"):
            decode_attention(full, spec)
    assert "no pim.dequant" in why_not(attn("int4"), hbm2())
    assert not supports(attn("int4")) and supports(attn("fp16"))
    assert "[8, 4]-bit codes, not 2-bit" in why_not(attn("int2"), full)
    assert "fp8" in why_not(attn("fp8"), full) and supports(attn("fp8"), hbm2(elems_per_cmd=32, fp8=True))
    assert "window" in why_not(attn("int4", window=64), full)
    # KIVI keys need head_dim pairs in the register file: 128 x 4 B = 512 B; 256 B is too small.
    small = hbm2(bits=(4,), elems_per_cmd=32, meta_bytes=256)
    assert "meta_bytes is 256" in why_not(attn("int4-kivi"), small)
    assert supports(attn("int4"), small)
    w2 = Gemm(2, 64, 128, weight=WeightFormat.parse("int2-g32"))
    assert "[8, 4]-bit" in why_not(w2, full)
    assert supports(Gemm(2, 64, 128, weight=WeightFormat.parse("int8-pc")), full)
    assert "df11" in why_not(Gemm(1, 64, 128, weight=WeightFormat.parse("df11")), full)


@pytest.mark.parametrize(
    "dequant, field",
    [
        ({"bits": [3], "elems_per_cmd": 32}, "pim.dequant.bits"),
        ({"bits": [], "elems_per_cmd": 32}, "pim.dequant.bits"),
        ({"bits": [4, 4], "elems_per_cmd": 32}, "pim.dequant.bits"),
        ({"bits": [8, True], "elems_per_cmd": 32}, "pim.dequant.bits"),
        ({"bits": [4], "elems_per_cmd": 0}, "pim.dequant.elems_per_cmd"),
        ({"bits": [4], "elems_per_cmd": -8}, "pim.dequant.elems_per_cmd"),
        ({"bits": [4]}, "pim.dequant.elems_per_cmd"),
        ({"bits": [4], "elems_per_cmd": 32, "mac_lanes": 24}, "pim.dequant.mac_lanes"),
        ({"bits": [4], "elems_per_cmd": 32, "meta_bytes": 16}, "pim.dequant.meta_bytes"),
        ({"bits": [4], "elems_per_cmd": 32, "fp8": 1}, "pim.dequant.fp8"),
        ({"bits": [4], "elems_per_cmd": 32, "lanes": 64}, "pim.dequant.lanes"),
    ],
)
def test_bad_dequant_design_values_name_the_field(dequant, field):
    raw = yaml.safe_load((DESIGN_DIR / "hbm_pim.yaml").read_text())
    raw["pim"]["dequant"] = dequant
    with pytest.raises(CodesignError, match=field.replace(".", r"\.")):
        design_from_dict(raw, "x.yaml")


def test_direct_construction_is_checked():
    with pytest.raises(CodesignError, match=r"pim\.dequant\.bits"):
        PIMDequantSpec(bits=(16,))
    with pytest.raises(CodesignError, match=r"pim\.dequant\.elems_per_cmd"):
        PIMDequantSpec(elems_per_cmd=0)


# ---- evaluator, energy, area, cache keys ------------------------------------------------------------------


def _attacc_pair():
    return load_design("attacc_like"), load_design("attacc_like_int4")


def test_evaluator_places_int4_attention_on_pim_only_with_a_front_end():
    plain, deq = _attacc_pair()
    spec = PagedDecodeAttention(32, 8, 128, context_lens=(4096, 3001, 17), kv_format=KVFormat.parse("int4"))
    host, on_pim = evaluate(plain, spec), evaluate(deq, spec)
    assert host.unit != "pim" and on_pim.unit == "pim"
    assert on_pim.seconds < host.seconds  # the mapper would pick it too (targets.py keeps the cheaper)
    # Same PIM, fp16 cache: the front end changes nothing.
    f16 = dataclasses.replace(spec, kv_format=KVFormat.parse("fp16"))
    assert evaluate(deq, f16).seconds == evaluate(plain, f16).seconds
    assert evaluate(deq, spec).seconds < evaluate(deq, f16).seconds
    oaken = dataclasses.replace(spec, kv_format=KVFormat.parse("int4-oaken"))
    assert evaluate(deq, oaken).unit != "pim"  # refused: falls back to the host as before


def test_evaluator_runs_w4a16_gemv_on_pim_only_with_a_front_end():
    plain = load_design("hbm_pim")  # GEMVs with M <= 4 on its PIM units
    deq = dataclasses.replace(
        plain, pim=dataclasses.replace(plain.pim, dequant=PIMDequantSpec(bits=(4,), elems_per_cmd=16))
    )
    w4 = Gemm(3, 4096, 1536, weight=WeightFormat.parse("int4-g64-asym"))
    assert evaluate(plain, w4).unit == "systolic"
    r = evaluate(deq, w4)
    assert r.unit == "pim" and r.energy_pj["pim.dequant"] > 0
    assert r.traffic["pim_bank"] == w4.weight.total_bytes(4096, 1536)  # codes + fp16 scale and zero
    # The same front end does not take int8 weights (bits (4,)): host.
    assert evaluate(deq, dataclasses.replace(w4, weight=WeightFormat.parse("int8-g64"))).unit == "systolic"


def test_energy_keys_present_and_positive():
    _, deq = _attacc_pair()
    spec = PagedDecodeAttention(32, 8, 128, context_lens=(1000, 333), kv_format=KVFormat.parse("int4-kivi"))
    r = evaluate(deq, spec)
    for key in ("pim.mac", "pim.bank_read", "pim.io", "pim.dequant"):
        assert r.energy_pj[key] > 0, key
    want = decode_attention(deq.pim, spec).dequant_elems * PIM_DEQUANT_ELEM_PJ
    assert r.energy_pj["pim.dequant"] == pytest.approx(want)
    assert r.traffic["pim_bank"] == pytest.approx(kv_bytes(spec))
    f16 = evaluate(deq, dataclasses.replace(spec, kv_format=KVFormat.parse("fp16")))
    assert "pim.dequant" not in f16.energy_pj


def test_front_end_area():
    # No front end: only the units' fp16 MAC lanes (128 units x 16 lanes x 3000 um^2, energy.py).
    assert area_mm2(hbm2()) == {"pim.mac": pytest.approx(128 * 16 * (1640 + 1360) / 1e6)}
    a32 = area_mm2(hbm2(elems_per_cmd=32))["pim.dequant"]
    a64 = area_mm2(hbm2(elems_per_cmd=64))["pim.dequant"]
    wide = area_mm2(hbm2(elems_per_cmd=64, mac_lanes=64))["pim.dequant"]
    assert 0 < a32 < a64 < wide
    # 128 units x (64 - 32) front-end lanes x 1659 um^2 (energy.py: 388 + the RTL-checked fp32 adder 1134 + 137)
    assert a64 - a32 == pytest.approx(128 * 32 * (282 * 11 / 8 + 1134 + 137) / 1e6)


def test_design_fields_read_with_the_pim_spec():
    plain, deq = _attacc_pair()
    spec = PagedDecodeAttention(32, 8, 128, context_lens=(512,), kv_format=KVFormat.parse("int4"))
    assert "pim" in design_fields_read(deq.pim, 0, spec) and "systolic" not in design_fields_read(
        deq.pim, 0, spec
    )
    assert "pim" not in design_fields_read(plain.pim, 0, spec)
    union = design_fields_read(True, 0, spec)  # only "has a PIM": both paths' fields
    assert {"pim", "systolic", "vector", "kv_quant"} <= set(union)
    # Contract: equal on the listed fields -> equal results (the host design takes the PIM of deq).
    for d in (plain, deq):
        fields = design_fields_read(d.pim, 0, spec)
        mixed = dataclasses.replace(load_design("gpu_like"), name="m", **{f: getattr(d, f) for f in fields})
        assert evaluate(mixed, spec) == evaluate(d, spec)


# ---- functional front end -----------------------------------------------------------------------------


def _reference_operand(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int = -1
) -> np.ndarray:
    """kernels.kvcache.quantizers's dequantization (fp32), rounded to fp16 by torch: the operand the unit must see."""
    return kv_quant.dequantize_asym(codes, scale, zero, dim).to(torch.float16).numpy()


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    u = f"u{a.itemsize}"  # compare bit patterns: -0 vs +0 and NaNs count
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(u), b.view(u))


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("n, lanes, kcols", [(1, 16, 1), (7, 16, 3), (33, 4, 5), (5, 2, 10), (19, 8, 2)])
def test_per_token_gemv_bit_exact(bits, n, lanes, kcols):
    """QK^T over per-token codes: n tokens' K rows of K = lanes x kcols channels, real random K."""
    k = lanes * kcols
    keys = torch.randn(n, k) * 3 + torch.randn(n, 1)  # per-token offsets: zero points matter
    codes, scale, zero = kv_quant.quantize_per_token(keys, bits)
    codes = kv_quant.unpack_codes(kv_quant.pack_codes(codes, bits), bits)  # the cache's packed layout
    q = torch.randn(k).to(torch.float16).numpy()
    w_ref = _reference_operand(codes, scale, zero)
    y_ref = pim_mac.gemv(w_ref, q, lanes)
    s, z = scale.numpy()[:, None], zero.numpy()[:, None]
    assert _same_bits(dequant_operand(codes.numpy(), s, z, bits), w_ref)
    y = gemv_codes(codes.numpy(), s, z, q, lanes, bits)
    assert _same_bits(y, y_ref)
    exact = w_ref.astype(np.float64) @ q.astype(np.float64)  # fp64: the fp32 sums stay close
    assert np.allclose(y, exact, rtol=1e-5, atol=1e-5 * np.abs(w_ref).sum(1).max())


def test_kivi_and_grouped_layouts_bit_exact():
    """KIVI keys (per channel over a group of tokens: scale [1, K]), values and W4 weights grouped along K."""
    lanes, g_tok, d = 8, 24, 40
    keys = torch.randn(g_tok, d) * torch.linspace(0.5, 6, d)  # channel outliers
    codes, scale, zero = kv_quant.quantize_asym(keys, 4, dim=0)
    q = torch.randn(d).to(torch.float16).numpy()
    w_ref = _reference_operand(codes, scale, zero, dim=0)
    y = gemv_codes(codes.numpy(), scale.numpy()[None, :], zero.numpy()[None, :], q, lanes, 4)
    assert _same_bits(y, pim_mac.gemv(w_ref, q, lanes))
    # values: per token over groups of 8 channels; weights W8 with groups of 20 along K.
    for bits, grp in ((4, 8), (8, 20)):
        x = torch.randn(g_tok, d // grp, grp) * 2
        c, s, z = kv_quant.quantize_asym(x, bits)
        w_ref = _reference_operand(c, s, z).reshape(g_tok, d)
        y = gemv_codes(c.reshape(g_tok, d).numpy(), s.numpy(), z.numpy(), q, lanes, bits)
        assert _same_bits(y, pim_mac.gemv(w_ref, q, lanes))


def test_front_end_rounds_twice_like_the_reference():
    # pim_dequant's docstring case: zero 1024, code 185, scale 1417 x 2^-19 (both exact in fp16):
    # fp32(185 x scale + 1024) = 1024.5 exactly (fp32 ulp at 1024 is 2^-13 > 2 x 2^-19), an fp16 tie
    # that rounds to even, 1024; a fused single rounding of 1024.5000019 gives 1025.
    scale = np.array([[1417 * 2.0**-19]], np.float32)
    zero = np.array([[1024.0]], np.float32)
    codes = np.array([[185]], np.uint8)
    ours = dequant_operand(codes, scale, zero, 8)
    ref = _reference_operand(
        torch.from_numpy(codes), torch.from_numpy(scale[:, 0]), torch.from_numpy(zero[:, 0])
    )
    assert ours[0, 0] == ref[0, 0] == 1024.0
    assert np.float16(185 * 1417 * 2.0**-19 + 1024.0) == 1025.0  # what a fused unit would give


def test_fp8_operands_match_the_kernels_dequantization():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8).reshape(2, -1)
    t = torch.from_numpy(codes)
    assert np.array_equal(e4m3_to_float32(codes), t.view(torch.float8_e4m3fn).to(torch.float32).numpy())
    s = float(torch.rand(()) * 0.01 + 1e-3)
    ref = kv_quant.dequantize_fp8(t[None], torch.tensor([s], dtype=torch.float32))[0]
    assert _same_bits(fp8_operand(codes, s), ref.to(torch.float16).numpy())
    with pytest.raises(CodesignError, match="NaN"):
        fp8_operand(np.array([[0x7F]], np.uint8), 1.0)


def test_functional_bad_inputs():
    c = np.zeros((2, 16), np.uint8)
    one = np.ones((2, 1), np.float32)
    with pytest.raises(CodesignError, match="bits"):
        dequant_operand(c, one, one, 3)
    with pytest.raises(CodesignError, match="< 2"):
        dequant_operand(c + 16, one, one, 4)
    with pytest.raises(CodesignError, match="scale is"):
        dequant_operand(c, np.ones((2, 3), np.float32), one, 4)
    with pytest.raises(CodesignError, match="fp16 values"):
        dequant_operand(c, one * np.float32(1 + 2**-20), one, 4)
    with pytest.raises(CodesignError, match="overflows fp16"):
        dequant_operand(c + 255, one * 60000, one * 60000, 8)
