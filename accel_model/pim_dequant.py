"""The PIM unit's dequantizing front end (`pim.dequant`), functional mode: GEMV over quantized codes.

A front end turns each code into the fp16 operand the unit's MAC lanes take, then the unit runs the
exact fp16 x fp16 -> fp32 path of `pim_mac.gemv` unchanged. The operand rule, integer codes:

    w = fp16_RNE( fp32_RNE( fp32(code) * scale ) + zero )       scale, zero: fp16 values

i.e. exactly `kernels.kvcache.quantizers.dequantize_asym`'s float32 value (code * scale, then + zero, each an
IEEE fp32 operation) rounded to fp16, round to nearest even. In hardware: the product code x scale is
exact (at most 8 + 11 = 19 significant bits, and |code x scale| >= 2^-24 or 0, far above fp32's
subnormals), so the "multiply" is an 8 x 11-bit integer multiplier; the add is an fp32 RNE adder;
the last step an fp32 -> fp16 RNE converter (fp16 subnormals and overflow to inf as IEEE says; an
operand that overflows is outside the domain and refused).

Why not one fused rounding (code x scale + zero straight to fp16)? The two roundings can differ from
a single one: 1024 + (0.5 + 2^-19) (zero = 1024, code 185, scale 1417 x 2^-19, both exact in their
formats) rounds to 1024.5 in fp32 (its ulp there is 2^-13), which is an fp16 tie that goes to even,
1024, while a fused unit gives 1025. The rule above is the one the kernels' reference computes, so
the front end is specified with the fp32 adder (tests/accel_model/test_pim_quant.py checks this case and both
paths against torch).

FP8 e4m3 codes (per-head scale s, fp32): w = fp16_RNE( fp32_RNE( e4m3(code) x s ) ), exactly
`kernels.kvcache.quantizers.dequantize_fp8` rounded to fp16 (e4m3 -> fp32 is exact; 0x7F / 0xFF are NaN and
refused).

Metadata layout of `gemv_codes`: scale and zero are [R, G] with R in (1, N) and K a multiple of G;
element (n, k) uses entry (n if R == N else 0, k // (K / G)):
    per token (one K or V row per token):  [N, 1]
    KIVI keys (per channel, one group):    [1, K]
    KIVI values / grouped weights:         [N, K / group]
"""

from __future__ import annotations

import numpy as np

from codesign.accel_model import pim_mac
from codesign.specs.errors import CodesignError

INT_BITS = (2, 4, 8)


def _check_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    if isinstance(bits, bool) or bits not in INT_BITS:
        raise CodesignError(f"bits must be one of {INT_BITS}, got {bits!r}")
    if not isinstance(codes, np.ndarray) or codes.ndim != 2 or codes.dtype != np.uint8:
        raise CodesignError("codes must be a 2-D uint8 numpy array (unpacked, one code per element)")
    if codes.size and int(codes.max()) >= 2**bits:
        raise CodesignError(f"codes must be < 2^{bits}, got {int(codes.max())}")
    return codes


def _check_meta(name: str, a: np.ndarray, n: int, k: int) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.ndim != 2 or a.dtype != np.float32:
        raise CodesignError(f"{name} must be a 2-D float32 numpy array [R, G]")
    r, g = a.shape
    if r not in (1, n) or g < 1 or k % g:
        raise CodesignError(f"{name} is {a.shape}: need [R, G] with R in (1, {n}) and {k} % G == 0")
    if not np.isfinite(a).all() or not np.array_equal(a.astype(np.float16).astype(np.float32), a):
        raise CodesignError(f"{name} must hold finite fp16 values (the metadata format)")
    return np.repeat(a, k // g, axis=1)


def dequant_operand(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int) -> np.ndarray:
    """float16 [N, K] operands: fp16_RNE(fp32(code) * scale + zero), each step fp32 RNE (module doc).

    codes: uint8 [N, K] below 2^bits; scale, zero: float32 [R, G] holding fp16 values (layout above).
    """
    c = _check_codes(codes, bits)
    n, k = c.shape
    s = _check_meta("scale", scale, n, k)
    z = _check_meta("zero", zero, n, k)
    with np.errstate(over="ignore"):
        w = ((c.astype(np.float32) * s) + z).astype(np.float16)  # numpy: no fused multiply-add
    if not np.isfinite(w).all():
        raise CodesignError("a dequantized operand overflows fp16: metadata outside the front end's domain")
    return w


def e4m3_to_float32(codes: np.ndarray) -> np.ndarray:
    """Exact float32 values of e4m3 (fn) codes: sign, 4-bit exponent (bias 7), 3-bit mantissa;
    exponent 0 is subnormal (m / 8 x 2^-6); 0x7F and 0xFF are NaN."""
    c = codes.astype(np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = (c & 0x7).astype(np.float64)
    mag = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7))
    out = (sign * mag).astype(np.float32)
    out[(c & 0x7F) == 0x7F] = np.nan
    return out


def fp8_operand(codes: np.ndarray, head_scale: float) -> np.ndarray:
    """float16 [N, K] operands of e4m3 codes: fp16_RNE(fp32_RNE(e4m3(code) x head_scale))."""
    if not isinstance(codes, np.ndarray) or codes.ndim != 2 or codes.dtype != np.uint8:
        raise CodesignError("codes must be a 2-D uint8 numpy array of e4m3 bit patterns")
    s = np.float32(head_scale)
    if not (np.isfinite(s) and s > 0):
        raise CodesignError(f"head_scale must be a finite fp32 > 0, got {head_scale!r}")
    v = e4m3_to_float32(codes)
    if np.isnan(v).any():
        raise CodesignError("codes hold the e4m3 NaN pattern (0x7F / 0xFF)")
    with np.errstate(over="ignore"):
        w = (v * s).astype(np.float16)
    if not np.isfinite(w).all():
        raise CodesignError("a dequantized operand overflows fp16: head_scale outside the domain")
    return w


def gemv_codes(
    codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, x: np.ndarray, lanes: int, bits: int
) -> np.ndarray:
    """y = W_hat x on one unit, float32 [N]: `dequant_operand` then `pim_mac.gemv` (bit-exact RTL order).

    x: float16 [K], K a multiple of lanes (one unit's fp16 MAC lanes).
    """
    return pim_mac.gemv(dequant_operand(codes, scale, zero, bits), x, lanes)


# ---- timing of one front-end lane (RTL twin: hdl_tests/rtl/pim_dequant_lane.v) ---------------------
# One operand a cycle through four registers: inputs, (exact product, zero as fp32), fp32 sum, fp16
# operand. An element sampled at clock edge e is on the lane's output from edge e + LANE_LATENCY.
LANE_LATENCY = 3


def lane_cycles(n: int) -> int:
    """Cycles one lane takes for n back-to-back elements: n + LANE_LATENCY, counted inclusively from
    the edge that samples the first code to the edge that registers the last operand."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CodesignError(f"n must be a positive int (elements streamed), got {n!r}")
    return n + LANE_LATENCY
