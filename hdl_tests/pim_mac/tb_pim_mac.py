"""cocotb bench for the PIM bank MAC unit (rtl/pim_bank_mac.v), against codesign.accel_model.pim_mac.

The parts, as in the other benches: a Driver loads x into the unit's register file and starts a
GEMV; a Bank plays the DRAM bank (W laid out as pim_mac describes): it answers each RD with that
column's fp16 words on col_data the next cycle (X, or random bits on Verilator, at every other
time), and checks the DRAM timing the unit must obey (one command a cycle, RD only to the open row
and tRCD after its ACT, RD-RD and RD-PRE >= tCCD, ACT tRP after a PRE, PRE only with a row open),
independently of the model; a Monitor records every command, y output and done, cycle by cycle; a
Model asks pim_mac for y (`gemv`), the command trace (`command_trace`) and the cycles
(`unit_cycles`); an in-order Scoreboard compares y bit for bit (fp32 patterns: -0 != +0), the
whole trace, and start -> done cycles.

Signals are driven and sampled on falling edges; cycle t is the one after rising edge t, and
falling edge t sits in its middle, so cycle numbers come straight from simulation time. A job
that reuses the previous job's x starts in the cycle `done` is seen (the tRP boundary).

Configuration in $CODESIGN_HDL_CONFIG (lanes, tccd, trcd, trp, cols_per_row, xcols, jobs);
per-job records out to $CODESIGN_HDL_RECORDS. Numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cocotb
import numpy as np
from cocotb.simtime import get_sim_time
from cocotb.triggers import Event, FallingEdge, with_timeout
from cocotb.types import LogicArray
from hdl_bench_pim import make_job
from tb_util import bench_config, pack, read_resolved, reset_and_monitor, run_jobs

from codesign.accel_model import pim_mac

PERIOD_NS = 10


def _cycle() -> int:
    """Index of the cycle whose falling edge is now (falling edges at P/2 + tP)."""
    return int(get_sim_time("ns") // PERIOD_NS)


@dataclass
class Job:
    w: np.ndarray  # float16 [N, K]
    x: np.ndarray  # float16 [K]
    kind: str
    reuse_x: bool  # x is already in the register file: start in the done cycle


@dataclass(frozen=True)
class Expected:
    y: np.ndarray  # uint32 [N], fp32 bit patterns
    trace: list[tuple[int, str, int, int]]
    cycles: int


@dataclass
class Observed:
    trace: list[tuple[int, str, int, int]] = field(default_factory=list)
    y: list[tuple[int, int]] = field(default_factory=list)  # (y_idx, fp32 bits) in arrival order
    cycles: int = -1
    bank_errors: list[str] = field(default_factory=list)
    xz_errors: int = 0


class Model:
    """pim_mac's functional GEMV, command trace and cycle count."""

    def __init__(self, unit: pim_mac.PIMUnitConfig) -> None:
        self.unit = unit

    def expect(self, job: Job) -> Expected:
        n, k = job.w.shape
        y = pim_mac.gemv(job.w, job.x, self.unit.lanes)
        return Expected(
            y.view(np.uint32).copy(),
            pim_mac.command_trace(self.unit, n, k),
            pim_mac.unit_cycles(self.unit, n, k),
        )


def _junk(dut, name: str, rng: np.random.Generator, four_state: bool) -> None:
    sig = getattr(dut, name)
    width = len(sig)
    sig.value = LogicArray("X" * width) if four_state else int(rng.integers(0, 1 << min(width, 62)))


