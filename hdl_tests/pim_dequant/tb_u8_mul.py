"""cocotb bench for the combinational code x fp16 -> fp32 multiplier (rtl/u8_mul_fp16.v) against numpy.

Every code 0..255 against each scale of a set (one pair per nanosecond); y is read (X/Z-checked)
after the settle and compared bit for bit with numpy's float32(code) * float32(scale), which is exact
(19-bit products), signed zeros included (0 x -s = -0). One record per scale set: normals over the
whole exponent range, subnormals, signed zeros, and the range ends (65504, 2^-14, 2^-24, largest
subnormal, 1.0), each with random signs.

Configuration in $CODESIGN_HDL_CONFIG ({"n": scales per set}); records to $CODESIGN_HDL_RECORDS.
"""

from __future__ import annotations

import cocotb
import numpy as np
from tb_util import bench_config, score_combinational


def scale_sets(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Named sets of fp16 scale bit patterns (uint16), random signs."""
    sign = lambda k: rng.integers(0, 2, k).astype(np.uint16) << 15  # noqa: E731
    ends = np.array([0x7BFF, 0x0400, 0x0001, 0x03FF, 0x3C00], np.uint16)
    return {
        "normal": sign(n) | ((rng.integers(1, 31, n) << 10) | rng.integers(0, 1024, n)).astype(np.uint16),
        "subnormal": sign(n) | rng.integers(1, 1024, n).astype(np.uint16),
        "zero": np.array([0x0000, 0x8000], np.uint16),
        "extremes": np.concatenate([ends, ends | 0x8000]),
    }


@cocotb.test()
async def u8_mul_matches_numpy(dut):
    """Every (code, scale) pair of every set is bit-exact with numpy."""
    cfg, seed = bench_config(dut)
    rng = np.random.default_rng(seed)
    codes = np.arange(256)
    cases = []
    for name, scales in scale_sets(rng, cfg["n"]).items():
        c = np.repeat(codes, len(scales))
        s = np.tile(scales, len(codes))
        want = (c.astype(np.float32) * s.view(np.float16).astype(np.float32)).view(np.uint32)
        cases.append((name, {"code": c, "scale": s}, [want]))
    await score_combinational(dut, seed, cases, ("y",), lambda x, i: f"{x['code'][i]} * {x['scale'][i]:#06x}")
