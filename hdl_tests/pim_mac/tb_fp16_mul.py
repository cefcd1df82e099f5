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
from tb_util import bench_config, score_combinational


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
    cases = [(name, {"a": a, "b": b}, [model(a, b)]) for name, (a, b) in operand_sets(rng, cfg["n"]).items()]
    await score_combinational(dut, seed, cases, ("y",), lambda x, i: f"{x['a'][i]:#06x} * {x['b'][i]:#06x}")
