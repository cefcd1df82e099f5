"""cocotb bench for the int8 systolic arrays (rtl/systolic_os.v, rtl/systolic_ws.v).

cocotb-examples style: a Driver turns a Job (A, B) into the per-cycle operand vectors of the
RTL's interface contract, a Monitor collects output rows and the start -> done time, a Model
asks codesign.accel_model for the outputs (`systolic.functional_gemm`) and the cycles
(`systolic_control.job_timing`: the start -> done total and the SCALE-Sim fold inside it), and an
in-order Scoreboard compares them. Every job must be bit-exact, its total cycle-exact and its fold
(timed on two internal PE signals) equal to `systolic.fold_cycles`; X/Z on a checked output fails.

Inputs and outputs change and are sampled on falling edges, so no value is read in the same
delta cycle it is written on either simulator. Cycle counts come from simulation time:
start is driven half a period before the edge that accepts it and `done` is seen half a period
after the edge that raises it, so (t_done - t_start) / period = edges from accept to done,
inclusive.

Configuration comes in as JSON in $CODESIGN_HDL_CONFIG (rows, cols, dataflow, t_values);
per-job records go out as JSON to $CODESIGN_HDL_RECORDS for pytest and report.py. Numpy only:
importing torch here would cost ~9 s per simulation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import cocotb
import numpy as np
from cocotb.simtime import get_sim_time
from cocotb.triggers import Event, FallingEdge
from cocotb.types import Logic, LogicArray
from tb_util import (
    bench_config,
    pack,
    read_resolved,
    reset_and_monitor,
    run_jobs,
    unpack_signed,
)

from codesign.accel_model.systolic import control as systolic_control
from codesign.accel_model.systolic import model as systolic

PERIOD_NS = 10
ACC_BITS = 32


@dataclass(frozen=True)
class Job:
    """One fold: OS computes a[R][K] @ b[K][C] (t = K); WS computes a[M][R] @ b[R][C] (t = M)."""

    a: np.ndarray  # int8
    b: np.ndarray  # int8
    t: int


@dataclass
class Observed:
    """What the monitor saw for one job."""

    rows: list[np.ndarray]
    row_ids: list[int]
    cycles: int
    xz_errors: int  # X/Z errors the monitor had logged by this job's done
    fold: int  # edges from the fold's first to its last active edge, inclusive (-1 if unseen)


@dataclass(frozen=True)
class Expected:
    out: np.ndarray  # int32, one row per output row the RTL emits
    cycles: int
    fold: int  # systolic.fold_cycles: the compute phase inside `cycles`


def _bit(handle, i: int) -> bool:
    """Bit i of an internal signal (X counts as 0: internal probes only time events)."""
    value = handle.value
    if not value.is_resolvable:
        return False
    return bool((int(value) if isinstance(value, Logic) else value.to_unsigned()) >> i & 1)


class Model:
    """Transaction-level model: the accelerator model's functional GEMM and controlled-fold cycles."""

    def __init__(self, rows: int, cols: int, dataflow: str) -> None:
        self.rows, self.cols, self.dataflow = rows, cols, dataflow

    def expect(self, job: Job) -> Expected:
        out = systolic.functional_gemm(job.a, job.b, self.rows, self.cols, self.dataflow)
        timing = systolic_control.job_timing(self.rows, self.cols, job.t, self.dataflow)
        return Expected(out=np.asarray(out), cycles=timing.total, fold=timing.fold)


