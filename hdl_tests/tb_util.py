"""Small helpers shared by the cocotb benches: bus packing, X/Z-checked reads, the verdict (numpy only)."""

from __future__ import annotations

import json
import os

import numpy as np
from cocotb.types import Logic


def pack(values, bits: int) -> int:
    """Pack signed/unsigned ints into one bus value, element i in bits [bits*i + bits-1 : bits*i]."""
    mask = (1 << bits) - 1
    return sum((int(v) & mask) << (bits * i) for i, v in enumerate(values))


def unpack_signed(word: int, n: int, bits: int) -> np.ndarray:
    """Inverse of `pack` for n two's-complement `bits`-wide elements (int64 array; bits <= 64)."""
    mask, sign = (1 << bits) - 1, 1 << (bits - 1)
    vals = [(word >> (bits * i)) & mask for i in range(n)]
    return np.array([v - (1 << bits) if v & sign else v for v in vals], dtype=np.int64)


def read_resolved(handle, errors: list[str], where: str) -> int | None:
    """The unsigned value of a signal, or None (and a message appended to `errors`) if it has X/Z."""
    value = handle.value
    if not value.is_resolvable:
        errors.append(f"{handle._name} = {value} (X/Z) at {where}")
        return None
    # 1-bit ports come back as Logic, wider ones as LogicArray.
    return int(value) if isinstance(value, Logic) else value.to_unsigned()


def write_records(records: list[dict], seed: int) -> None:
    """Hand the scoreboard's records (seed added) to the pytest entry / report, if it asked for them."""
    path = os.environ.get("CODESIGN_HDL_RECORDS")
    if path:
        for rec in records:
            rec["seed"] = seed
        with open(path, "w") as f:
            json.dump(records, f, indent=1)


def check_verdict(records: list[dict], xz_errors: list[str]) -> None:
    """Fail the cocotb test on any X/Z on a checked output or any job that disagrees with the model."""
    assert not xz_errors, "X/Z on checked outputs: " + "; ".join(xz_errors[:5])
    bad = [r for r in records if not r["ok"]]
    assert not bad, f"{len(bad)} of {len(records)} jobs disagree with the model: {bad[:3]}"


def bench_config(dut) -> tuple[dict, int]:
    """The run's configuration ($CODESIGN_HDL_CONFIG, JSON from the pytest entry) and seed, logged."""
    cfg = json.loads(os.environ["CODESIGN_HDL_CONFIG"])
    seed = int(os.environ["COCOTB_RANDOM_SEED"])
    dut._log.info("seed %d config %s", seed, cfg)
    return cfg, seed


async def reset_and_monitor(dut, period_ns: float, monitor_run) -> None:
    """Start `dut.clk`, hold `dut.rst` for three cycles, start the monitor coroutine, and return on the
    falling edge after reset (inputs set before this call are what the DUT sees out of reset)."""
    from cocotb import start_soon
    from cocotb.clock import Clock
    from cocotb.triggers import FallingEdge

    Clock(dut.clk, period_ns, unit="ns").start()
    dut.rst.value = 1
    for _ in range(3):
        await FallingEdge(dut.clk)
    dut.rst.value = 0
    start_soon(monitor_run)
    await FallingEdge(dut.clk)


async def drive_combinational(
    dut, inputs: dict, outputs: tuple[str, ...], errors: list[str]
) -> list[np.ndarray]:
    """Apply each input vector (port name -> values) for 1 ns and read every output port after the settle,
    X/Z-checked (an X/Z reads as -1, with a message in `errors`); int64 arrays in `outputs` order."""
    from cocotb.triggers import Timer

    names = list(inputs)
    cols = [np.asarray(inputs[n]).tolist() for n in names]
    got = [np.empty(len(cols[0]), np.int64) for _ in outputs]
    for i, row in enumerate(zip(*cols)):
        for n, v in zip(names, row):
            getattr(dut, n).value = v
        await Timer(1, "ns")
        where = " ".join(f"{n}={v:#x}" for n, v in zip(names, row))
        for g, o in zip(got, outputs):
            y = read_resolved(getattr(dut, o), errors, where)
            g[i] = -1 if y is None else y
    return got


