"""Cycle model of the *controlled* int8 systolic array: start -> done of one fold on the RTL twin.

The RTL in `hdl_tests/rtl/systolic_{os,ws}.v` runs one fold of a GEMM per job. Its compute
phase takes exactly SCALE-Sim's stall-free fold cycles (`systolic.fold_cycles`); the control
around it adds a fixed number of cycles, documented here so the bench can check the sum:

    job_cycles(R, C, t, df) = fold_cycles(R, C, t, df) + INPUT_REGISTER_CYCLES + READOUT_REGISTER_CYCLES

* output-stationary (t = K): A[R][K] x B[K][C]. Operand vector k is registered at edge k (the
  input stage, +1), skewed so it meets PE(i, j) at edge i+j+k+1; the last MAC is at edge
  R+C+K-2 = the fold. Row r is final after edge r+C+K-1 and registered out at edge r+C+K, so the
  drain overlaps the compute of the lower rows and costs one readout-register cycle (+1) after
  the fold, not the R cycles of a shift-out drain (SCALE-Sim's paper counts 2R+C+K-2 for that;
  its code, and this model, count R+C+K-2 for the fold).
* weight-stationary (t = M): B[R][C] is loaded one row per cycle (R cycles, part of
  SCALE-Sim's 2R+C+M-2 fold), then A[M][R] streams; output row m is aligned by a de-skew and
  registered out at edge 2R+C+m (+1 input stage, +1 readout register).

"Cycles" counts clock edges from the one that accepts `start` up to and including the one
that raises `done`.
"""

from __future__ import annotations

from dataclasses import dataclass

from codesign.accel_model.systolic import model as systolic
from codesign.specs.errors import CodesignError, check_choice, check_positive_int

# The dataflows that have an RTL twin (input-stationary is modelled, not built).
RTL_DATAFLOWS = ("os", "ws")
# Operand vectors are registered once at the array edge before the skew registers.
INPUT_REGISTER_CYCLES = 1
# Finished output rows are registered onto the output bus (with out_valid / done).
READOUT_REGISTER_CYCLES = 1
# Port widths of the RTL: t_len is 16 bits, out_row is 16 bits.
MAX_T = 2**16 - 1
MAX_DIM = 64  # keeps Verilator builds and the R*8-bit operand ports reasonable


@dataclass(frozen=True)
class JobTiming:
    """Cycle budget of one controlled fold (see the module docstring)."""

    fold: int
    input_register: int
    readout_register: int

    @property
    def total(self) -> int:
        """start -> done cycles = fold + input_register + readout_register."""
        return self.fold + self.input_register + self.readout_register


def check_rtl_config(rows: int, cols: int, dataflow: str, t: int | None = None) -> None:
    """Raise CodesignError unless (rows, cols, dataflow[, t]) is a configuration the RTL supports.

    Supported: 1 <= rows, cols <= MAX_DIM; dataflow in RTL_DATAFLOWS; 1 <= t <= MAX_T.
    """
    check_positive_int("rows", rows)
    check_positive_int("cols", cols)
    for name, v in (("rows", rows), ("cols", cols)):
        if v > MAX_DIM:
            raise CodesignError(f"{name} must be <= {MAX_DIM} for the RTL twin, got {v}")
    if dataflow not in RTL_DATAFLOWS:
        check_choice("dataflow", dataflow, RTL_DATAFLOWS)
    if t is not None:
        check_positive_int("t", t)
        if t > MAX_T:
            raise CodesignError(f"t must be <= {MAX_T} (16-bit t_len port), got {t}")


def job_timing(rows: int, cols: int, t: int, dataflow: str) -> JobTiming:
    """Cycle budget of one job on the RTL twin; t = K for "os", t = M for "ws"."""
    check_rtl_config(rows, cols, dataflow, t)
    return JobTiming(
        fold=systolic.fold_cycles(rows, cols, t, dataflow),
        input_register=INPUT_REGISTER_CYCLES,
        readout_register=READOUT_REGISTER_CYCLES,
    )


def job_cycles(rows: int, cols: int, t: int, dataflow: str) -> int:
    """start -> done cycles of one job: fold_cycles(rows, cols, t, dataflow) + 2."""
    return job_timing(rows, cols, t, dataflow).total


def gemm_cycles(M: int, N: int, K: int, rows: int, cols: int, dataflow: str) -> int:
    """Cycles of GEMM (M, N, K) run on the RTL twin fold by fold, each fold one job, back to back.

    The next start is accepted on the edge after `done`, so jobs add up with no gap:
        folds x job_cycles(rows, cols, T, dataflow) = compute_cycles(...) + 1 + 2 x folds
    with folds and T from `systolic.operand_mapping` (a partial tile still takes a full fold, as in
    SCALE-Sim).
    """
    check_rtl_config(rows, cols, dataflow)
    row_folds, col_folds = systolic.num_folds(M, N, K, rows, cols, dataflow)
    _, _, t = systolic.operand_mapping(M, N, K, dataflow)
    return row_folds * col_folds * job_cycles(rows, cols, t, dataflow)