class Driver:
    """Loads x (one register a cycle) and starts the job; inputs are junk whenever they don't matter."""

    def __init__(self, dut, unit: pim_mac.PIMUnitConfig, rng: np.random.Generator) -> None:
        self.dut, self.unit, self.rng = dut, unit, rng
        self.four_state = "verilator" not in cocotb.SIM_NAME.lower()

    def idle(self) -> None:
        self.dut.start.value = 0
        self.dut.x_we.value = 0
        for name in ("x_addr", "x_data", "n_rows", "k_cols"):
            _junk(self.dut, name, self.rng, self.four_state)

    async def load_x(self, x: np.ndarray) -> None:
        lanes = self.unit.lanes
        for r in range(len(x) // lanes):
            self.dut.x_we.value = 1
            self.dut.x_addr.value = r
            self.dut.x_data.value = pack(x[r * lanes : (r + 1) * lanes].view(np.uint16), 16)
            await FallingEdge(self.dut.clk)
        self.idle()

    async def start(self, n: int, kc: int) -> None:
        """Drive start now (a falling edge), for the one edge that accepts it."""
        self.dut.start.value = 1
        self.dut.n_rows.value, self.dut.k_cols.value = n, kc
        await FallingEdge(self.dut.clk)
        self.idle()


class Bank:
    """The DRAM bank: W's columns on col_data one cycle after each RD, and a timing-rule checker."""

    def __init__(self, dut, unit: pim_mac.PIMUnitConfig, rng: np.random.Generator, four_state: bool) -> None:
        self.dut, self.unit, self.rng, self.four_state = dut, unit, rng, four_state
        self.columns = np.zeros((0, unit.lanes), np.uint16)
        self.open_row: int | None = None
        self.t_act = self.t_pre = self.t_rd = -(10**9)
        self.pending: int | None = None  # bank column to put on col_data at the next falling edge

    def load(self, w: np.ndarray) -> None:
        self.columns = w.reshape(-1, self.unit.lanes).view(np.uint16)

    def drive(self) -> None:
        if self.pending is None:
            _junk(self.dut, "col_data", self.rng, self.four_state)
        else:
            self.dut.col_data.value = pack(self.columns[self.pending], 16)
        self.pending = None

    def command(self, t: int, kind: str, row: int, col: int, errors: list[str]) -> None:
        """Apply one command seen in cycle t; append any timing-rule violation to `errors`."""
        u = self.unit

        def need(ok: bool, what: str) -> None:
            if not ok:
                errors.append(f"cycle {t}: {kind} row {row} col {col}: {what}")

        if kind == "ACT":
            need(self.open_row is None, f"row {self.open_row} still open")
            need(t - self.t_pre >= u.trp, f"tRP: {t - self.t_pre} cycles after PRE")
            self.open_row, self.t_act = row, t
        elif kind == "RD":
            need(self.open_row == row, f"row {self.open_row} is open")
            need(t - self.t_act >= u.trcd, f"tRCD: {t - self.t_act} cycles after ACT")
            need(t - self.t_rd >= u.tccd, f"tCCD: {t - self.t_rd} cycles after RD")
            g = row * u.cols_per_row + col
            need(col < u.cols_per_row and g < len(self.columns), "column outside W")
            self.t_rd = t
            self.pending = g if g < len(self.columns) else None
        else:  # PRE
            need(self.open_row is not None and self.open_row == row, f"row {self.open_row} is open")
            need(t - self.t_rd >= u.tccd, f"{t - self.t_rd} cycles after RD, inside its tCCD slot")
            self.open_row, self.t_pre = None, t


class Monitor:
    """Every falling edge: feeds the bank, records commands, y outputs and done (X/Z-checked)."""

    def __init__(self, dut, bank: Bank) -> None:
        self.dut, self.bank = dut, bank
        self.errors: list[str] = []
        self.cycle0 = 0
        self.obs = Observed()
        self.done_event = Event()

    def begin(self, cycle0: int) -> None:
        self.cycle0, self.obs = cycle0, Observed()

    def _read(self, name: str) -> int | None:
        return read_resolved(getattr(self.dut, name), self.errors, f"cycle {_cycle()}")

    async def run(self) -> None:
        while True:
            await FallingEdge(self.dut.clk)
            t, rel = _cycle(), _cycle() - self.cycle0
            self.bank.drive()
            cmds = [k for k, s in (("ACT", "cmd_act"), ("RD", "cmd_rd"), ("PRE", "cmd_pre")) if self._read(s)]
            if len(cmds) > 1:
                self.obs.bank_errors.append(f"cycle {t}: commands {cmds} in one cycle")
            for kind in cmds:
                row, col = self._read("cmd_row"), self._read("cmd_col")
                if row is None or col is None:
                    continue
                self.obs.trace.append((rel, kind, row, col if kind == "RD" else 0))
                self.bank.command(t, kind, row, col if kind == "RD" else 0, self.obs.bank_errors)
            self._read("busy")
            if self._read("y_valid"):
                idx, data = self._read("y_idx"), self._read("y_data")
                self.obs.trace.append((rel, "Y", -1 if idx is None else idx, 0))
                self.obs.y.append((-1 if idx is None else idx, -1 if data is None else data))
            if self._read("done"):
                self.obs.trace.append((rel, "DONE", 0, 0))
                self.obs.cycles = rel + 1
                self.obs.xz_errors = len(self.errors)
                self.done_event.set()


class Scoreboard:
    """In-order comparison of each job's observation with the model, one record per job."""

    def __init__(self, log) -> None:
        self.log = log
        self.records: list[dict] = []
        self._xz_seen = 0

    def check(self, job: Job, exp: Expected, obs: Observed) -> None:
        n, k = job.w.shape
        idx = [i for i, _ in obs.y]
        got = np.array([d for _, d in obs.y], dtype=np.int64)
        bits_ok = len(got) == n and bool(np.array_equal(got, exp.y.astype(np.int64)))
        rec = {
            "t": f"{n}x{k}",
            "kind": job.kind,
            "model_cycles": exp.cycles,
            "rtl_cycles": obs.cycles,
            "bits_ok": bits_ok,
            "order_ok": idx == list(range(n)),
            "cycles_ok": obs.cycles == exp.cycles,
            "trace_ok": obs.trace == exp.trace,
            "protocol_ok": not obs.bank_errors,
            "xz_ok": obs.xz_errors == self._xz_seen,
        }
        self._xz_seen = obs.xz_errors
        rec["ok"] = all(
            rec[f] for f in ("bits_ok", "order_ok", "cycles_ok", "trace_ok", "protocol_ok", "xz_ok")
        )
        if not bits_ok:
            bad = [i for i in range(min(n, len(got))) if got[i] != exp.y[i]][:3]
            rec["first_mismatches"] = [f"y[{i}] rtl {got[i]:#010x} model {int(exp.y[i]):#010x}" for i in bad]
        if not rec["trace_ok"]:
            diff = [(o, e) for o, e in zip(obs.trace, exp.trace) if o != e][:3]
            rec["trace_diff"] = [f"rtl {o} model {e}" for o, e in diff] or [
                f"rtl {len(obs.trace)} events, model {len(exp.trace)}"
            ]
        if obs.bank_errors:
            rec["bank_errors"] = obs.bank_errors[:3]
        self.log.info("job %s", rec)
        self.records.append(rec)


class Testbench:
    """Wires driver, bank, monitor, model and scoreboard."""

    def __init__(self, dut, cfg: dict, rng: np.random.Generator) -> None:
        self.dut, self.rng = dut, rng
        self.unit = pim_mac.PIMUnitConfig(
            cfg["lanes"], cfg["tccd"], cfg["trcd"], cfg["trp"], cfg["cols_per_row"], cfg["xcols"]
        )
        self.model = Model(self.unit)
        self.driver = Driver(dut, self.unit, rng)
        self.bank = Bank(dut, self.unit, rng, self.driver.four_state)
        self.monitor = Monitor(dut, self.bank)
        self.scoreboard = Scoreboard(dut._log)

    def jobs(self, spec: list) -> list[Job]:
        out: list[Job] = []
        for n, kc, kind in spec:
            w, x = make_job(self.rng, self.unit.lanes, n, kc, kind)
            # A random W does not depend on x: such a job may reuse the previous x (same K).
            reuse = kind == "random" and bool(out) and len(out[-1].x) == len(x)
            out.append(Job(w, out[-1].x if reuse else x, kind, reuse))
        return out

    async def reset(self) -> None:
        self.driver.idle()
        _junk(self.dut, "col_data", self.rng, self.driver.four_state)
        await reset_and_monitor(self.dut, PERIOD_NS, self.monitor.run())

    async def run_job(self, job: Job) -> None:
        """Load x (unless reused), start in this falling edge, wait (bounded) for done, score."""
        if not job.reuse_x:
            await self.driver.load_x(job.x)
        exp = self.model.expect(job)
        self.bank.load(job.w)
        self.monitor.done_event.clear()
        self.monitor.begin(_cycle() + 1)  # the next rising edge accepts start: cycle 0
        await self.driver.start(job.w.shape[0], len(job.x) // self.unit.lanes)
        await with_timeout(self.monitor.done_event.wait(), (exp.cycles + 40) * PERIOD_NS, "ns")
        self.scoreboard.check(job, exp, self.monitor.obs)


@cocotb.test()
async def gemv_jobs_match_model(dut):
    """Back-to-back GEMVs are bit-exact, command-trace-exact and cycle-exact against pim_mac."""
    cfg, seed = bench_config(dut)
    tb = Testbench(dut, cfg, np.random.default_rng(seed))
    await run_jobs(tb, tb.jobs(cfg["jobs"]), seed, PERIOD_NS, run_one=tb.run_job)
