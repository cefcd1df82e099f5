"""The controlled-fold cycle model: SCALE-Sim's fold plus the RTL's documented control cycles.

The fold formulas are cross-checked against SCALE-Sim's code independently of
codesign.accel_model.systolic: os R+C+T-2 (systolic_compute_os.py: T rows, C-1 suffix, R-1 skew)
and ws 2R+C+T-2 (systolic_compute_ws.py: R prefix, T rows, C-1 suffix, R-1 skew).
"""

from __future__ import annotations

import numpy as np
import pytest

from codesign.accel_model.systolic import control as systolic_control
from codesign.specs.errors import CodesignError


@pytest.mark.parametrize(("rows", "cols", "t"), [(1, 1, 1), (2, 2, 3), (3, 5, 7), (8, 8, 17), (4, 6, 1)])
def test_job_cycles_is_scalesim_fold_plus_two(rows, cols, t):
    assert systolic_control.job_cycles(rows, cols, t, "os") == (rows + cols + t - 2) + 2
    assert systolic_control.job_cycles(rows, cols, t, "ws") == (2 * rows + cols + t - 2) + 2
    timing = systolic_control.job_timing(rows, cols, t, "ws")
    assert (timing.input_register, timing.readout_register) == (1, 1)
    assert timing.total == timing.fold + 2


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((4, 4, 3, "is"), "dataflow"),
        ((4, 4, 3, "OS"), "dataflow"),
        ((0, 4, 3, "os"), "rows"),
        ((4, 65, 3, "ws"), "cols"),
        ((4, 4, 0, "os"), "t"),
        ((4, 4, 2**16, "ws"), "t"),
        ((4.0, 4, 3, "os"), "rows"),
    ],
)
def test_bad_rtl_config_names_the_argument(args, match):
    with pytest.raises(CodesignError, match=match):
        systolic_control.job_cycles(*args)


@pytest.mark.parametrize("dataflow", ["os", "ws"])
@pytest.mark.parametrize(
    ("M", "N", "K", "rows", "cols"), [(7, 9, 5, 4, 4), (16, 3, 33, 8, 2), (1, 1, 1, 1, 1)]
)
def test_gemm_cycles_is_scalesim_total_plus_control(dataflow, M, N, K, rows, cols):
    from codesign.accel_model.systolic import model as systolic

    folds = np.prod(systolic.num_folds(M, N, K, rows, cols, dataflow))
    expect = systolic.compute_cycles(M, N, K, rows, cols, dataflow) + 1 + 2 * folds
    assert systolic_control.gemm_cycles(M, N, K, rows, cols, dataflow) == expect
