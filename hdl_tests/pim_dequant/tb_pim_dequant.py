"""cocotb bench for one PIM dequantizing front-end lane (rtl/pim_dequant_lane.v), against
codesign.accel_model.pim_dequant.

Parts, as in the other benches: a Driver streams elements (code, scale, zero) one a cycle with
in_valid, junk (X on Icarus, random bits on Verilator) on the data inputs whenever in_valid is low;
a Monitor records every out_valid cycle's w and refuse (X/Z-checked; out_valid is checked every
cycle); a Model asks pim_dequant (`dequant_operand` per element, `LANE_LATENCY`, `lane_cycles`) via
pdq_vectors.model; an in-order Scoreboard compares, per operand set (pdq_vectors.element_sets), every
w bit (elements the model accepts), every refuse flag (= the model refuses), the order, each
element's latency and the set's cycle count.

Each set streams back to back (its cycle count must be `lane_cycles(n)`), except "per_token", which
streams with random bubbles (its span, bubbles included, must be `lane_cycles(span)`); a random idle
gap separates sets. Signals are driven and sampled on falling edges: an element driven in cycle c is
sampled at edge c + 1, and its output is seen in cycle c + 1 + latency.

Configuration in $CODESIGN_HDL_CONFIG ({"bits": 2/4/8, "n": elements per directed set}); records
to $CODESIGN_HDL_RECORDS. Numpy only (no torch in the simulator process).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cocotb
import numpy as np
from cocotb.simtime import get_sim_time
from cocotb.triggers import FallingEdge
from cocotb.types import LogicArray
from pdq_vectors import element_sets, model
from tb_util import bench_config, check_verdict, read_resolved, reset_and_monitor, write_records

from codesign.accel_model import pim_dequant

PERIOD_NS = 10
BUBBLY = "per_token"  # the set streamed with random bubbles


def _cycle() -> int:
    """Index of the cycle whose falling edge is now (falling edges at P/2 + tP)."""
    return int(get_sim_time("ns") // PERIOD_NS)


@dataclass
class Observed:
    out: list[tuple[int, int, int]] = field(default_factory=list)  # (cycle, w bits, refuse)


class Driver:
    def __init__(self, dut, rng: np.random.Generator) -> None:
        self.dut, self.rng = dut, rng
        self.four_state = "verilator" not in cocotb.SIM_NAME.lower()
        self.in_cycles: list[int] = []  # drive cycle of every element, in order

    def _junk(self) -> None:
        for name in ("code", "scale", "zero"):
            sig = getattr(self.dut, name)
            sig.value = (
                LogicArray("X" * len(sig)) if self.four_state else int(self.rng.integers(0, 1 << len(sig)))
            )

    def idle(self) -> None:
        self.dut.in_valid.value = 0
        self._junk()

    async def stream(self, codes, scale, zero, bubble_p: float) -> None:
        """Drive every element, one a cycle, with a bubble before each with probability bubble_p."""
        for c, s, z in zip(codes.tolist(), scale.tolist(), zero.tolist()):
            while self.in_cycles and self.rng.random() < bubble_p:
                self.idle()
                await FallingEdge(self.dut.clk)
            self.dut.in_valid.value = 1
            self.dut.code.value, self.dut.scale.value, self.dut.zero.value = c, s, z
            self.in_cycles.append(_cycle())
            await FallingEdge(self.dut.clk)
        self.idle()


class Monitor:
    def __init__(self, dut) -> None:
        self.dut = dut
        self.errors: list[str] = []
        self.obs = Observed()

    async def run(self) -> None:
        while True:
            await FallingEdge(self.dut.clk)
            t = _cycle()
            if read_resolved(self.dut.out_valid, self.errors, f"cycle {t}"):
                w = read_resolved(self.dut.w, self.errors, f"cycle {t}")
                r = read_resolved(self.dut.refuse, self.errors, f"cycle {t}")
                self.obs.out.append((t, -1 if w is None else w, -1 if r is None else r))


class Scoreboard:
    """One record per operand set: bits, refusals, order, per-element latency, cycle count."""

    def __init__(self, log, bits: int) -> None:
        self.log, self.bits = log, bits
        self.records: list[dict] = []

    def check(self, name: str, elems, in_cycles: list[int], out: list, xz_errors: int) -> None:
        codes, scale, zero = elems
        want_w, want_refuse = model(codes, scale, zero, self.bits)
        n = len(codes)
        got_w = np.array([o[1] for o in out], np.int64)
        got_r = np.array([o[2] for o in out], np.int64)
        complete = len(out) == n
        ok_w = ~want_refuse
        bits_ok = complete and bool(np.array_equal(got_w[ok_w], want_w[ok_w].astype(np.int64)))
        refuse_ok = complete and bool(np.array_equal(got_r, want_refuse.astype(np.int64)))
        lat = [o[0] - (c + 1) for o, c in zip(out, in_cycles)]
        span = in_cycles[-1] - in_cycles[0] + 1  # input cycles, bubbles included
        model_cycles = pim_dequant.lane_cycles(span)
        rtl_cycles = (out[-1][0] - (in_cycles[0] + 1) + 1) if out else -1  # edges, inclusive
        rec = {
            "t": n,
            "case": name,
            "bits": self.bits,
            "refused": int(want_refuse.sum()),
            "model_cycles": model_cycles,
            "rtl_cycles": rtl_cycles,
            "bits_ok": bits_ok,
            "refuse_ok": refuse_ok,
            "order_ok": complete,
            "cycles_ok": complete
            and all(x == pim_dequant.LANE_LATENCY for x in lat)
            and rtl_cycles == model_cycles
            and (name == BUBBLY or span == n),
            "xz_ok": xz_errors == 0,
        }
        rec["ok"] = all(rec[k] for k in ("bits_ok", "refuse_ok", "order_ok", "cycles_ok", "xz_ok"))
        if not bits_ok and complete:
            wrong = np.flatnonzero(ok_w & (got_w != want_w.astype(np.int64)))
            bad = wrong[:5]
            rec["n_wrong"] = int(wrong.size)
            rec["wrong_elements"] = [[int(codes[i]), int(scale[i]), int(zero[i]), int(got_w[i])] for i in bad]
            rec["first_mismatches"] = [
                f"code {codes[i]} scale {scale[i]:#06x} zero {zero[i]:#06x}: rtl {got_w[i]:#06x} "
                f"model {want_w[i]:#06x}"
                for i in bad
            ]
        if not refuse_ok and complete:
            bad = np.flatnonzero(got_r != want_refuse)[:5]
            rec["refuse_mismatches"] = [
                f"code {codes[i]} scale {scale[i]:#06x} zero {zero[i]:#06x}: rtl {got_r[i]} "
                f"model {int(want_refuse[i])}"
                for i in bad
            ]
        if not rec["cycles_ok"]:
            rec["latencies"] = sorted(set(lat))[:5]
        self.log.info("set %s", {k: v for k, v in rec.items() if k != "latencies"})
        self.records.append(rec)


@cocotb.test()
async def pim_dequant_lane_matches_model(dut):
    """Every operand set: bit-exact operands, refusals as the model's, latency LANE_LATENCY."""
    cfg, seed = bench_config(dut)
    bits = int(cfg["bits"])
    rng = np.random.default_rng(seed)
    sets = element_sets(rng, bits, n=int(cfg["n"]))
    driver, monitor, board = Driver(dut, rng), Monitor(dut), Scoreboard(dut._log, bits)
    driver.idle()
    await reset_and_monitor(dut, PERIOD_NS, monitor.run())
    try:
        for name, elems in sets.items():
            driver.in_cycles = []
            first_out = len(monitor.obs.out)
            xz_before = len(monitor.errors)
            await driver.stream(*elems, bubble_p=0.3 if name == BUBBLY else 0.0)
            # Drain: the last output plus a few idle cycles (a late or extra output shows up here).
            for _ in range(pim_dequant.LANE_LATENCY + 2 + int(rng.integers(0, 4))):
                await FallingEdge(dut.clk)
            out = monitor.obs.out[first_out:]
            board.check(name, elems, driver.in_cycles, out, len(monitor.errors) - xz_before)
    finally:
        write_records(board.records, seed)
    check_verdict(board.records, monitor.errors)
