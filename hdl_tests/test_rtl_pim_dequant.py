"""The PIM dequantizing front-end lane RTL is bit- and cycle-exact against codesign.accel_model.pim_dequant.

Each case builds rtl/pim_dequant_lane.v (with u8_mul_fp16.v, fp32_add.v, fp32_to_fp16.v) for one code
width on one simulator and runs pim_dequant/tb_pim_dequant.py: per-token metadata from random
activation rows plus directed corners (pdq_vectors.py), every operand compared bit for bit with
`pim_dequant.dequant_operand`, every refusal flag with the model's refusals, every element's latency
with `LANE_LATENCY` and each set's cycles with `lane_cycles`. The multiplier and the converter alone
are checked against numpy. The vector generators are checked outside the simulator: the model against an exact rational
two-rounding reference, the metadata mirror against `kernels.kvcache.quantizers.quantize_per_token`, and each
directed set for the situation it claims. The teeth tests inject a one-line fault.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hdl_benches import (
    PIM_DEQUANT_TEETH,
    PimDequantConfig,
    pim_dequant_bench,
    pim_dequant_matrix,
)
from hdl_sim import HDL_DIR, BenchRun, matrix_cases, run_bench

from codesign.accel_model import pim_dequant
from codesign.specs.errors import CodesignError

sys.path.insert(0, str(HDL_DIR / "pim_dequant"))
import pdq_vectors as pv  # noqa: E402

SETS = {
    "per_token",
    "max_code",
    "code0_signed_zero",
    "subnormal_scale",
    "ties",
    "subnormal_result",
    "range_end",
    "refused",
}


@pytest.mark.parametrize(("simulator", "cfg"), matrix_cases(pim_dequant_matrix))
def test_pim_dequant_rtl_matches_model(simulator, cfg, hdl_seed, require_simulator):
    require_simulator(simulator)
    result = run_bench(pim_dequant_bench(cfg), simulator, hdl_seed)
    assert result.passed, result.summary()
    want = SETS | ({"double_rounding"} if cfg.bits == 8 else set())
    assert {r["case"] for r in result.records} == want
    assert all(r["rtl_cycles"] == r["model_cycles"] for r in result.records)


def fp32_to_fp16_bench(trunc: int = 0) -> BenchRun:
    """The standalone converter bench (TRUNC=1: truncating, the lane's FAULT 2)."""
    return BenchRun(
        unit="pim_dequant",
        toplevel="fp32_to_fp16",
        sources=("fp32_to_fp16.v",),
        parameters={"TRUNC": trunc},
        tb_dir=HDL_DIR / "pim_dequant",
        tb_module="tb_fp32_to_fp16",
        config={"n": 300},
    )


def test_fp32_to_fp16_rtl_matches_numpy(hdl_seed, require_simulator):
    """The converter alone: 6 sets (normals, ties, subnormal results, overflow edge, tiny, zeros/big)."""
    require_simulator("icarus")
    result = run_bench(fp32_to_fp16_bench(), "icarus", hdl_seed)
    assert result.passed, result.summary()
    assert len(result.records) == 6


def test_fp32_to_fp16_bench_catches_truncation(hdl_seed, require_simulator):
    """Teeth: truncation passes only the sets where rounding never goes up (zeros / overflowing)."""
    require_simulator("icarus")
    result = run_bench(fp32_to_fp16_bench(trunc=1), "icarus", hdl_seed)
    assert not result.passed
    assert {r["case"] for r in result.records if not r["bits_ok"]} >= {"normal", "ties", "subnormal", "tiny"}


def test_u8_mul_rtl_matches_numpy(hdl_seed, require_simulator):
    """The multiplier alone: all 256 codes x 4 scale sets (normals, subnormals, signed zeros, range ends)."""
    require_simulator("icarus")
    run = BenchRun(
        unit="pim_dequant",
        toplevel="u8_mul_fp16",
        sources=("u8_mul_fp16.v",),
        parameters={},
        tb_dir=HDL_DIR / "pim_dequant",
        tb_module="tb_u8_mul",
        config={"n": 12},
    )
    result = run_bench(run, "icarus", hdl_seed)
    assert result.passed, result.summary()
    assert [r["t"] for r in result.records] == [256 * 12, 256 * 12, 256 * 2, 256 * 10]


@pytest.mark.parametrize(
    ("cfg", "broken"),
    # One fused rounding differs only where fp32 rounding lands on an fp16 tie; truncation nearly everywhere.
    [(PIM_DEQUANT_TEETH[0], {"double_rounding"}), (PIM_DEQUANT_TEETH[1], None)],
    ids=["fused-single-rounding", "conversion-truncates"],
)
def test_pim_dequant_bench_catches_injected_fault(cfg, broken, hdl_seed, require_simulator):
    require_simulator("icarus")
    result = run_bench(pim_dequant_bench(cfg), "icarus", hdl_seed)
    assert not result.passed, f"bench passed with FAULT={cfg.fault} injected: it has no teeth"
    failed = {r["case"] for r in result.records if not r["bits_ok"]}
    assert all(r["cycles_ok"] for r in result.records)  # both faults change numbers, not timing
    if broken is not None:
        assert broken <= failed, result.records
        # Every double-rounding element is caught, and the faulty lane gives the fused result there.
        (dr,) = [r for r in result.records if r["case"] == "double_rounding"]
        assert dr["n_wrong"] == dr["t"]
        assert all(pv.fused_reference(c, s, z) == rtl for c, s, z, rtl in dr["wrong_elements"])
    else:
        assert len(failed) >= 5, result.records


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (PimDequantConfig(3), "bits"),
        (PimDequantConfig(16), "bits"),
        (PimDequantConfig(8.0), "bits"),
        (PimDequantConfig(True), "bits"),
        (PimDequantConfig(8, 3), "fault"),
    ],
)
def test_unsupported_pim_dequant_config_fails_before_build(cfg, match):
    with pytest.raises(CodesignError, match=match):
        pim_dequant_bench(cfg)


