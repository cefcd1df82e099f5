"""cocotb bench for the combinational fp32 -> fp16 RNE converter (rtl/fp32_to_fp16.v) against numpy.

One fp32 bit pattern per nanosecond; y and ovf are read (X/Z-checked) after the settle and compared
with numpy's float32 -> float16 cast (IEEE round to nearest even; ovf = the cast is infinite). One
record per operand set (`operand_sets`): normals over the fp16 range, exact ties and one-off ties
(both parities), subnormal results with their ties, the overflow boundary around 65504 / 65520,
results near and below 2^-24 (rounding to zero or to the smallest subnormal), signed zeros.

Configuration in $CODESIGN_HDL_CONFIG ({"n": patterns per set}); records to $CODESIGN_HDL_RECORDS.
"""

from __future__ import annotations

import cocotb
import numpy as np
from tb_util import bench_config, score_combinational


def _fields(sign, exp, frac) -> np.ndarray:
    return (
        (np.asarray(sign, np.uint32) << np.uint32(31))
        | (np.asarray(exp, np.uint32) << np.uint32(23))
        | np.asarray(frac, np.uint32)
    )


def operand_sets(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Named sets of fp32 bit patterns (uint32), all zero or normal."""
    s = lambda: rng.integers(0, 2, n)  # noqa: E731
    frac = lambda: rng.integers(0, 1 << 23, n)  # noqa: E731
    # Low 13 bits exactly half (a tie), or half +- 1 (just off it); the kept lsb random.
    tie_low = lambda: np.uint32(1 << 12) + rng.integers(-1, 2, n) * rng.integers(0, 2, n)  # noqa: E731
    hi10 = lambda: rng.integers(0, 1 << 10, n) << 13  # noqa: E731
    # Subnormal results: exponent fields 102..112 (2^-25 .. 2^-15); ties at the subnormal lsb.
    e_sub = rng.integers(102, 113, n)
    sub_tie = (np.uint32(1) << (np.uint32(13) + (113 - e_sub).astype(np.uint32) - 1)).astype(np.int64)
    sub_frac = np.where(rng.random(n) < 0.5, frac() & ~((sub_tie << 1) - 1) | sub_tie, frac())
    top = np.float32(65504.0).view(np.uint32).astype(np.int64)
    return {
        "normal": _fields(s(), rng.integers(113, 143, n), frac()),
        "ties": _fields(s(), rng.integers(113, 143, n), hi10() | tie_low()),
        "subnormal": _fields(s(), e_sub, sub_frac & ((1 << 23) - 1)),
        "overflow_edge": _fields(s(), 0, 0) | (top + rng.integers(-4096, 12288, n)).astype(np.uint32),
        "tiny": _fields(s(), rng.integers(90, 105, n), frac()),
        "zeros_and_big": np.concatenate(
            [np.array([0, 1 << 31], np.uint32), _fields(s(), rng.integers(143, 255, n), frac())]
        ),
    }


def model(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy: (fp16 bits, overflowed) of the float32 -> float16 cast."""
    with np.errstate(over="ignore"):
        y = x.view(np.float32).astype(np.float16)
    return y.view(np.uint16), np.isinf(y)


@cocotb.test()
async def fp32_to_fp16_matches_numpy(dut):
    """Every pattern of every set: y bit-exact with numpy, ovf = numpy's result is infinite."""
    cfg, seed = bench_config(dut)
    rng = np.random.default_rng(seed)
    cases = [(name, {"x": x}, list(model(x))) for name, x in operand_sets(rng, cfg["n"]).items()]
    await score_combinational(dut, seed, cases, ("y", "ovf"), lambda x, i: f"{x['x'][i]:#010x}")
