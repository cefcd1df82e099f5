"""The PIM bank MAC RTL is bit-, trace- and cycle-exact against codesign.accel_model.pim_mac.

Each case builds rtl/pim_bank_mac.v (with fp16_mul_fp32.v and fp32_add.v) for one configuration
on one simulator and runs pim_mac/tb_pim_mac.py: six back-to-back GEMVs (random, tie-heavy and
cancelling operands; N from 1 to 17, several over two or more DRAM rows), each y compared bit for
bit with `pim_mac.gemv`, every command / output cycle with `pim_mac.command_trace`, start -> done
with `pim_mac.unit_cycles`, and the DRAM timing rules checked by the bench's own bank. The teeth
tests inject a one-line fault and require the bench to fail for the reason the fault implies.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hdl_bench_pim import PIM_TEETH, PimConfig, make_job, pim_bench, pim_jobs, pim_matrix
from hdl_sim import HDL_DIR, BenchRun, matrix_cases, run_bench

from codesign.accel_model import pim_mac
from codesign.specs.errors import CodesignError


@pytest.mark.parametrize(("simulator", "cfg"), matrix_cases(pim_matrix))
def test_pim_mac_rtl_matches_model(simulator, cfg, hdl_seed, require_simulator):
    require_simulator(simulator)
    result = run_bench(pim_bench(cfg), simulator, hdl_seed)
    assert result.passed, result.summary()
    assert len(result.records) == len(pim_jobs(cfg))


def test_fp16_mul_rtl_matches_numpy(hdl_seed, require_simulator):
    """The multiplier alone: 5 operand sets (normals, subnormals, signed zeros, range ends) x 120 pairs."""
    require_simulator("icarus")
    run = BenchRun(
        unit="pim_mac",
        toplevel="fp16_mul_fp32",
        sources=("fp16_mul_fp32.v",),
        parameters={},
        tb_dir=HDL_DIR / "pim_mac",
        tb_module="tb_fp16_mul",
        config={"n": 120},
    )
    result = run_bench(run, "icarus", hdl_seed)
    assert result.passed, result.summary()
    assert len(result.records) == 5 and all(r["t"] == 120 for r in result.records)


@pytest.mark.parametrize(
    ("fault", "broken"),
    # A short PRE -> ACT breaks tRP (the bank flags it), the command trace and the cycle count on
    # every job with a row switch; rounding toward zero changes y on the tie-heavy jobs.
    [(1, ("protocol_ok", "trace_ok", "cycles_ok")), (2, ("bits_ok",))],
    ids=["row-switch-off-by-one", "accumulate-truncates"],
)
def test_pim_mac_bench_catches_injected_fault(fault, broken, hdl_seed, require_simulator):
    require_simulator("icarus")
    result = run_bench(pim_bench(PIM_TEETH[fault - 1]), "icarus", hdl_seed)
    assert not result.passed, f"bench passed with FAULT={fault} injected: it has no teeth"
    assert result.records, "the faulty run produced no job records"
    for flag in broken:
        assert any(not r[flag] for r in result.records), (flag, result.records)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (PimConfig(3, 1, 1, 1, 4), "lanes"),
        (PimConfig(32, 1, 1, 1, 4), "lanes"),
        (PimConfig(4, 0, 1, 1, 4), "tccd"),
        (PimConfig(4, 1, 1, 1, 0), "cols_per_row"),
        (PimConfig(4, 1, 70000, 1, 4), "trcd"),
        (PimConfig(4, 1, 1, 1, 4, xcols=0), "xcols"),
        (PimConfig(4, 1, 1, 1, 4, fault=3), "fault"),
        (PimConfig(4, 1, 1, 1, 4, fault=1), "trp"),
    ],
)
def test_unsupported_pim_config_fails_before_build(cfg, match):
    with pytest.raises(CodesignError, match=match):
        pim_bench(cfg)


def test_matrix_covers_lanes_row_crossings_and_both_job_endings():
    """Icarus runs lanes 2/4/8/16; every config has 2+ jobs over several DRAM rows and N >= 2 jobs;
    some configs end on the datapath drain, others on the closing PRE's tRP."""
    icarus = pim_matrix("icarus")
    assert {c.lanes for c in icarus} == set(pim_mac.LANES)
    endings = set()
    for cfg in icarus + pim_matrix("verilator"):
        unit = cfg.unit
        rows = [pim_mac.columns_and_rows(unit, n, kc * cfg.lanes)[1] for n, kc, _ in pim_jobs(cfg)]
        assert sum(r >= 2 for r in rows) >= 2 and sum(r >= 3 for r in rows) >= 1, (cfg, rows)
        assert sum(n >= 2 for n, _, _ in pim_jobs(cfg)) >= 4
        endings.add((unit.drain > unit.tccd + unit.trp) - (unit.drain < unit.tccd + unit.trp))
    assert endings == {-1, 0, 1}


def _rne_fp32(q: Fraction) -> tuple[Fraction, bool]:
    """q rounded to binary32 (nearest even, normal range) and whether it was an exact tie."""
    if q == 0:
        return q, False
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e -= Fraction(2) ** e > a
    ulp = Fraction(2) ** (e - 23)
    f = math.floor(a / ulp)
    rem = a / ulp - f
    f += rem > Fraction(1, 2) or (rem == Fraction(1, 2) and f % 2 == 1)
    return (f * ulp if q > 0 else -f * ulp), rem == Fraction(1, 2)


@pytest.mark.parametrize("lanes", [2, 4, 16])
def test_tie_jobs_exercise_ties_and_rounding_direction(lanes):
    """The 'ties' operands make many accumulate adds exact ties, and many round away from zero
    (where truncation, FAULT=2, differs): counted in exact rational arithmetic."""
    rng = np.random.default_rng()
    w, x = make_job(rng, lanes, 4, 6, "ties")
    ties = away = adds = 0
    for r in range(4):
        for j in range(lanes):
            acc = Fraction(float(w[r, j])) * Fraction(float(x[j]))
            for c in range(1, 6):
                exact = acc + Fraction(float(w[r, c * lanes + j])) * Fraction(float(x[c * lanes + j]))
                acc, tie = _rne_fp32(exact)
                adds += 1
                ties += tie
                away += abs(acc) > abs(exact)
    # Over 300 seeds: ties >= 20% and away >= 7.5% of the adds at 2 lanes (more at 4 and 16).
    assert ties >= adds // 8 and away >= adds // 16, (ties, away, adds)


def test_cancel_jobs_produce_signed_zero_and_cancelled_outputs():
    rng = np.random.default_rng()
    w, x = make_job(rng, 4, 3, 4, "cancel")
    y = pim_mac.gemv(w, x, 4)
    assert y[0] == 0  # the all-zero W row
    assert y[2] == 0 and not np.signbit(y[2])  # the last row's lanes cancel pairwise in the tree