def test_lane_timing_model():
    """n elements back to back: first sampled at edge 0, last operand registered at edge n - 1 + 3."""
    assert pim_dequant.LANE_LATENCY == 3
    assert [pim_dequant.lane_cycles(n) for n in (1, 2, 64)] == [4, 5, 67]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(CodesignError, match="n must be a positive int"):
            pim_dequant.lane_cycles(bad)


# ---- the vectors, outside the simulator ---------------------------------------------------------------


@pytest.mark.parametrize("bits", pim_dequant.INT_BITS)
def test_model_equals_exact_two_rounding_reference(bits, hdl_seed):
    """dequant_operand (numpy fp32 ops) == exact rationals rounded to fp32 then fp16, on every set,
    refusals included; the reference is independent of numpy's arithmetic."""
    rng = np.random.default_rng(hdl_seed)
    for name, (c, s, z) in pv.element_sets(rng, bits).items():
        w, refused = pv.model(c, s, z, bits)
        ref = [pv.two_rounding_reference(*e, bits) for e in zip(c, s, z)]
        assert [r is None for r in ref] == refused.tolist(), name
        assert [int(x) for x, r in zip(w, ref) if r is not None] == [r for r in ref if r is not None], name


def test_docstring_double_rounding_case():
    """pim_dequant's docstring: zero 1024, code 185, scale 1417 x 2^-19: two roundings give 1024, one 1025."""
    args = (185, int(pv.h_bits(1417 * 2.0**-19)), int(pv.h_bits(1024.0)))
    assert pv.h_val(np.uint16(pv.two_rounding_reference(*args))) == 1024
    assert pv.h_val(np.uint16(pv.fused_reference(*args))) == 1025
    w, refused = pv.model(
        np.array([185], np.uint8), np.array([args[1]], np.uint16), np.array([args[2]], np.uint16), 8
    )
    assert pv.h_val(w)[0] == 1024 and not refused[0]


def test_double_rounding_needs_8_bit_codes():
    """Every (code, significand) whose product can put an inexact fp32 sum on an fp16 tie has code >= 16,
    so 2- and 4-bit lanes never see one (why the set exists for bits = 8 only); the docstring's is one."""
    c, sig, t = pv.double_rounding_products()
    assert len(c) > 100 and c.min() >= 16
    assert ((c == 185) & (sig == 1417) & (t == 18)).any()


@pytest.mark.parametrize("bits", pim_dequant.INT_BITS)
def test_operand_sets_hit_their_corner(bits, hdl_seed):
    rng = np.random.default_rng(hdl_seed)
    sets = pv.element_sets(rng, bits)
    assert set(sets) == SETS | ({"double_rounding"} if bits == 8 else set())
    w = {k: pv.model(*v, bits) for k, v in sets.items()}

    def count(name, pred):
        return sum(bool(pred(*e)) for e in zip(*sets[name]))

    n_ties = len(sets["ties"][0])
    assert count("ties", lambda *e: pv.is_fp16_tie(*e, bits)) == n_ties
    # Both rounding directions: some ties go away from zero, some toward it.
    away = [
        abs(pv.h_val(np.uint16(pv.two_rounding_reference(*e, bits)))) > abs(pv.exact_sum(*e, bits)[0])
        for e in zip(*sets["ties"])
    ]
    assert 0 < sum(away) < len(away)
    if bits == 8:
        dr = sets["double_rounding"]
        assert (dr[0][0], dr[1][0], dr[2][0]) == (185, pv.h_bits(1417 * 2.0**-19), pv.h_bits(1024.0))
        assert (
            count("double_rounding", lambda *e: pv.two_rounding_reference(*e) != pv.fused_reference(*e))
            == len(dr[0])
            >= 30
        )
    bits_w, refused = w["code0_signed_zero"]
    assert ((bits_w == 0x8000) & ~refused).sum() >= 5 and ((bits_w == 0) & ~refused).sum() >= 5
    sub = w["subnormal_result"]
    assert (((sub[0] & 0x7C00) == 0) & ((sub[0] & 0x3FF) != 0)).sum() >= len(sub[0]) // 2
    scale = sets["subnormal_scale"][1]
    assert ((scale & 0x7C00) == 0).all() and ((scale & 0x3FF) != 0).all()
    top, top_refused = w["range_end"]
    assert ((top & 0x7FFF) == 0x7BFF).sum() >= 3 and top_refused.sum() >= 3
    assert w["refused"][1].all() and not w["per_token"][1].any()
    assert (sets["max_code"][0] == 2**bits - 1).all()


@pytest.mark.parametrize("bits", pim_dequant.INT_BITS)
def test_per_token_mirror_equals_kv_quant(bits, hdl_seed):
    """The bench's numpy metadata (no torch in the simulator) is kernels.kvcache.quantizers.quantize_per_token's."""
    torch = pytest.importorskip("torch")
    from codesign.kernels.kvcache.quantizers import quantize_per_token

    x = pv.activation_rows(np.random.default_rng(hdl_seed), 9, 37)
    x[3] = 0.5  # a constant row: scale 0, codes 0
    codes, scale, zero = pv.per_token_numpy(x, bits)
    tc, ts, tz = quantize_per_token(torch.from_numpy(x), bits)
    assert np.array_equal(codes, tc.numpy())
    assert np.array_equal(scale, ts.numpy()) and np.array_equal(zero, tz.numpy())
