"""cocotb bench for the int4 dequant-MAC lanes (rtl/dequant_mac_lane.v).

Same shape as the systolic bench: a Driver streams one packed word per cycle (P activations,
P uint4 codes per lane, the group's scale and zero per lane), a Monitor captures out_data and the
start -> done time at each `done`, a Model asks codesign.accel_model.dequant_mac for the exact
outputs and the cycle count, and an in-order Scoreboard compares them. Signals change and are
sampled on falling edges; cycle counts come from simulation time (see tb_systolic.py).

Configuration in $CODESIGN_HDL_CONFIG (lanes, codes_per_cycle, group_size, n_groups list);
per-job records out to $CODESIGN_HDL_RECORDS. Numpy only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import cocotb
import numpy as np
from cocotb.simtime import get_sim_time
from cocotb.triggers import Event, FallingEdge
from cocotb.types import LogicArray
from tb_util import (
    bench_config,
    pack,
    read_resolved,
    reset_and_monitor,
    run_jobs,
    unpack_signed,
)

from codesign.accel_model import dequant_mac

PERIOD_NS = 10
ACC_BITS = 64


@dataclass(frozen=True)
class Job:
    x: np.ndarray  # int16 [K]
    codes: np.ndarray  # uint4 [L, K]
    scale: np.ndarray  # int16 [L, n_groups]
    zero: np.ndarray  # uint4 [L, n_groups]

    @property
    def n_groups(self) -> int:
        return self.scale.shape[1]


@dataclass(frozen=True)
class Expected:
    y: np.ndarray  # int64 [L]
    cycles: int


@dataclass(frozen=True)
class Observed:
    y: np.ndarray | None
    cycles: int
    xz_errors: int


class Model:
    """The accelerator model's dequant-MAC function and lane timing."""

    def __init__(self, cfg: dict) -> None:
        self.p, self.g = cfg["codes_per_cycle"], cfg["group_size"]

    def expect(self, job: Job) -> Expected:
        y = dequant_mac.dequant_mac(job.x, job.codes, job.scale, job.zero, self.g)
        return Expected(y=np.asarray(y, dtype=np.int64), cycles=dequant_mac.lane_cycles(len(job.x), self.p))


