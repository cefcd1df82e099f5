"""cocotb bench for the combinational fp32 adder (rtl/fp32_add.v) against numpy float32.

Driver: puts one (a, b) pair of bit patterns on the inputs per nanosecond; Monitor: reads y
(X/Z-checked) after the combinational settle; Model: numpy's float32 a + b (IEEE, ties to even);
Scoreboard: one record per operand set (fp32_vectors.add_cases), bit-exact or failed. Pairs whose
exact result leaves the RTL's documented domain (subnormal or overflowing) are dropped by the
model before driving. (Subtraction, as the engine does it, is this adder with b's sign bit flipped;
the operand sets hold both signs, so a - b is covered as a + (-b).)

Configuration in $CODESIGN_HDL_CONFIG ({"n": pairs per set}); records to $CODESIGN_HDL_RECORDS.
"""

from __future__ import annotations

import cocotb
import numpy as np
from fp32_vectors import add_cases, bits_of, f32, in_domain
from tb_util import bench_config, score_combinational


def model(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """numpy float32 addition, bit patterns in and out."""
    with np.errstate(over="ignore"):
        return bits_of(f32(a) + f32(b))


@cocotb.test()
async def fp32_add_matches_numpy(dut):
    """Every in-domain pair of every operand set is bit-exact with numpy float32."""
    cfg, seed = bench_config(dut)
    rng = np.random.default_rng(seed)
    cases = []
    for name, (a, b) in add_cases(rng, cfg["n"]).items():
        want = model(a, b)
        keep = in_domain(want)
        cases.append((name, {"a": a[keep], "b": b[keep]}, [want[keep]]))
    await score_combinational(dut, seed, cases, ("y",), lambda x, i: f"{x['a'][i]:#010x} + {x['b'][i]:#010x}")
