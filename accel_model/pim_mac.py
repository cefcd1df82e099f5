"""One PIM bank MAC unit executing a GEMV command stream: functional model and cycle model.

The RTL twin is hdl_tests/rtl/pim_bank_mac.v; the bank-level cost model of many such units is
pim.py (`_stream_ns`). One unit has `lanes` FP16 lanes beside its bank. W [N, K] lies in the bank
row-major and contiguous (W row n, lanes-wide column c is bank column g = n * K/lanes + c, in DRAM
row g // cols_per_row, column g % cols_per_row: a W row may straddle two DRAM rows); x [K] sits in
the unit's register file (K/lanes registers of `lanes` fp16). Every column command reads one
column (lanes fp16) from the open row and lane j multiplies it by its x element.

Quantized operands (a `pim.dequant` front end) are first turned into these fp16 W operands by
`pim_dequant.py`; this path is then unchanged.

Arithmetic (exactly what the RTL does, and what `gemv` computes with numpy float32):
    p[n, c, j] = fp32(W[n, c*lanes + j]) * fp32(x[c*lanes + j])     exact: 11 x 11 = 22 significant
        bits fit in fp32's 24, and |p| >= 2^-48 or p = 0 (fp16's smallest subnormal is 2^-24), far
        above fp32's normal range limit 2^-126;
    acc[n, j] = (((p[n, 0, j] + p[n, 1, j]) + p[n, 2, j]) + ...)    fp32, round to nearest even, in
        column (command) order; the first product loads the accumulator (no add to +0, so a -0
        product keeps its sign);
    y[n] = pairwise tree over the lanes: level 1 adds lanes (0,1), (2,3), ...; level 2 adds those
        pairs' sums (0+1, 2+3), ...; log2(lanes) levels in all, each an fp32 RNE add.
Domain: finite fp16 W and x (subnormals allowed). Every intermediate is a multiple of 2^-48, so it
is zero or at least 2^-48 (never an fp32 subnormal), and |y| <= K * 65504^2 < 2^32 * K: no overflow
for any K the unit accepts. Exact cancellation gives +0 (IEEE RNE).

Timing (cycles of the unit's clock, which is the memory command clock; edge 0 accepts `start`):
    ACT row 0 at cycle 0; the first RD tRCD later; RDs every tCCD along the row; after the last
    column of a row, PRE one tCCD slot after its RD, ACT tRP later, the next RD tRCD after that;
    after the job's last RD (cycle last_rd), a closing PRE at last_rd + tCCD hands the bank back
    precharged. The datapath drains a column in DRAIN = 5 + log2(lanes) cycles, counted from its
    RD's cycle to the cycle its output is shown, inclusive: the RD, the data on the bus (registered
    at its end), the multiply, the accumulate, log2(lanes) adder-tree levels (each registered), and
    the cycle y is shown in. `done` marks the last cycle of the job:
        C = N * K / lanes columns, rows = ceil(C / cols_per_row)
        last_rd = tRCD + (C - 1) * tCCD + (rows - 1) * (tRP + tRCD)
        cycles  = last_rd + max(tCCD + tRP, DRAIN)
                = bank_cycles + max(0, DRAIN - tCCD - tRP),   bank_cycles = C * tCCD + rows * (tRP + tRCD)
bank_cycles is the time the bank is busy (ACT of row 0 to tRP after the closing PRE).

Relation to pim.py: for the same bytes per unit (reuse 1), `_stream_ns` / tCK without refresh is
    C * tCCD + rows * (tRP + tRCD) + tRCD = bank_cycles + tRCD,
one tRCD more than the command sequence needs (it charges a PRE + ACT per row and then the first
ACT again). So cycles = stream_cycles - tRCD + max(0, DRAIN - tCCD - tRP); on the HBM presets
(tCCD + tRP >= 21 > DRAIN = 9 for 16 lanes) cycles = stream_cycles - tRCD.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from codesign.specs.errors import CodesignError, check_positive_int

if TYPE_CHECKING:  # pim.py pulls in numba via dram.py: ~0.5 s per cocotb run that imports this
    from codesign.accel_model.pim import PIMSpec

LANES = (2, 4, 8, 16)  # powers of two for the adder tree; 16 = HBM-PIM's FP16 unit
MAX_N = 2**16 - 1  # 16-bit n_rows port
MAX_XCOLS = 2**16 - 1  # 16-bit k_cols port
MAX_TIMING = 2**16 - 1  # timings and columns per row: kept within the RTL's 16-bit row / column fields
MAX_ROWS = 2**16  # 16-bit cmd_row
READ_LATENCY = 2  # data on the bus the cycle after the RD, registered at the end of that cycle


@dataclass(frozen=True)
class PIMUnitConfig:
    """One unit: lanes, timings in command-clock cycles, columns per DRAM row, x registers (columns)."""

    lanes: int
    tccd: int
    trcd: int
    trp: int
    cols_per_row: int
    xcols: int = 8  # x register file depth in lanes-wide columns (HBM-PIM's GRF_A has 8)

    def __post_init__(self) -> None:
        if self.lanes not in LANES:
            raise CodesignError(f"lanes must be one of {LANES} (adder tree), got {self.lanes!r}")
        for name in ("tccd", "trcd", "trp", "cols_per_row", "xcols"):
            check_positive_int(name, getattr(self, name))
            limit = MAX_XCOLS if name == "xcols" else MAX_TIMING
            if getattr(self, name) > limit:
                raise CodesignError(f"{name} must be <= {limit} (16-bit), got {getattr(self, name)}")

    @classmethod
    def from_pim(cls, pim: PIMSpec, xcols: int = 8) -> PIMUnitConfig:
        """The unit of a PIMSpec: tCCD_L, tRCD, tRP in cycles, row_bytes / (lanes * 2 B) columns per row."""
        c = pim.memory.cycles()
        return cls(pim.lanes, c["nCCD_L"], c["nRCD"], c["nRP"], pim.memory.row_bytes // pim.col_bytes, xcols)

    @property
    def tree_levels(self) -> int:
        return self.lanes.bit_length() - 1

    @property
    def drain(self) -> int:
        """Cycles from the last RD's cycle to `done` if the closing PRE were free: 5 + log2(lanes)."""
        return READ_LATENCY + 2 + self.tree_levels + 1

    def check_shape(self, n: int, k: int) -> int:
        """Raise CodesignError unless an N x K GEMV fits the unit; return K / lanes (columns per W row)."""
        check_positive_int("n", n)
        check_positive_int("k", k)
        if n > MAX_N:
            raise CodesignError(f"n must be <= {MAX_N} (16-bit port), got {n}")
        if k % self.lanes:
            raise CodesignError(f"k must be a multiple of lanes={self.lanes}, got {k}")
        if k // self.lanes > self.xcols:
            raise CodesignError(
                f"k must be <= lanes x xcols = {self.lanes * self.xcols} (x register file), got {k}"
            )
        if -(-n * (k // self.lanes) // self.cols_per_row) > MAX_ROWS:
            raise CodesignError(
                f"n x k = {n} x {k} spans more than {MAX_ROWS} DRAM rows (16-bit row address)"
            )
        return k // self.lanes


def gemv(w: np.ndarray, x: np.ndarray, lanes: int) -> np.ndarray:
    """y = W x on one unit, float32 [N], bit-exact with the RTL (see the module docstring's order).

    w: float16 [N, K]; x: float16 [K]; K a multiple of lanes. Products exact in fp32, per-lane fp32
    RNE accumulation in column order, then the pairwise lane tree.
    """
    if lanes not in LANES:
        raise CodesignError(f"lanes must be one of {LANES}, got {lanes!r}")
    for name, a, nd in (("w", w, 2), ("x", x, 1)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float16 or a.ndim != nd:
            raise CodesignError(f"{name} must be a {nd}-D float16 numpy array")
        if not np.isfinite(a).all():
            raise CodesignError(f"{name} must be finite (no inf/NaN): the unit's domain")
    n, k = w.shape
    if n < 1 or k < 1 or x.shape[0] != k or k % lanes:
        raise CodesignError(
            f"w is {w.shape} and x has {x.shape[0]} elements: need K == len(x), K % {lanes} == 0"
        )
    cols = k // lanes
    # p[n, c, j]: exact products (float32 has room for the 22-bit significand).
    p = w.astype(np.float32).reshape(n, cols, lanes) * x.astype(np.float32).reshape(1, cols, lanes)
    acc = p[:, 0, :].copy()
    for c in range(1, cols):  # command order, one RNE add per column
        acc = acc + p[:, c, :]
    while acc.shape[1] > 1:  # the adder tree: neighbours first
        acc = acc[:, 0::2] + acc[:, 1::2]
    y = acc[:, 0]
    if not np.isfinite(y).all():  # cannot happen for K < 2^95; kept as the domain's guard
        raise CodesignError("gemv overflowed fp32: inputs outside the unit's domain")
    return y


def columns_and_rows(cfg: PIMUnitConfig, n: int, k: int) -> tuple[int, int]:
    """(C, rows): bank columns read, N * K / lanes, and DRAM rows opened, ceil(C / cols_per_row)."""
    c = n * cfg.check_shape(n, k)
    return c, -(-c // cfg.cols_per_row)


def bank_cycles(cfg: PIMUnitConfig, n: int, k: int) -> int:
    """Cycles the bank is busy: C * tCCD + rows * (tRP + tRCD) (ACT of row 0 to tRP after the last PRE)."""
    c, rows = columns_and_rows(cfg, n, k)
    return c * cfg.tccd + rows * (cfg.trp + cfg.trcd)


def unit_cycles(cfg: PIMUnitConfig, n: int, k: int) -> int:
    """start -> done cycles (inclusive) of an N x K GEMV: last_rd + max(tCCD + tRP, drain)."""
    c, rows = columns_and_rows(cfg, n, k)
    last_rd = cfg.trcd + (c - 1) * cfg.tccd + (rows - 1) * (cfg.trp + cfg.trcd)
    return last_rd + max(cfg.tccd + cfg.trp, cfg.drain)


def command_trace(cfg: PIMUnitConfig, n: int, k: int) -> list[tuple[int, str, int, int]]:
    """Every event of the job in cycle order: (cycle, kind, a, b), cycle 0 = the accepting edge.

    kinds: ("ACT", row, 0), ("RD", row, column in row), ("PRE", row, 0), ("Y", output index n, 0)
    and a final ("DONE", 0, 0). The RTL's command and output ports must show exactly this.
    """
    kcols = cfg.check_shape(n, k)
    ev: list[tuple[int, str, int, int]] = [(0, "ACT", 0, 0)]
    rd = cfg.trcd
    for g in range(n * kcols):
        row, col = divmod(g, cfg.cols_per_row)
        if col == 0 and g > 0:
            pre = rd  # one tCCD slot after the previous RD (rd has already advanced by tCCD)
            ev += [(pre, "PRE", row - 1, 0), (pre + cfg.trp, "ACT", row, 0)]
            rd = pre + cfg.trp + cfg.trcd
        ev.append((rd, "RD", row, col))
        if g % kcols == kcols - 1:  # output g // kcols leaves the tree
            ev.append((rd + cfg.drain - 1, "Y", g // kcols, 0))
        rd += cfg.tccd
    last_rd = rd - cfg.tccd
    ev.append((last_rd + cfg.tccd, "PRE", (n * kcols - 1) // cfg.cols_per_row, 0))
    ev.append((last_rd + max(cfg.tccd + cfg.trp, cfg.drain) - 1, "DONE", 0, 0))
    order = {"ACT": 0, "RD": 0, "PRE": 0, "Y": 1, "DONE": 2}
    return sorted(ev, key=lambda e: (e[0], order[e[1]]))