class Driver:
    """Drives one job per `send`: start + t_len at edge 0, then operands on the contract's cycles.

    Outside the operand windows the buses carry junk (X on Icarus, random bits on 2-state
    Verilator) to prove the RTL ignores them.
    """

    def __init__(self, dut, rows: int, cols: int, dataflow: str, rng: np.random.Generator) -> None:
        self.dut, self.rows, self.cols, self.dataflow, self.rng = dut, rows, cols, dataflow, rng
        self.four_state = "verilator" not in cocotb.SIM_NAME.lower()
        self.start_times: deque[int] = deque()

    def schedule(self, job: Job) -> list[tuple[int | None, int | None]]:
        """(a_vec, b_vec) to present at edge e = 0, 1, ... of the job; None = junk."""
        if self.dataflow == "os":  # vector k: column k of A, row k of B
            return [(pack(job.a[:, k], 8), pack(job.b[k, :], 8)) for k in range(job.t)]
        weights = [(None, pack(job.b[k, :], 8)) for k in range(self.rows)]
        return weights + [(pack(job.a[m, :], 8), None) for m in range(job.t)]

    def _junk(self, signal, width: int) -> None:
        if self.four_state:
            signal.value = LogicArray("X" * width)
        else:
            signal.value = int(self.rng.integers(0, 1 << min(width, 62)))

    def _put(self, a: int | None, b: int | None) -> None:
        if a is None:
            self._junk(self.dut.a_vec, 8 * self.rows)
        else:
            self.dut.a_vec.value = a
        if b is None:
            self._junk(self.dut.b_vec, 8 * self.cols)
        else:
            self.dut.b_vec.value = b

    def idle(self) -> None:
        self.dut.start.value = 0
        self._junk(self.dut.t_len, len(self.dut.t_len))
        self._put(None, None)

    async def send(self, job: Job) -> None:
        """Present the job starting now; the caller is on a falling edge."""
        self.start_times.append(get_sim_time("ns"))
        self.dut.start.value = 1
        self.dut.t_len.value = job.t
        for e, (a, b) in enumerate(self.schedule(job)):
            if e > 0:
                await FallingEdge(self.dut.clk)
                self.dut.start.value = 0
                self._junk(self.dut.t_len, len(self.dut.t_len))
            self._put(a, b)
        await FallingEdge(self.dut.clk)
        self.idle()


class Monitor:
    """Samples the outputs every falling edge; emits an Observed per `done` pulse.

    It also watches two internal signals to time the fold inside the job: `fold_first` is
    high in the cycle before the fold's first edge (os: PE(0,0)'s first MAC; ws: the first
    weight write, PE row 0) and `fold_last` before each MAC of PE(R-1,C-1), whose last MAC is
    the fold's last edge. So the bench checks the compute phase itself against
    systolic.fold_cycles, not only the start -> done total.
    """

    def __init__(self, dut, cols: int, driver: Driver, fold_first, fold_last) -> None:
        self.dut, self.cols, self.driver = dut, cols, driver
        self.fold_first, self.fold_last = fold_first, fold_last  # () -> bool
        self._first_edge: int | None = None
        self._last_edge: int | None = None
        self.jobs: deque[Observed] = deque()
        self.done_event = Event()
        self.errors: list[str] = []
        self._rows: list[np.ndarray] = []
        self._ids: list[int] = []

    def _resolved(self, name: str) -> int | None:
        return read_resolved(getattr(self.dut, name), self.errors, f"{get_sim_time('ns')} ns")

    async def run(self) -> None:
        while True:
            await FallingEdge(self.dut.clk)
            ctrl = {n: self._resolved(n) for n in ("busy", "done", "out_valid")}
            if self.driver.start_times:
                # Sampled after edge e, a high probe means an event at edge e + 1 = this index.
                edge = round((get_sim_time("ns") - self.driver.start_times[0]) / PERIOD_NS)
                if self._first_edge is None and self.fold_first():
                    self._first_edge = edge
                if self.fold_last():
                    self._last_edge = edge
            if ctrl["out_valid"]:
                row_id, data = self._resolved("out_row"), self._resolved("out_data")
                if data is not None and row_id is not None:
                    self._rows.append(unpack_signed(data, self.cols, ACC_BITS))
                    self._ids.append(row_id)
            if ctrl["done"]:
                t0 = self.driver.start_times.popleft() if self.driver.start_times else None
                now = get_sim_time("ns")
                cycles = -1 if t0 is None else round((now - t0) / PERIOD_NS)
                fold = -1
                if self._first_edge is not None and self._last_edge is not None:
                    fold = self._last_edge - self._first_edge + 1
                self.jobs.append(Observed(self._rows, self._ids, cycles, len(self.errors), fold))
                self._rows, self._ids = [], []
                self._first_edge = self._last_edge = None
                self.done_event.set()


