"""cocotb bench for the pipelined fp32 divider (rtl/fp32_div.v) against numpy float32.

Driver: a new (a, b) pair on the inputs at every falling edge, back to back (one division per
cycle). Monitor: samples y (X/Z-checked) at every falling edge. Model: numpy float32 a / b, due
`latency` cycles after its operands (kv_quant_control.div_latency(step), passed in the config), so
a longer latency shows up as wrong bits and a shorter one as the right bits one edge early.
Scoreboard: one record per operand set (fp32_vectors.div_cases); out-of-domain quotients
(subnormal, overflow) are dropped before driving.

Configuration in $CODESIGN_HDL_CONFIG ({"n", "latency"}); records to $CODESIGN_HDL_RECORDS.
"""

from __future__ import annotations

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge
from fp32_vectors import bits_of, div_cases, f32, in_domain
from tb_util import bench_config, check_verdict, read_resolved, write_records

PERIOD_NS = 10


def model(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """numpy float32 division, bit patterns in and out."""
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        return bits_of(f32(a) / f32(b))


async def stream(dut, a: np.ndarray, b: np.ndarray, latency: int, errors: list[str]):
    """Drive the pairs on consecutive cycles; y for pair i is sampled `latency` falling edges later.

    Also returns what y showed one edge earlier (`early`): with the documented latency it must
    not already be the answer, so a divider one stage shorter than documented fails too.
    """
    n = len(a)
    out = np.empty(n, np.uint32)
    early = np.empty(n, np.uint32)
    for t in range(n + latency):
        if t < n:
            dut.a.value, dut.b.value = int(a[t]), int(b[t])
        await FallingEdge(dut.clk)
        y = read_resolved(dut.y, errors, f"edge {t}") if t + 1 >= latency - 1 else None
        y = 0xFFFFFFFF if y is None else y
        if 0 <= t + 2 - latency < n:
            early[t + 2 - latency] = y
        if 0 <= t + 1 - latency < n:
            out[t + 1 - latency] = y
    return out, early


@cocotb.test()
async def fp32_div_matches_numpy(dut):
    """Every in-domain pair is bit-exact with numpy float32 and arrives after the documented latency."""
    cfg, seed = bench_config(dut)
    rng = np.random.default_rng(seed)
    Clock(dut.clk, PERIOD_NS, unit="ns").start()
    dut.a.value, dut.b.value = 0, 0x3F800000
    await FallingEdge(dut.clk)
    errors: list[str] = []
    records = []
    try:
        for name, (a, b) in div_cases(rng, cfg["n"]).items():
            want = model(a, b)
            keep = in_domain(want)
            a, b, want = a[keep], b[keep], want[keep]
            got, early = await stream(dut, a, b, cfg["latency"], errors)
            bad = np.flatnonzero(got != want)
            # One edge early y must still hold the previous pair's quotient: wherever that differs
            # from this pair's, y must not show this pair's yet (else the RTL is faster than documented).
            changed = np.flatnonzero(want[1:] != want[:-1]) + 1
            early_ok = bool(np.all(early[changed] != want[changed]))
            rec = {
                "t": int(len(a)),
                "case": name,
                "model_cycles": cfg["latency"],
                "rtl_cycles": cfg["latency"] if bad.size == 0 and early_ok else -1,
                "bits_ok": bad.size == 0,
                "cycles_ok": bad.size == 0 and early_ok,  # right bits at the latency, not one edge earlier
                "order_ok": True,
                "xz_ok": not errors,
            }
            rec["ok"] = rec["bits_ok"] and rec["cycles_ok"] and rec["xz_ok"] and len(a) > 0
            if bad.size:
                rec["first_mismatches"] = [
                    f"{a[i]:#010x} / {b[i]:#010x}: rtl {got[i]:#010x} numpy {want[i]:#010x}" for i in bad[:5]
                ]
            dut._log.info("case %s", rec)
            records.append(rec)
    finally:
        write_records(records, seed)
    check_verdict(records, errors)
