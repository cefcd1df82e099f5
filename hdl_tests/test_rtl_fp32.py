"""The fp32 operator RTL (rtl/fp32_add.v, rtl/fp32_div.v) is bit-exact with numpy float32 in its domain.

fp32_add is combinational; each case drives a few thousand operand pairs built from their bit
fields (wide and narrow exponent gaps, alignment shifts around the 27-bit sticky clamp, exact
cancellation and one-ulp near-cancellation, ties at half an ulp and just off them, signed zeros)
and compares every result bit with numpy (fp32/fp32_vectors.py, fp32/tb_fp32_add.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from hdl_sim import HDL_DIR, BenchRun, run_bench

from codesign.accel_model import kv_quant_control
from codesign.specs.errors import CodesignError

SIMS = ("icarus", "verilator")


def fp32_add_bench(n: int = 400) -> BenchRun:
    """The BenchRun of the standalone adder bench: `n` pairs per operand set."""
    return BenchRun(
        unit="fp32",
        toplevel="fp32_add",
        sources=("fp32_add.v",),
        parameters={},
        tb_dir=HDL_DIR / "fp32",
        tb_module="tb_fp32_add",
        config={"n": n},
    )


def fp32_div_bench(step: int, n: int = 300) -> BenchRun:
    """The BenchRun of the standalone divider bench (STEP quotient bits a stage); CodesignError if bad."""
    latency = kv_quant_control.div_latency(step)
    return BenchRun(
        unit="fp32",
        toplevel="fp32_div",
        sources=("fp32_div.v",),
        parameters={"STEP": step},
        tb_dir=HDL_DIR / "fp32",
        tb_module="tb_fp32_div",
        config={"n": n, "latency": latency},
    )


@pytest.mark.parametrize("simulator", SIMS)
def test_fp32_add_rtl_matches_numpy(simulator, hdl_seed, require_simulator):
    require_simulator(simulator)
    result = run_bench(fp32_add_bench(), simulator, hdl_seed)
    assert result.passed, result.summary()
    cases = {r["case"]: r["t"] for r in result.records}
    assert set(cases) == {"wide_gap", "narrow_gap", "gap_near_27", "signed_zeros", "cancellation", "ties"}
    assert min(cases.values()) >= 100, cases  # the domain filter left every set populated


def test_add_operand_sets_hit_their_corner():
    """The generators make what they claim: ties are exact halfway sums, cancellation gives zeros."""
    import sys

    sys.path.insert(0, str(HDL_DIR / "fp32"))
    from fp32_vectors import add_cases, f32

    cases = add_cases(np.random.default_rng(3), 300)
    a, b = cases["ties"]
    half = len(a) // 2
    exact = f32(a[:half]).astype(np.float64) + f32(b[:half]).astype(np.float64)
    lo = np.nextafter(f32(a[:half]) + f32(b[:half]), np.float32(-np.inf))
    hi = np.nextafter(f32(a[:half]) + f32(b[:half]), np.float32(np.inf))
    r = (f32(a[:half]) + f32(b[:half])).astype(np.float64)
    on_tie = (np.abs(exact - lo) == np.abs(r - exact)) | (np.abs(exact - hi) == np.abs(r - exact))
    assert on_tie.all()
    a, b = cases["cancellation"]
    assert (f32(a[: len(a) // 2]) + f32(b[: len(a) // 2]) == 0).all()


# STEP 4 is the engine's default, 27 the single-stage end (STEP 1, 27 stages, is lint-checked only:
# it costs ~20 s of Icarus time); Verilator runs STEP 5 (28 quotient bits, one more than needed).
DIV_CASES = [("icarus", 4), ("icarus", 27), ("verilator", 5)]


@pytest.mark.parametrize(("simulator", "step"), DIV_CASES, ids=[f"{s}-STEP{k}" for s, k in DIV_CASES])
def test_fp32_div_rtl_matches_numpy(simulator, step, hdl_seed, require_simulator):
    require_simulator(simulator)
    result = run_bench(fp32_div_bench(step), simulator, hdl_seed)
    assert result.passed, result.summary()
    cases = {r["case"]: r["t"] for r in result.records}
    assert set(cases) == {"random", "similar", "kv_scale", "zero_dividend", "exact_and_half"}
    assert min(cases.values()) >= 50, cases


def test_fp32_div_bench_catches_wrong_latency(hdl_seed, require_simulator):
    """Teeth: told a latency one cycle longer than the RTL's, the bench sees the right quotients one
    edge early and fails the timing check (one cycle shorter fails on the bits, as any shift does)."""
    require_simulator("icarus")
    run = fp32_div_bench(27, n=60)
    run.config["latency"] += 1
    result = run_bench(run, "icarus", hdl_seed)
    assert not result.passed
    assert not any(r["cycles_ok"] for r in result.records if r["case"] == "random")


@pytest.mark.parametrize(("step", "match"), [(0, "div_step"), (28, "div_step"), (2.5, "div_step")])
def test_unsupported_divider_step_fails_before_build(step, match):
    with pytest.raises(CodesignError, match=match):
        fp32_div_bench(step)


def test_div_latency_formula():
    """ceil(27 / step) quotient stages plus the input and rounding registers."""
    assert [kv_quant_control.div_latency(s) for s in (1, 4, 5, 9, 27)] == [29, 9, 8, 5, 3]
