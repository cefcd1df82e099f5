"""The int8 systolic-array RTL (OS and WS) is bit- and cycle-exact against codesign.accel_model.

Each case builds rtl/systolic_<dataflow>.v for one size on one simulator and runs
systolic/tb_systolic.py: six back-to-back random jobs per build (t = 1 .. 17, one all-extreme
job), every output row compared with `systolic.functional_gemm` and every start -> done count
with `systolic_control.job_cycles`. The teeth tests inject a one-line RTL fault and require the
same bench to fail, for the reason the fault implies.
"""

from __future__ import annotations

import pytest
from hdl_benches import SystolicConfig, systolic_bench, systolic_matrix
from hdl_sim import matrix_cases, run_bench

from codesign.specs.errors import CodesignError


@pytest.mark.parametrize(("simulator", "cfg"), matrix_cases(systolic_matrix))
def test_systolic_rtl_matches_model(simulator, cfg, hdl_seed, require_simulator):
    require_simulator(simulator)
    result = run_bench(systolic_bench(cfg), simulator, hdl_seed)
    assert result.passed, result.summary()
    assert len(result.records) == 6
    assert all(r["rtl_cycles"] == r["model_cycles"] for r in result.records)


@pytest.mark.parametrize("dataflow", ["os", "ws"])
@pytest.mark.parametrize(
    ("fault", "broken"),
    # Reading a row one edge early ends the job a cycle early and reads a row not yet final.
    [(1, "cycles_ok"), (2, "bits_ok")],
    ids=["drain-off-by-one", "wrong-accumulate"],
)
def test_systolic_bench_catches_injected_fault(dataflow, fault, broken, hdl_seed, require_simulator):
    require_simulator("icarus")
    result = run_bench(systolic_bench(SystolicConfig(3, 5, dataflow, fault)), "icarus", hdl_seed)
    assert not result.passed, f"bench passed with FAULT={fault} injected: it has no teeth"
    assert result.records, "the faulty run produced no job records"
    assert any(not r[broken] for r in result.records), result.records


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (SystolicConfig(4, 4, "is"), "dataflow"),
        (SystolicConfig(0, 4, "os"), "rows"),
        (SystolicConfig(4, 65, "ws"), "cols"),
        (SystolicConfig(4, 4, "os", fault=7), "fault"),
    ],
)
def test_unsupported_systolic_config_fails_before_build(cfg, match):
    with pytest.raises(CodesignError, match=match):
        systolic_bench(cfg)
