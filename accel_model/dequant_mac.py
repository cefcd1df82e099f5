"""int4 dequant-MAC lanes (the W4A16 GEMV datapath of an accelerator): functional and cycle model.

A unit of L lanes computes L dot products against one shared activation vector x[K] (int16
fixed point). Lane l holds uint4 weight codes q[l, K] in groups of G codes, each group with an
int16 scale s[l, g] and a uint4 zero point z[l, g] (GPTQ/AWQ-style asymmetric codes; symmetric
int4 is z = 8). The lane never forms dequantized weights; it multiplies per group and scales once:

    y[l] = sum_g s[l, g] * sum_{k in group g} x[k] * (q[l, k] - z[l, g])

exactly, in a 64-bit accumulator (|y| < 2^57 for K < 2^20: int16 x 5-bit x 2^20 x int16). With
fixed points x = x_real * 2^fx and s = s_real * 2^fs, y_real = y * 2^-(fx + fs).

Timing (RTL twin: hdl_tests/rtl/dequant_mac_lane.v): P = codes_per_cycle codes per lane and P
activations arrive per cycle (one packed word), so a job of K codes streams W = K / P words, then
three pipeline registers drain (P-term dot product, group sum x scale, accumulate into the output):

    cycles(K, P) = K / P + PIPELINE_STAGES,   PIPELINE_STAGES = 3

counted from the clock edge that accepts `start` up to and including the one that raises `done`.
"""

from __future__ import annotations

import numpy as np

from codesign.specs.errors import CodesignError, check_positive_int

PIPELINE_STAGES = 3  # input register, dot-product register, scaled-group register (+ accumulate = done)
CODES_PER_CYCLE = (1, 2, 4, 8)  # packed int4 words of 4 to 32 bits
MAX_LANES = 16
MAX_GROUPS = 2**16 - 1  # 16-bit n_groups port
MAX_GROUP_SIZE = 4096  # the RTL's 32-bit group sum: 2^15 * 15 * 4096 < 2^31


def check_lane_config(lanes: int, codes_per_cycle: int, group_size: int, n_groups: int | None = None) -> None:
    """Raise CodesignError unless the configuration is one the RTL lane supports.

    1 <= lanes <= MAX_LANES; codes_per_cycle in CODES_PER_CYCLE; group_size a positive multiple
    of codes_per_cycle; 1 <= n_groups <= MAX_GROUPS.
    """
    check_positive_int("lanes", lanes)
    if lanes > MAX_LANES:
        raise CodesignError(f"lanes must be <= {MAX_LANES}, got {lanes}")
    if codes_per_cycle not in CODES_PER_CYCLE:
        raise CodesignError(f"codes_per_cycle must be one of {CODES_PER_CYCLE}, got {codes_per_cycle!r}")
    check_positive_int("group_size", group_size)
    if group_size > MAX_GROUP_SIZE:
        raise CodesignError(f"group_size must be <= {MAX_GROUP_SIZE} (32-bit group sum), got {group_size}")
    if group_size % codes_per_cycle:
        raise CodesignError(
            f"group_size must be a multiple of codes_per_cycle={codes_per_cycle}, got {group_size}"
        )
    if n_groups is not None:
        check_positive_int("n_groups", n_groups)
        if n_groups > MAX_GROUPS:
            raise CodesignError(f"n_groups must be <= {MAX_GROUPS} (16-bit port), got {n_groups}")


def lane_cycles(k: int, codes_per_cycle: int) -> int:
    """start -> done cycles of one job of k codes per lane: k / codes_per_cycle + PIPELINE_STAGES."""
    check_positive_int("k", k)
    if codes_per_cycle not in CODES_PER_CYCLE:
        raise CodesignError(f"codes_per_cycle must be one of {CODES_PER_CYCLE}, got {codes_per_cycle!r}")
    if k % codes_per_cycle:
        raise CodesignError(f"k must be a multiple of codes_per_cycle={codes_per_cycle}, got {k}")
    return k // codes_per_cycle + PIPELINE_STAGES


def _check_range(name: str, a: np.ndarray, lo: int, hi: int, ndim: int) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.ndim != ndim or not np.issubdtype(a.dtype, np.integer):
        raise CodesignError(f"{name} must be a {ndim}-D integer numpy array")
    if a.size and (int(a.min()) < lo or int(a.max()) > hi):
        raise CodesignError(f"{name} must lie in [{lo}, {hi}], got [{a.min()}, {a.max()}]")
    return a.astype(np.int64)


def dequant_mac(
    x: np.ndarray, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, group_size: int
) -> np.ndarray:
    """y[l] = sum_g scale[l, g] * sum_{k in g} x[k] * (codes[l, k] - zero[l, g]), int64 [L], exact.

    x: int16 [K]; codes: uint4 values [L, K]; scale: int16 [L, K / group_size]; zero: uint4
    [L, K / group_size]. Matches the RTL bit for bit (no rounding anywhere; the group sum fits
    32 bits for group_size <= MAX_GROUP_SIZE).
    """
    check_positive_int("group_size", group_size)
    x64 = _check_range("x", x, -(2**15), 2**15 - 1, 1)
    q64 = _check_range("codes", codes, 0, 15, 2)
    s64 = _check_range("scale", scale, -(2**15), 2**15 - 1, 2)
    z64 = _check_range("zero", zero, 0, 15, 2)
    lanes, k = q64.shape
    if x64.shape[0] != k or k % group_size:
        raise CodesignError(
            f"x has {x64.shape[0]} elements and codes are {q64.shape}: "
            f"K must match and be a multiple of group_size={group_size}"
        )
    n_groups = k // group_size
    if s64.shape != (lanes, n_groups) or z64.shape != (lanes, n_groups):
        raise CodesignError(f"scale and zero must be [{lanes}, {n_groups}], got {s64.shape} and {z64.shape}")
    deq = q64.reshape(lanes, n_groups, group_size) - z64[:, :, None]
    group_sums = (deq * x64.reshape(1, n_groups, group_size)).sum(axis=2)
    return (group_sums * s64).sum(axis=1)
