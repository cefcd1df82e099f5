"""cocotb bench for the KV quantization engine (rtl/kv_quant_engine.v).

cocotb-examples style, like the systolic and dequant-MAC benches:
  * Driver: one job = the K and V vectors of `tokens` tokens x `kv_heads` heads, streamed back to
    back: beat j of vector v on x_vec at edge v x per_vector + j (the RTL's contract), junk (X on
    Icarus, random bits on 2-state Verilator) on every other edge and on lo/hi after `start`.
  * Monitor: every falling edge, X/Z-checked reads of busy/done and of each output while it is
    valid; assembles code beats into vectors (q_last must close each one) and outlier windows
    (ol_first opens one per vector); times start -> done.
  * Model: codesign.accel_model.kv_quant_engine's quantizer (`quantize_per_token` /
    `quantize_oaken`, `pack_codes`) for codes, scale, zero and outliers, and `kvq_cost` on a
    KVWrite for the cycles, with the engine spec from kv_quant_control (depth = rtl_depth).
    It also asserts that the fp32 operands the RTL sees stay in fp32_add/fp32_div's domain.
  * Scoreboard: in order, one record per job; every packed byte, scale and zero bit pattern,
    outlier (position, fp16 bits), over-budget flag and the cycle count must match exactly.

Signals change and are sampled on falling edges; cycles = (t_done - t_start) / period counts the
edges from the one accepting start to the one raising done (see tb_systolic.py).
Configuration in $CODESIGN_HDL_CONFIG (hdl_bench_kvq.kvq_bench); records to $CODESIGN_HDL_RECORDS.
Numpy only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import cocotb
import numpy as np
from cocotb.simtime import get_sim_time
from cocotb.triggers import Event, FallingEdge
from cocotb.types import LogicArray
from kvq_vectors import THRESHOLDS, job_vectors
from tb_util import bench_config, pack, read_resolved, reset_and_monitor, run_jobs

from codesign.accel_model import kv_quant_control, kv_quant_engine
from codesign.specs import KVFormat, KVWrite

PERIOD_NS = 10


@dataclass(frozen=True)
class Job:
    x: np.ndarray  # float16 [vectors, head_dim]
    names: list[str]  # what each vector is (corner name, key, value)
    lo: float
    hi: float
    tokens: int
    kv_heads: int


@dataclass(frozen=True)
class Expected:
    packed: np.ndarray  # uint8 [vectors, head_dim * bits / 8]
    scale: np.ndarray  # uint16 fp16 bits [vectors]
    zero: np.ndarray  # uint16 fp16 bits [vectors]
    outliers: list[list[tuple[int, int]]]  # per vector, (position, fp16 bits), at most max_outliers
    overflow: list[bool]  # per vector: more outliers than slots
    cycles: int


@dataclass
class Observed:
    beats: list[list[int]] = field(default_factory=list)  # per vector: q_codes words
    scale: list[set] = field(default_factory=list)  # per vector: q_scale values seen on its beats
    zero: list[set] = field(default_factory=list)
    windows: list[dict] = field(default_factory=list)  # per vector: {"ovf": bool, "entries": [...]}
    order_errors: list[str] = field(default_factory=list)
    cycles: int = -1
    xz_errors: int = 0


def fp32_domain_ok(v: np.ndarray) -> bool:
    """True if every fp32 value is zero or normal and finite (fp32_add / fp32_div's domain)."""
    a = np.abs(np.asarray(v, np.float32))
    return bool(np.all(np.isfinite(a) & ((a == 0) | (a >= np.finfo(np.float32).tiny))))


class Model:
    """The accelerator model's quantizer, packer and KVWrite cycle count for this engine."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.bits, self.d = cfg["bits"], cfg["head_dim"]
        self.engine = kv_quant_control.rtl_engine_spec(cfg["lanes"], cfg["ports"], cfg["div_step"])
        frac = kv_quant_control.outlier_fraction(cfg["max_outliers"], self.d) if cfg["oaken"] else 0.0
        scheme = "oaken" if cfg["oaken"] else "per_token"
        self.fmt = KVFormat(dtype=f"int{self.bits}", scheme=scheme, outlier_fraction=frac)

    def expect(self, job: Job) -> Expected:
        n = len(job.x)
        if self.cfg["oaken"]:
            codes, scale, zero, mask, values = kv_quant_engine.quantize_oaken(
                job.x, self.bits, job.lo, job.hi
            )
        else:
            codes, scale, zero = kv_quant_engine.quantize_per_token(job.x, self.bits)
            mask, values = np.zeros(job.x.shape, bool), np.zeros(0, np.float16)
        self._check_domain(job, mask)
        outliers, overflow, at = [], [], 0
        bits16 = values.view(np.uint16)
        for v in range(n):
            pos = np.flatnonzero(mask[v])
            entries = list(zip(pos.tolist(), bits16[at : at + len(pos)].tolist()))
            at += len(pos)
            outliers.append(entries[: self.cfg["max_outliers"]])
            overflow.append(len(entries) > self.cfg["max_outliers"])
        spec = KVWrite(tokens=job.tokens, kv_heads=job.kv_heads, head_dim=self.d, kv_format=self.fmt)
        return Expected(
            packed=kv_quant_engine.pack_codes(codes, self.bits),
            scale=scale.astype(np.float16).view(np.uint16),
            zero=zero.astype(np.float16).view(np.uint16),
            outliers=outliers,
            overflow=overflow,
            cycles=kv_quant_engine.kvq_cost(self.engine, spec).cycles,
        )

    def _check_domain(self, job: Job, mask: np.ndarray) -> None:
        """The RTL's fp32 units are exact only for zero-or-normal operands and results: assert it."""
        x32 = job.x.astype(np.float32)
        empty = mask.all(-1)
        mn = np.where(empty, 0, np.where(mask, np.inf, x32).min(-1)).astype(np.float32)
        mx = np.where(empty, 0, np.where(mask, -np.inf, x32).max(-1)).astype(np.float32)
        with np.errstate(all="ignore"):
            diff = mx - mn
            q = diff / np.float32(2**self.bits - 1)
            sub = x32 - mn[:, None]
        assert fp32_domain_ok(x32) and fp32_domain_ok(diff) and fp32_domain_ok(q) and fp32_domain_ok(sub), (
            "operands outside the RTL's fp32 domain: the bench drew an unsupported vector"
        )


class Driver:
    """Presents a job's beats on the contract's edges; junk elsewhere."""

    def __init__(self, dut, cfg: dict, rng: np.random.Generator) -> None:
        self.dut, self.rng = dut, rng
        self.lanes, self.d = cfg["lanes"], cfg["head_dim"]
        self.beats = self.d // self.lanes
        self.pv = kv_quant_control.per_vector(
            self.d, self.lanes, cfg["max_outliers"] if cfg["oaken"] else 0, cfg["ports"]
        )
        self.four_state = "verilator" not in cocotb.SIM_NAME.lower()
        self.start_times: deque[float] = deque()

    def _junk(self, name: str) -> None:
        sig = getattr(self.dut, name)
        width = len(sig)
        if self.four_state:
            sig.value = LogicArray("X" * width)
        else:
            sig.value = int(self.rng.integers(0, 1 << min(width, 62)))

    def idle(self) -> None:
        self.dut.start.value = 0
        for name in ("n_vec", "x_vec", "lo", "hi"):
            self._junk(name)

    def schedule(self, job: Job) -> list[int | None]:
        """x_vec at edge e = 0 .. vectors x per_vector - 1 (None: no beat due, junk)."""
        bits = job.x.view(np.uint16)
        out: list[int | None] = []
        for v in range(len(job.x)):
            for j in range(self.pv):
                out.append(
                    pack(bits[v, j * self.lanes : (j + 1) * self.lanes], 16) if j < self.beats else None
                )
        return out

    async def send(self, job: Job) -> None:
        """Present the job starting now; the caller is on a falling edge."""
        self.start_times.append(get_sim_time("ns"))
        self.dut.start.value = 1
        self.dut.n_vec.value = len(job.x)
        self.dut.lo.value = int(np.float32(job.lo).view(np.uint32))
        self.dut.hi.value = int(np.float32(job.hi).view(np.uint32))
        for e, word in enumerate(self.schedule(job)):
            if e > 0:
                await FallingEdge(self.dut.clk)
                if e == 1:
                    self.dut.start.value = 0
                    for name in ("n_vec", "lo", "hi"):
                        self._junk(name)
            if word is None:
                self._junk("x_vec")
            else:
                self.dut.x_vec.value = word
        await FallingEdge(self.dut.clk)
        self.idle()


class Monitor:
    """Samples every falling edge; builds the Observed of the job in flight."""

    def __init__(self, dut, cfg: dict, driver: Driver) -> None:
        self.dut, self.cfg, self.driver = dut, cfg, driver
        self.beats = cfg["head_dim"] // cfg["lanes"]
        self.ports = cfg["ports"] if cfg["oaken"] else 1
        self.current = Observed()
        self.jobs: deque[Observed] = deque()
        self.done_event = Event()
        self.errors: list[str] = []

    def _read(self, name: str, where: str) -> int | None:
        return read_resolved(getattr(self.dut, name), self.errors, where)

    def _codes(self, where: str) -> None:
        obs = self.current
        word = self._read("q_codes", where)
        last = self._read("q_last", where)
        if not obs.beats or len(obs.beats[-1]) == self.beats:
            obs.beats.append([])
            obs.scale.append(set())
            obs.zero.append(set())
        obs.beats[-1].append(-1 if word is None else word)
        obs.scale[-1].add(self._read("q_scale", where))
        obs.zero[-1].add(self._read("q_zero", where))
        if bool(last) != (len(obs.beats[-1]) == self.beats):
            obs.order_errors.append(f"q_last={last} on beat {len(obs.beats[-1]) - 1} at {where}")

    def _outliers(self, where: str) -> None:
        obs = self.current
        first = self._read("ol_first", where)
        valid = self._read("ol_valid", where) or 0
        if first:
            obs.windows.append({"ovf": bool(self._read("ol_ovf", where)), "entries": []})
        if not valid:
            return
        if not obs.windows:
            obs.order_errors.append(f"outlier valid before any ol_first at {where}")
            return
        pos = self._read("ol_pos", where) or 0
        val = self._read("ol_val", where) or 0
        for p in range(self.ports):
            if valid >> p & 1:
                obs.windows[-1]["entries"].append((pos >> (16 * p) & 0xFFFF, val >> (16 * p) & 0xFFFF))

    async def run(self) -> None:
        while True:
            await FallingEdge(self.dut.clk)
            where = f"{get_sim_time('ns')} ns"
            self._read("busy", where)
            if self._read("q_valid", where):
                self._codes(where)
            if self.cfg["oaken"]:
                self._outliers(where)
            if self._read("done", where):
                t0 = self.driver.start_times.popleft() if self.driver.start_times else None
                self.current.cycles = -1 if t0 is None else round((get_sim_time("ns") - t0) / PERIOD_NS)
                self.current.xz_errors = len(self.errors)
                self.jobs.append(self.current)
                self.current = Observed()
                self.done_event.set()


class Scoreboard:
    """In-order comparison, one record per job."""

    def __init__(self, log, cfg: dict) -> None:
        self.log, self.cfg = log, cfg
        self.expected: deque[tuple[Job, Expected]] = deque()
        self.records: list[dict] = []
        self._xz_seen = 0

    def _vector_bytes(self, words: list[int]) -> np.ndarray:
        width = self.cfg["lanes"] * self.cfg["bits"]
        total = sum(w << (width * j) for j, w in enumerate(words))
        nbytes = self.cfg["head_dim"] * self.cfg["bits"] // 8
        return np.frombuffer(total.to_bytes(nbytes, "little"), np.uint8)

    def check(self, obs: Observed) -> None:
        job, exp = self.expected.popleft()
        n = len(job.x)
        bad: list[str] = []
        order_ok = not obs.order_errors and len(obs.beats) == n
        if self.cfg["oaken"]:
            order_ok = order_ok and len(obs.windows) == n
        for v in range(min(n, len(obs.beats))):
            tag = f"vector {v} ({job.names[v]})"
            if -1 in obs.beats[v]:
                bad.append(f"{tag}: X/Z codes")
                continue
            got = self._vector_bytes(obs.beats[v])
            if not np.array_equal(got, exp.packed[v]):
                bad.append(f"{tag}: bytes rtl {got.tolist()} model {exp.packed[v].tolist()}")
            if obs.scale[v] != {int(exp.scale[v])} or obs.zero[v] != {int(exp.zero[v])}:
                bad.append(
                    f"{tag}: scale/zero rtl {obs.scale[v]}/{obs.zero[v]} "
                    f"model {int(exp.scale[v]):#06x}/{int(exp.zero[v]):#06x}"
                )
            if self.cfg["oaken"] and v < len(obs.windows):
                w = obs.windows[v]
                if w["entries"] != exp.outliers[v] or w["ovf"] != exp.overflow[v]:
                    bad.append(
                        f"{tag}: outliers rtl {w} model {{'ovf': {exp.overflow[v]}, 'entries': {exp.outliers[v]}}}"
                    )
        xz_ok = obs.xz_errors == self._xz_seen
        self._xz_seen = obs.xz_errors
        rec = {
            "t": n,
            "tokens": job.tokens,
            "kv_heads": job.kv_heads,
            "model_cycles": exp.cycles,
            "rtl_cycles": obs.cycles,
            "bits_ok": not bad and len(obs.beats) == n,
            "cycles_ok": obs.cycles == exp.cycles,
            "order_ok": order_ok,
            "xz_ok": xz_ok,
            "outliers": int(sum(len(o) for o in exp.outliers)),
            "overflow_vectors": int(sum(exp.overflow)),
        }
        rec["ok"] = rec["bits_ok"] and rec["cycles_ok"] and rec["order_ok"] and xz_ok
        if bad or obs.order_errors:
            rec["first_mismatches"] = (obs.order_errors + bad)[:4]
        self.log.info("job %s", rec)
        self.records.append(rec)


class Testbench:
    """Wires driver, monitor, model and scoreboard."""

    def __init__(self, dut, cfg: dict, rng: np.random.Generator) -> None:
        self.dut, self.cfg, self.rng = dut, cfg, rng
        self.model = Model(cfg)
        self.driver = Driver(dut, cfg, rng)
        self.monitor = Monitor(dut, cfg, self.driver)
        self.scoreboard = Scoreboard(dut._log, cfg)

    def make_job(self, kind: str, tokens: int, kv_heads: int) -> Job:
        x, names = job_vectors(self.rng, kind, 2 * tokens * kv_heads, self.cfg)
        lo, hi = THRESHOLDS[kind]
        return Job(x, names, lo, hi, tokens, kv_heads)

    async def reset(self) -> None:
        self.driver.idle()
        await reset_and_monitor(self.dut, PERIOD_NS, self.monitor.run())

    def timeout_cycles(self, job: Job, expected) -> int:
        return expected.cycles + 40


@cocotb.test()
async def kv_quant_jobs_match_model(dut):
    """Back-to-back jobs are bit- and cycle-exact against codesign.accel_model.kv_quant_engine."""
    cfg, seed = bench_config(dut)
    tb = Testbench(dut, cfg, np.random.default_rng(seed))
    jobs = (tb.make_job(kind, tokens, kv_heads) for kind, tokens, kv_heads in cfg["jobs"])
    await run_jobs(tb, jobs, seed, PERIOD_NS)