class Driver:
    """Streams a job's packed words on consecutive cycles from the start edge; junk elsewhere."""

    def __init__(self, dut, cfg: dict, rng: np.random.Generator) -> None:
        self.dut, self.rng = dut, rng
        self.lanes, self.p, self.g = cfg["lanes"], cfg["codes_per_cycle"], cfg["group_size"]
        self.four_state = "verilator" not in cocotb.SIM_NAME.lower()
        self.start_times: deque[float] = deque()
        self._buses = ("x_vec", "q_vec", "scale_vec", "zero_vec", "n_groups")

    def _junk(self, name: str) -> None:
        sig = getattr(self.dut, name)
        width = len(sig)
        if self.four_state:
            sig.value = LogicArray("X" * width)
        else:
            sig.value = int(self.rng.integers(0, 1 << min(width, 62)))

    def idle(self) -> None:
        self.dut.start.value = 0
        for name in self._buses:
            self._junk(name)

    def words(self, job: Job) -> list[tuple[int, int, int, int]]:
        """(x_vec, q_vec, scale_vec, zero_vec) for word w = 0 .. K/P - 1."""
        out = []
        for w in range(len(job.x) // self.p):
            ks = slice(w * self.p, (w + 1) * self.p)
            g = w * self.p // self.g
            out.append(
                (
                    pack(job.x[ks], 16),
                    pack(job.codes[:, ks].reshape(-1), 4),  # lane-major: lane l at bits [4*P*l ...]
                    pack(job.scale[:, g], 16),
                    pack(job.zero[:, g], 4),
                )
            )
        return out

    async def send(self, job: Job) -> None:
        """Present the job starting now; the caller is on a falling edge."""
        self.start_times.append(get_sim_time("ns"))
        self.dut.start.value = 1
        self.dut.n_groups.value = job.n_groups
        for w, (xv, qv, sv, zv) in enumerate(self.words(job)):
            if w > 0:
                await FallingEdge(self.dut.clk)
                self.dut.start.value = 0
                self._junk("n_groups")
            self.dut.x_vec.value, self.dut.q_vec.value = xv, qv
            self.dut.scale_vec.value, self.dut.zero_vec.value = sv, zv
        await FallingEdge(self.dut.clk)
        self.idle()


class Monitor:
    """Samples busy/done every falling edge; on done, captures out_data and the cycle count."""

    def __init__(self, dut, lanes: int, driver: Driver) -> None:
        self.dut, self.lanes, self.driver = dut, lanes, driver
        self.jobs: deque[Observed] = deque()
        self.done_event = Event()
        self.errors: list[str] = []

    async def run(self) -> None:
        while True:
            await FallingEdge(self.dut.clk)
            where = f"{get_sim_time('ns')} ns"
            read_resolved(self.dut.busy, self.errors, where)
            if read_resolved(self.dut.done, self.errors, where):
                data = read_resolved(self.dut.out_data, self.errors, where)
                y = None if data is None else unpack_signed(data, self.lanes, ACC_BITS)
                t0 = self.driver.start_times.popleft() if self.driver.start_times else None
                cycles = -1 if t0 is None else round((get_sim_time("ns") - t0) / PERIOD_NS)
                self.jobs.append(Observed(y, cycles, len(self.errors)))
                self.done_event.set()


class Scoreboard:
    """In-order comparison, one record per job."""

    def __init__(self, log) -> None:
        self.log = log
        self.expected: deque[tuple[Job, Expected]] = deque()
        self.records: list[dict] = []
        self._xz_seen = 0

    def check(self, obs: Observed) -> None:
        job, exp = self.expected.popleft()
        bits_ok = obs.y is not None and bool(np.array_equal(obs.y, exp.y))
        xz_ok = obs.xz_errors == self._xz_seen
        self._xz_seen = obs.xz_errors
        rec = {
            "t": len(job.x),
            "model_cycles": exp.cycles,
            "rtl_cycles": obs.cycles,
            "bits_ok": bits_ok,
            "order_ok": True,  # one output vector per job
            "cycles_ok": obs.cycles == exp.cycles,
            "xz_ok": xz_ok,
        }
        rec["ok"] = rec["bits_ok"] and rec["cycles_ok"] and xz_ok
        if not bits_ok:
            got = None if obs.y is None else obs.y.tolist()
            rec["first_mismatches"] = [f"rtl {got} model {exp.y.tolist()}"]
        self.log.info("job %s", rec)
        self.records.append(rec)


class Testbench:
    """Wires driver, monitor, model and scoreboard."""

    def __init__(self, dut, cfg: dict, rng: np.random.Generator) -> None:
        self.dut, self.cfg, self.rng = dut, cfg, rng
        self.model = Model(cfg)
        self.driver = Driver(dut, cfg, rng)
        self.monitor = Monitor(dut, cfg["lanes"], self.driver)
        self.scoreboard = Scoreboard(dut._log)

    def random_job(self, n_groups: int, extreme: bool = False) -> Job:
        lanes, g = self.cfg["lanes"], self.cfg["group_size"]
        k = n_groups * g
        r = self.rng
        if extreme:  # the widest products and sums: every field at one end of its range
            ends = lambda lo, hi, shape: r.choice(np.array([lo, hi], np.int64), shape)
            return Job(
                ends(-(2**15), 2**15 - 1, k),
                ends(0, 15, (lanes, k)),
                ends(-(2**15), 2**15 - 1, (lanes, n_groups)),
                ends(0, 15, (lanes, n_groups)),
            )
        return Job(
            r.integers(-(2**15), 2**15, k, dtype=np.int64),
            r.integers(0, 16, (lanes, k), dtype=np.int64),
            r.integers(-(2**15), 2**15, (lanes, n_groups), dtype=np.int64),
            r.integers(0, 16, (lanes, n_groups), dtype=np.int64),
        )

    async def reset(self) -> None:
        self.driver.idle()
        await reset_and_monitor(self.dut, PERIOD_NS, self.monitor.run())

    def timeout_cycles(self, job: Job, expected) -> int:
        return 4 * len(job.x) + 40


@cocotb.test()
async def random_jobs_match_model(dut):
    """Back-to-back random jobs are bit- and cycle-exact against codesign.accel_model.dequant_mac."""
    cfg, seed = bench_config(dut)
    tb = Testbench(dut, cfg, np.random.default_rng(seed))
    jobs = (tb.random_job(n_groups, extreme=(i == 1)) for i, n_groups in enumerate(cfg["t_values"]))
    await run_jobs(tb, jobs, seed, PERIOD_NS)
