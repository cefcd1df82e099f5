"""The int4 dequant-MAC lane RTL is bit- and cycle-exact against codesign.accel_model.dequant_mac.

Each case builds rtl/dequant_mac_lane.v for one (lanes, codes per cycle, group size) on one
simulator and runs dequant_mac/tb_dequant_mac.py: five back-to-back random jobs (1 to 9 groups,
one with every field at an end of its range), outputs compared with `dequant_mac.dequant_mac`
and start -> done counts with `dequant_mac.lane_cycles`. The teeth tests inject a one-line fault.
"""

from __future__ import annotations

import numpy as np
import pytest
from hdl_benches import DequantConfig, dequant_bench, dequant_matrix
from hdl_sim import matrix_cases, run_bench

from codesign.accel_model import dequant_mac
from codesign.specs.errors import CodesignError


@pytest.mark.parametrize(("simulator", "cfg"), matrix_cases(dequant_matrix))
def test_dequant_mac_rtl_matches_model(simulator, cfg, hdl_seed, require_simulator):
    require_simulator(simulator)
    result = run_bench(dequant_bench(cfg), simulator, hdl_seed)
    assert result.passed, result.summary()
    assert len(result.records) == 5


@pytest.mark.parametrize(
    ("fault", "broken"),
    # Both faults change the numbers, not the timing: the job's last word always closes a group.
    [(1, "bits_ok"), (2, "bits_ok")],
    ids=["group-counter-off-by-one", "zero-not-subtracted"],
)
def test_dequant_mac_bench_catches_injected_fault(fault, broken, hdl_seed, require_simulator):
    require_simulator("icarus")
    result = run_bench(dequant_bench(DequantConfig(3, 2, 6, fault)), "icarus", hdl_seed)
    assert not result.passed, f"bench passed with FAULT={fault} injected: it has no teeth"
    assert any(not r[broken] for r in result.records), result.records


def test_dequant_model_matches_dequantize_then_dot():
    """Independent reference: dequantize every weight in float64, then dot with x (exact here)."""
    rng = np.random.default_rng(5)
    lanes, g, n_groups = 3, 8, 5
    x = rng.integers(-(2**15), 2**15, n_groups * g)
    q = rng.integers(0, 16, (lanes, n_groups * g))
    s = rng.integers(-(2**15), 2**15, (lanes, n_groups))
    z = rng.integers(0, 16, (lanes, n_groups))
    w = (q - np.repeat(z, g, axis=1)).astype(np.float64) * np.repeat(s, g, axis=1)
    assert np.array_equal(dequant_mac.dequant_mac(x, q, s, z, g), (w @ x.astype(np.float64)).astype(np.int64))
    assert dequant_mac.lane_cycles(n_groups * g, 4) == n_groups * g // 4 + 3


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (DequantConfig(2, 3, 6), "codes_per_cycle"),
        (DequantConfig(2, 4, 6), "group_size"),
        (DequantConfig(0, 4, 8), "lanes"),
        (DequantConfig(2, 4, 8, fault=9), "fault"),
    ],
)
def test_unsupported_dequant_config_fails_before_build(cfg, match):
    with pytest.raises(CodesignError, match=match):
        dequant_bench(cfg)
