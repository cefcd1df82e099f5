"""The area model against the RTL twins synthesized by Yosys (table: rtl_area.yaml).

Relative to the int8 MAC lane, every unit the model has a figure for is within 2x of its synthesized twin
(the fp32 adder takes its twin's ratio, not Horowitz's figure: energy.py). One small unit is re-synthesized
here so the table cannot drift from the RTL.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from synth_area import FP32_ADD, PE_WS, TABLE, UNITS, synth_transistors

from codesign.accel_model import energy
from codesign.accel_model.energy import EnergyModel

EM45 = EnergyModel(45)
# The model's 45 nm figure for each unit (None: the model has none; see the table's `model` field).
MODEL_UM2 = {
    UNITS[0].name: EM45.mac_um2("int8"),
    UNITS[1].name: None,
    UNITS[2].name: energy.PIM_MAC_FP16_UM2,
    UNITS[3].name: EM45.kvq_lane_um2(),
    UNITS[4].name: energy.FP32_ADD_UM2,
    UNITS[5].name: energy.PIM_DEQUANT_LANE_UM2,
}


def _table() -> dict:
    return yaml.safe_load(TABLE.read_text())


def test_table_lists_every_unit_relative_to_the_int8_mac():
    t = _table()
    assert list(t["units"]) == [u.name for u in UNITS] and t["reference"] == UNITS[0].name
    ref = t["units"][UNITS[0].name]["transistors"]
    for row in t["units"].values():
        assert row["relative"] == round(row["transistors"] / ref, 3)


@pytest.mark.parametrize("unit", [u.name for u in UNITS if MODEL_UM2[u.name] is not None])
def test_model_area_within_2x_of_the_rtl(unit):
    rows = _table()["units"]
    model_rel = MODEL_UM2[unit] / MODEL_UM2[UNITS[0].name]
    assert 0.5 <= model_rel / rows[unit]["relative"] <= 2.0, (model_rel, rows[unit]["relative"])


def test_fp32_adder_figure_is_the_twins_ratio():
    rel = _table()["units"][UNITS[4].name]["relative"]
    assert energy.FP32_ADD_UM2 == pytest.approx(rel * 419.0, abs=1.0)
    assert 4184.0 / 419.0 / rel > 2.0  # Horowitz's figure, which the check above would refuse


@pytest.mark.skipif(shutil.which("yosys") is None, reason="yosys not installed (Debian: apt-get install yosys)")
def test_resynthesized_fp32_adder_matches_the_table():
    t = _table()
    (pe, _), (add, _) = synth_transistors(PE_WS), synth_transistors(FP32_ADD)
    rows = t["units"]
    if subprocess.run(["yosys", "-V"], capture_output=True, text=True).stdout.strip() == t["tool"]:
        assert (pe, add) == (rows[UNITS[0].name]["transistors"], rows[UNITS[4].name]["transistors"])
    assert add / pe == pytest.approx(rows[UNITS[4].name]["relative"], rel=0.05)