async def score_combinational(dut, seed: int, cases, outputs: tuple[str, ...], describe) -> None:
    """The whole scoreboard of a combinational unit: for each case (name, inputs: port -> values,
    wants: one array per output port), drive it (`drive_combinational`), compare every output bit for bit,
    log and keep its `combinational_record`; write the records, then fail the test on any mismatch or X/Z.
    describe(inputs, i) words input vector i of a case for its first few mismatches."""
    errors: list[str] = []
    records = []
    try:
        for name, inputs, wants in cases:
            got = await drive_combinational(dut, inputs, outputs, errors)
            n = len(next(iter(inputs.values())))
            diff = np.zeros(n, bool)
            for g, w in zip(got, wants):
                diff |= g != np.asarray(w).astype(np.int64)
            bad = np.flatnonzero(diff)
            words = [
                f"{describe(inputs, i)}: rtl "
                + " ".join(f"{o} {int(g[i]):#x}" for o, g in zip(outputs, got))
                + " numpy "
                + " ".join(f"{o} {int(w[i]):#x}" for o, w in zip(outputs, wants))
                for i in bad[:5]
            ]
            rec = combinational_record(name, n, bad, errors, words)
            dut._log.info("case %s", rec)
            records.append(rec)
    finally:
        write_records(records, seed)
    check_verdict(records, errors)


def combinational_record(
    case: str, n: int, bad: np.ndarray, errors: list[str], mismatches: list[str]
) -> dict:
    """The scoreboard record of one operand set of a combinational unit (no cycles to check): bits_ok when
    no index is in `bad`, xz_ok when `errors` is empty; `mismatches` words the first few bad indices.
    An empty set is not ok (it would prove nothing)."""
    rec = {
        "t": int(n),
        "case": case,
        "model_cycles": 0,
        "rtl_cycles": 0,
        "bits_ok": bad.size == 0,
        "cycles_ok": True,  # combinational
        "order_ok": True,
        "xz_ok": not errors,
    }
    rec["ok"] = rec["bits_ok"] and rec["xz_ok"] and n > 0
    if bad.size:
        rec["first_mismatches"] = mismatches
    return rec


async def run_job(tb, job, gap: int, period_ns: float) -> None:
    """Idle `gap` cycles, send `job`, wait (bounded) for its done, score it: one job of a job-level bench.

    `tb` wires dut, model (`expect(job)`), driver (async `send(job)`), monitor (`done_event`, `jobs`),
    scoreboard (`expected`, `check(observed)`) and `timeout_cycles(job, expected)`. Called on a falling edge;
    with gap 0 start goes up on the falling edge where the previous done was seen, so it is accepted on the
    very next edge (the tightest legal restart).
    """
    from cocotb.triggers import FallingEdge, with_timeout

    for _ in range(gap):
        await FallingEdge(tb.dut.clk)
    exp = tb.model.expect(job)
    tb.scoreboard.expected.append((job, exp))
    tb.monitor.done_event.clear()
    await tb.driver.send(job)
    await with_timeout(tb.monitor.done_event.wait(), tb.timeout_cycles(job, exp) * period_ns, "ns")
    tb.scoreboard.check(tb.monitor.jobs.popleft())


async def run_jobs(tb, jobs, seed: int, period_ns: float, run_one=None) -> None:
    """The whole run of a job-level bench: reset, then each job of the iterable `jobs` (drawn lazily, before
    its gap) through `run_one(job)` (default `run_job` after 0-2 random idle cycles from `tb.rng`); the
    records are written even when a job timed out (the report shows how far it got), then the verdict."""
    if run_one is None:
        run_one = lambda job: run_job(tb, job, int(tb.rng.integers(0, 3)), period_ns)  # noqa: E731
    await tb.reset()
    try:
        for job in jobs:
            await run_one(job)
    finally:
        write_records(tb.scoreboard.records, seed)
    check_verdict(tb.scoreboard.records, tb.monitor.errors)
