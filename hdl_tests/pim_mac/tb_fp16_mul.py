"""cocotb bench for the combinational fp16 x fp16 -> fp32 multiplier (rtl/fp16_mul_fp32.v) against numpy.

One (a, b) pair of fp16 bit patterns per nanosecond; y is read (X/Z-checked) after the settle and
compared bit for bit with numpy's float32(a) * float32(b), which is exact (22-bit products). One
record per operand set: normals over the whole exponent range, subnormal x normal, subnormal x
subnormal (the longest normalisation shifts), signed zeros, and the range ends (65504, 2^-14, 2^-24).

Configuration in $CODESIGN_HDL_CONFIG ({"n": pairs per set}); records to $CODESIGN_HDL_RECORDS.
"""

from __future__ import annotations

import cocotb
import numpy as np
from tb_util import bench_config, check_verdict, combinational_record, drive_combinational, write_records


def _fp16_bits(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    """n fp16 bit patterns (uint16) of one kind: normal, subnormal, zero or extreme; random signs."""
    sign = rng.integers(0, 2, n).astype(np.uint16) << 15
    if kind == "normal":
        body = (rng.integers(1, 31, n) << 10) | rng.integers(0, 1024, n)
    elif kind == "subnormal":
        body = rng.integers(1, 1024, n)
    elif kind == "zero":
        body = np.zeros(n, np.int64)
    else:  # max finite, smallest normal, smallest subnormal, largest subnormal, 1.0
        body = rng.choice(np.array([0x7BFF, 0x0400, 0x0001, 0x03FF, 0x3C00]), n)
    return sign | body.astype(np.uint16)


def operand_sets(rng: np.random.Generator, n: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Named (a, b) sets of uint16 fp16 patterns."""
    pairs = {
        "normal_x_normal": ("normal", "normal"),
        "subnormal_x_normal": ("subnormal", "normal"),
        "subnormal_x_subnormal": ("subnormal", "subnormal"),
        "zero_x_any": ("zero", "normal"),
        "extremes": ("extreme", "extreme"),
    }
    return {name: (_fp16_bits(rng, n, ka), _fp16_bits(rng, n, kb)) for name, (ka, kb) in pairs.items()}


def model(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """numpy: fp32(a) * fp32(b) as uint32 bit patterns (exact for finite fp16)."""
    fa, fb = a.view(np.float16).astype(np.float32), b.view(np.float16).astype(np.float32)
    return (fa * fb).view(np.uint32)


@cocotb.test()
async def fp16_mul_matches_numpy(dut):
    """Every pair of every operand set is bit-exact with numpy."""
    cfg, seed = bench_config(dut)
    rng = np.random.default_rng(seed)
    errors: list[str] = []
    records = []
    try:
        for name, (a, b) in operand_sets(rng, cfg["n"]).items():
            want = model(a, b)
            (got,) = await drive_combinational(dut, {"a": a, "b": b}, ("y",), errors)
            bad = np.flatnonzero(got != want.astype(np.int64))
            rec = combinational_record(
                name,
                len(a),
                bad,
                errors,
                [f"{a[i]:#06x} * {b[i]:#06x}: rtl {got[i]:#010x} numpy {want[i]:#010x}" for i in bad[:5]],
            )
            dut._log.info("case %s", rec)
            records.append(rec)
    finally:
        write_records(records, seed)
    check_verdict(records, errors)