class Scoreboard:
    """In-order comparison of model expectations and monitor observations, one record per job."""

    def __init__(self, log) -> None:
        self.log = log
        self.expected: deque[tuple[Job, Expected]] = deque()
        self.records: list[dict] = []
        self._xz_seen = 0

    def check(self, observed: Observed) -> None:
        job, exp = self.expected.popleft()
        got = np.array(observed.rows, dtype=np.int64).reshape(-1, exp.out.shape[1])
        shape_ok = got.shape == exp.out.shape
        bits_ok = shape_ok and bool(np.array_equal(got, exp.out.astype(np.int64)))
        order_ok = observed.row_ids == list(range(exp.out.shape[0]))
        cycles_ok = observed.cycles == exp.cycles and observed.fold == exp.fold
        xz_ok = observed.xz_errors == self._xz_seen
        self._xz_seen = observed.xz_errors
        rec = {
            "t": job.t,
            "model_cycles": exp.cycles,
            "rtl_cycles": observed.cycles,
            "model_fold": exp.fold,
            "rtl_fold": observed.fold,
            "bits_ok": bits_ok,
            "order_ok": order_ok,
            "cycles_ok": cycles_ok,
            "xz_ok": xz_ok,
            "ok": bits_ok and order_ok and cycles_ok and xz_ok,
        }
        if not bits_ok:
            if shape_ok:
                bad = np.argwhere(got != exp.out)[:4]
                rec["first_mismatches"] = [
                    f"[{i},{j}] rtl {got[i, j]} model {exp.out[i, j]}" for i, j in bad.tolist()
                ]
            else:
                rec["first_mismatches"] = [f"rtl shape {got.shape} model {exp.out.shape}"]
        self.log.info("job %s", rec)
        self.records.append(rec)


class Testbench:
    """Wires driver, monitor, model and scoreboard for one DUT configuration."""

    def __init__(self, dut, cfg: dict, rng: np.random.Generator) -> None:
        self.dut, self.cfg, self.rng = dut, cfg, rng
        rows, cols, df = cfg["rows"], cfg["cols"], cfg["dataflow"]
        self.rows, self.cols, self.dataflow = rows, cols, df
        self.model = Model(rows, cols, df)
        self.driver = Driver(dut, rows, cols, df, rng)
        pe = lambda i, j: dut.g_row[i].g_col[j].u_pe
        first, last = pe(0, 0), pe(rows - 1, cols - 1)
        if df == "os":
            fold_first = lambda: _bit(first.a_in, 8)  # valid tag of PE(0,0)'s A operand
        else:
            fold_first = lambda: _bit(first.w_load, 0)
        fold_last = lambda: _bit(last.a_in, 8)
        self.monitor = Monitor(dut, cols, self.driver, fold_first, fold_last)
        self.scoreboard = Scoreboard(dut._log)

    def random_job(self, t: int, extreme: bool = False) -> Job:
        r, c = self.rows, self.cols
        a_shape, b_shape = ((r, t), (t, c)) if self.dataflow == "os" else ((t, r), (r, c))
        if extreme:  # all -128 / 127: the largest products, sign extension at its limit
            return Job(
                self.rng.choice(np.array([-128, 127], np.int8), a_shape),
                self.rng.choice(np.array([-128, 127], np.int8), b_shape),
                t,
            )
        draw = lambda shape: self.rng.integers(-128, 128, shape, dtype=np.int64).astype(np.int8)
        return Job(draw(a_shape), draw(b_shape), t)

    async def reset(self) -> None:
        self.driver.idle()
        await reset_and_monitor(self.dut, PERIOD_NS, self.monitor.run())

    def timeout_cycles(self, job: Job, expected) -> int:
        return 4 * (2 * self.rows + self.cols + job.t) + 20


@cocotb.test()
async def random_jobs_match_model(dut):
    """Back-to-back random jobs (t values from the config) are bit- and cycle-exact vs the model."""
    # The seed the pytest entry recorded (cocotb.RANDOM_SEED is a per-test derivative of it).
    cfg, seed = bench_config(dut)
    tb = Testbench(dut, cfg, np.random.default_rng(seed))
    jobs = (tb.random_job(t, extreme=(i == 1)) for i, t in enumerate(cfg["t_values"]))
    await run_jobs(tb, jobs, seed, PERIOD_NS)
