"""The RTL benches and the configuration matrix they run over (shared by the pytest entries and report.py).

Each unit has a function turning a configuration into a `BenchRun` (checking it first, so an
unsupported combination fails with a CodesignError before any simulator starts) and a list of
the configurations the suite runs on each simulator. The Verilator matrix is kept lean: each
Verilator build costs ~10 s of C++ compilation, an Icarus build well under 1 s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hdl_bench_kvq import KVQ_TEETH, kvq_bench, kvq_matrix
from hdl_bench_pim import PIM_TEETH, pim_bench, pim_matrix
from hdl_sim import HDL_DIR, BenchRun, check_fault, check_simulator, fault_tag

from codesign.accel_model import dequant_mac, pim_dequant
from codesign.accel_model.systolic import control as systolic_control
from codesign.specs.errors import check_choice, check_positive_int

# Fault ids understood by the systolic RTL's FAULT parameter (bench teeth only).
SYSTOLIC_FAULTS = {0: "none", 1: "drain counter off by one", 2: "wrong accumulate"}


@dataclass(frozen=True)
class SystolicConfig:
    """One systolic-array RTL configuration: R x C, dataflow, injected fault."""

    rows: int
    cols: int
    dataflow: str
    fault: int = 0

    @property
    def label(self) -> str:
        return f"{self.dataflow} {self.rows}x{self.cols}{fault_tag(self.fault)}"


def systolic_t_values(cfg: SystolicConfig) -> list[int]:
    """Jobs per run (t = K for os, M for ws): t = 1, a few small odd ones and one longer.

    t = 1 is the shortest legal job; t around R + C checks that overlapping drain and
    compute never read a row early; 17 exceeds every tested array side.
    """
    edge = cfg.rows + cfg.cols + 1
    return [1, 3, edge if edge not in (1, 2, 3, 5, 17) else 2 * edge + 1, 2, 17, 5]


def systolic_sources(dataflow: str) -> tuple[str, ...]:
    """RTL files of the `dataflow` ("os"/"ws") array: top, shared job control, PE, skew/de-skew line."""
    return (f"systolic_{dataflow}.v", "sa_job_ctrl.v", f"sa_pe_{dataflow}.v", "delay_line.v")


def systolic_bench(cfg: SystolicConfig) -> BenchRun:
    """The BenchRun of one systolic configuration; CodesignError if the RTL does not support it."""
    systolic_control.check_rtl_config(cfg.rows, cfg.cols, cfg.dataflow)
    check_fault(cfg.fault, SYSTOLIC_FAULTS)
    t_values = systolic_t_values(cfg)
    for t in t_values:
        systolic_control.check_rtl_config(cfg.rows, cfg.cols, cfg.dataflow, t)
    top = f"systolic_{cfg.dataflow}"
    return BenchRun(
        unit="systolic",
        toplevel=top,
        sources=systolic_sources(cfg.dataflow),
        parameters={"ROWS": cfg.rows, "COLS": cfg.cols, "FAULT": cfg.fault},
        tb_dir=HDL_DIR / "systolic",
        tb_module="tb_systolic",
        config={"rows": cfg.rows, "cols": cfg.cols, "dataflow": cfg.dataflow, "t_values": t_values},
    )


_SIZES_ICARUS = ((2, 2), (4, 4), (8, 8), (3, 5))
_SIZES_VERILATOR = ((4, 4), (3, 5))  # lean: ~10 s of C++ build each


def systolic_matrix(simulator: str) -> list[SystolicConfig]:
    """Configurations the suite runs on `simulator` (all sizes on Icarus, two per dataflow on Verilator)."""
    check_simulator(simulator)
    sizes = _SIZES_ICARUS if simulator == "icarus" else _SIZES_VERILATOR
    return [SystolicConfig(r, c, df) for df in systolic_control.RTL_DATAFLOWS for r, c in sizes]


# Fault ids understood by the dequant-MAC RTL's FAULT parameter (bench teeth only).
DEQUANT_FAULTS = {0: "none", 1: "group counter off by one", 2: "zero point not subtracted"}


@dataclass(frozen=True)
class DequantConfig:
    """One int4 dequant-MAC configuration: lanes, codes per cycle, group size, injected fault."""

    lanes: int
    codes_per_cycle: int
    group_size: int
    fault: int = 0

    @property
    def label(self) -> str:
        return f"L={self.lanes} P={self.codes_per_cycle} G={self.group_size}{fault_tag(self.fault)}"


# Groups per job: one group, several, and one long job.
DEQUANT_GROUPS = [1, 3, 2, 9, 4]


def dequant_bench(cfg: DequantConfig) -> BenchRun:
    """The BenchRun of one dequant-MAC configuration; CodesignError if the RTL does not support it."""
    for n in DEQUANT_GROUPS:
        dequant_mac.check_lane_config(cfg.lanes, cfg.codes_per_cycle, cfg.group_size, n)
    check_fault(cfg.fault, DEQUANT_FAULTS)
    return BenchRun(
        unit="dequant_mac",
        toplevel="dequant_mac_lane",
        sources=("dequant_mac_lane.v",),
        parameters={
            "LANES": cfg.lanes,
            "CPC": cfg.codes_per_cycle,
            "GROUP": cfg.group_size,
            "FAULT": cfg.fault,
        },
        tb_dir=HDL_DIR / "dequant_mac",
        tb_module="tb_dequant_mac",
        config={
            "lanes": cfg.lanes,
            "codes_per_cycle": cfg.codes_per_cycle,
            "group_size": cfg.group_size,
            "t_values": DEQUANT_GROUPS,
        },
    )


def dequant_matrix(simulator: str) -> list[DequantConfig]:
    """Configurations the suite runs on `simulator` (four on Icarus, one on Verilator)."""
    check_simulator(simulator)
    if simulator == "verilator":
        return [DequantConfig(2, 4, 8)]
    return [DequantConfig(1, 1, 4), DequantConfig(2, 4, 8), DequantConfig(4, 8, 32), DequantConfig(3, 2, 6)]


# Fault ids understood by the PIM dequant lane's FAULT parameter (bench teeth only).
PIM_DEQUANT_FAULTS = {0: "none", 1: "fused single rounding", 2: "fp16 conversion truncates"}


@dataclass(frozen=True)
class PimDequantConfig:
    """One PIM dequantizing front-end lane configuration: code width (the BITS parameter), injected fault."""

    bits: int
    fault: int = 0

    @property
    def label(self) -> str:
        return f"bits={self.bits}{fault_tag(self.fault)}"


def pim_dequant_bench(cfg: PimDequantConfig, n: int = 60) -> BenchRun:
    """The BenchRun of one lane configuration (`n` elements per directed operand set); CodesignError if
    the RTL does not support it."""
    check_choice("bits", check_positive_int("bits", cfg.bits), pim_dequant.INT_BITS)
    check_fault(cfg.fault, PIM_DEQUANT_FAULTS)
    return BenchRun(
        unit="pim_dequant",
        toplevel="pim_dequant_lane",
        sources=("pim_dequant_lane.v", "u8_mul_fp16.v", "fp32_add.v", "fp32_to_fp16.v"),
        parameters={"BITS": cfg.bits, "FAULT": cfg.fault},
        tb_dir=HDL_DIR / "pim_dequant",
        tb_module="tb_pim_dequant",
        config={"bits": cfg.bits, "n": n},
    )


def pim_dequant_matrix(simulator: str) -> list[PimDequantConfig]:
    """Configurations per simulator: every code width on Icarus, 8-bit codes (the widest product and
    the only width whose two roundings can differ from one) on Verilator."""
    check_simulator(simulator)
    bits = (8,) if simulator == "verilator" else pim_dequant.INT_BITS
    return [PimDequantConfig(b) for b in bits]


# Teeth run with 8-bit codes: the fused-rounding fault only shows on double-rounding cases.
PIM_DEQUANT_TEETH = (PimDequantConfig(8, 1), PimDequantConfig(8, 2))


@dataclass(frozen=True)
class Unit:
    """A unit's bench: configurations per simulator, the BenchRun of one, and its fault-injected twins."""

    matrix: Callable[[str], list]
    bench: Callable[..., BenchRun]
    teeth: tuple  # configurations with a fault injected; the bench must fail on each (Icarus)


# report.py and the tests walk this.
UNITS = {
    "systolic": Unit(
        systolic_matrix,
        systolic_bench,
        tuple(SystolicConfig(3, 5, df, f) for df in ("os", "ws") for f in (1, 2)),
    ),
    "dequant_mac": Unit(
        dequant_matrix, dequant_bench, (DequantConfig(3, 2, 6, 1), DequantConfig(3, 2, 6, 2))
    ),
    "pim_mac": Unit(pim_matrix, pim_bench, PIM_TEETH),
    "kv_quant": Unit(kvq_matrix, kvq_bench, KVQ_TEETH),
    "pim_dequant": Unit(pim_dequant_matrix, pim_dequant_bench, PIM_DEQUANT_TEETH),
}
