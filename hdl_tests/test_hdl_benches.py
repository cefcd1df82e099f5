"""The bench configuration matrix outside a simulator: every unit refuses an unknown simulator and an
unknown or malformed fault id before any build, labels name each configuration once, and the pytest
cases cover every simulator with the label as id."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hdl_benches import UNITS
from hdl_sim import SIMULATORS, matrix_cases

from codesign.specs.errors import CodesignError


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_unknown_simulator_and_fault_are_refused(unit):
    u = UNITS[unit]
    with pytest.raises(CodesignError, match=r"^simulator must be one of icarus, verilator; got 'xcelium'$"):
        u.matrix("xcelium")
    cfg = u.teeth[0]
    with pytest.raises(CodesignError, match=r"^fault must be one of 0, 1, 2; got 7$"):
        u.bench(replace(cfg, fault=7))
    for bad in (-1, True, 1.5):
        with pytest.raises(CodesignError, match=r"^fault must be a non-negative integer"):
            u.bench(replace(cfg, fault=bad))


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_labels_and_cases(unit):
    u = UNITS[unit]
    for sim in SIMULATORS:
        labels = [c.label for c in u.matrix(sim)]
        assert len(set(labels)) == len(labels) and not any("fault" in s for s in labels), labels
    teeth = [c.label for c in u.teeth]
    assert all(s.endswith(f" fault={c.fault}") for s, c in zip(teeth, u.teeth, strict=True)), teeth
    cases = matrix_cases(u.matrix)
    assert [c.values for c in cases] == [(s, c) for s in SIMULATORS for c in u.matrix(s)]
    assert [c.id for c in cases] == [f"{s}-{c.label.replace(' ', '-')}" for s, c in (c.values for c in cases)]
