"""Operand sets for the PIM dequantizing front-end lane bench (numpy and the standard library only).

An element is (code uint8, scale and zero as fp16 bit patterns uint16). `element_sets` returns named
sets for one code width, built so that each situation occurs by construction:

- "per_token": real per-token quantization metadata: random activation rows (per-row spread 2^-6 to
  2^4, a shifted mean, a few outliers) quantized by `per_token_numpy`, which mirrors
  `codesign.kernels.kvcache.quantizers.quantize_per_token` (fp16 scale and zero; test_rtl_pim_dequant.py checks
  the mirror against it);
- "max_code": the same metadata with every code at 2^bits - 1;
- "code0_signed_zero": code 0 against scales of both signs (-> -0 products), zeros of both signs,
  and code * scale == -zero exactly (exact cancellation -> +0);
- "subnormal_scale": fp16 subnormal scales;
- "ties": the fp32 sum lands exactly halfway between two fp16 values (both rounding directions);
- "double_rounding": the fp32 sum is inexact and its rounding lands on an fp16 tie, so one fused
  rounding would differ (pim_dequant's docstring case 1024 + (0.5 + 2^-19) first). Only 8-bit codes
  reach it: the product must hold the sum's fp16 half-ulp bit and a bit below its fp32 half-ulp, 14
  or more places apart with only zeros (or only ones) between, i.e. code x significand = 2^t +- d with
  0 < d < 2^(t-13); no code below 16 has such a product (`double_rounding_products` enumerates them);
- "subnormal_result": operands that land in the fp16 subnormal range (tiny products and zeros, and
  near-cancellation of zero against the product);
- "range_end": sums around the largest finite fp16 (65504 and its rounding boundary 65520, both
  signs): kept, rounded down to 65504, or overflowing (refused by the model);
- "refused": codes >= 2^bits (bits < 8) and infinite / NaN scales and zeros.

`model` asks `codesign.accel_model.pim_dequant.dequant_operand` for each element's operand bits and
whether it refuses the element. `two_rounding_reference` and `fused_reference` compute the same rule
(and the fused one) in exact rational arithmetic, independently of numpy, for the pytest checks.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from codesign.accel_model import pim_dequant
from codesign.specs.errors import CodesignError

Elements = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes uint8, scale bits uint16, zero bits uint16
FP16_MAX = 65504.0


def h_bits(x) -> np.ndarray:
    """fp16 bit patterns (uint16) of values already exact in fp16."""
    return np.asarray(x, np.float64).astype(np.float16).view(np.uint16)


def h_val(bits: np.ndarray) -> np.ndarray:
    """float64 values of fp16 bit patterns."""
    return np.asarray(bits, np.uint16).view(np.float16).astype(np.float64)


def _elements(codes, scale, zero) -> Elements:
    return (
        np.asarray(codes, np.int64).astype(np.uint8),
        np.asarray(scale, np.uint16),
        np.asarray(zero, np.uint16),
    )


def _cat(parts: list[Elements]) -> Elements:
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def _take(e: Elements, keep: np.ndarray, n: int | None = None) -> Elements:
    idx = np.flatnonzero(keep)[:n]
    return e[0][idx], e[1][idx], e[2][idx]


# ---- per-token metadata (mirror of kernels.kvcache.quantizers.quantize_asym with fp16 metadata) ---------------


def per_token_numpy(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 [R, D], scale float32 [R], zero float32 [R]) of rows x float32 [R, D]:
    scale = fp16(fp32(max - min) / (2^bits - 1)), zero = fp16(min), codes = clip(rint((x - zero) / scale))
    (0 where scale is 0), each step in fp32 as the kernel does."""
    x = np.asarray(x, np.float32)
    qmax = np.float32(2**bits - 1)
    mn, mx = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    scale = ((mx - mn) / qmax).astype(np.float16).astype(np.float32)
    zero = mn.astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint((x - zero) / safe), 0, qmax).astype(np.uint8)
    codes = np.where(scale > 0, codes, 0).astype(np.uint8)
    return codes, scale[:, 0], zero[:, 0]


def activation_rows(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    """float32 [rows, dim] K/V-like rows: per-row spread 2^U(-6, 4), mean N(0, spread), 2% outliers x8."""
    spread = np.exp2(rng.uniform(-6, 4, (rows, 1)))
    x = rng.normal(rng.normal(0, 1, (rows, 1)) * spread, spread, (rows, dim))
    x = np.where(rng.random((rows, dim)) < 0.02, x * 8, x)
    return x.astype(np.float32)


def per_token_elements(rng: np.random.Generator, bits: int, rows: int, dim: int = 64) -> Elements:
    codes, scale, zero = per_token_numpy(activation_rows(rng, rows, dim), bits)
    rep = lambda a: np.repeat(h_bits(a), dim)  # noqa: E731
    return _elements(codes.ravel(), rep(scale), rep(zero))


# ---- directed corners -----------------------------------------------------------------------------


def _random_fp16(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    """n fp16 bit patterns: +-1.f x 2^[lo, hi] (full 10-bit fraction, random sign)."""
    val = (1 + rng.integers(0, 1024, n) / 1024) * np.exp2(rng.integers(lo, hi + 1, n))
    return h_bits(val * rng.choice([-1.0, 1.0], n))


def code0_signed_zero(rng: np.random.Generator, bits: int, n: int) -> Elements:
    qmax = 2**bits - 1
    zeros = np.array([0x0000, 0x8000], np.uint16)
    scale = np.concatenate(
        [np.tile(zeros, 2), _random_fp16(rng, n, -12, 3), rng.integers(1, 1024, n // 4) | 0x8000]
    )
    zero = np.concatenate([np.repeat(zeros, 2), rng.choice(zeros, n), _random_fp16(rng, n // 4, -10, 5)])
    # Exact cancellation: zero = -(code * scale) when that is an fp16 value (the sum is +0).
    c = rng.integers(1, qmax + 1, n)
    s = _random_fp16(rng, n, -12, 2)
    prod = c * h_val(s)
    ok = prod.astype(np.float16).astype(np.float64) == prod
    return _cat([_elements(np.zeros(len(scale)), scale, zero), _elements(c[ok], s[ok], h_bits(-prod[ok]))])


def subnormal_scale(rng: np.random.Generator, bits: int, n: int) -> Elements:
    scale = rng.integers(1, 1024, n).astype(np.uint16) | (rng.integers(0, 2, n).astype(np.uint16) << 15)
    zero = np.where(rng.random(n) < 0.5, _random_fp16(rng, n, -14, -8), _random_fp16(rng, n, -3, 2))
    return _elements(rng.integers(0, 2**bits, n), scale, zero)


def ties(rng: np.random.Generator, bits: int, n: int) -> Elements:
    """zero v = +-(1024 + f) x 2^(E - 10), scale = +-m x 2^(E - 11) with code x m odd and below 2^10:
    the sum is an odd multiple of half v's fp16 ulp and stays in v's binade (|v| + |p| < 2^(E+1) for
    like signs, f >= 512 so that |v| - |p| >= 2^E for unlike ones), so every element is a tie."""
    e = rng.integers(-13, 15, n)
    code = np.minimum(rng.integers(0, 2 ** (bits - 1), n) * 2 + 1, 2**bits - 1)
    m = rng.integers(0, np.maximum(1, 512 // code)) * 2 + 1  # odd, code x m < 1024
    m = np.where(rng.random(n) < 0.3, 1, m)
    sign = rng.choice([-1.0, 1.0], n)
    scale = h_bits(sign * m * np.exp2(e - 11.0))
    like = rng.random(n) < 0.6
    frac = np.where(like, rng.integers(0, 512, n), rng.integers(512, 1023, n))
    zero = h_bits(np.where(like, sign, -sign) * (1024 + frac) * np.exp2(e - 10.0))
    return _elements(code, scale, zero)


def double_rounding_products() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All (code, significand, t) with p = code x sig = 2^t + delta (mod 2^(t+1)), 0 < |delta| < 2^(t-13):
    bit t is the sum's fp16 half-ulp and delta sits below the fp32 half-ulp."""
    c = np.repeat(np.arange(1, 256, dtype=np.int64), 2047)
    sig = np.tile(np.arange(1, 2048, dtype=np.int64), 255)
    p = c * sig
    found = []
    for t in range(13, 19):
        d = (p % (1 << (t + 1))) - (1 << t)
        ok = (d != 0) & (np.abs(d) < (1 << (t - 13)))
        found.append(np.stack([c[ok], sig[ok], np.full(ok.sum(), t)], axis=1))
    f = np.concatenate(found)
    return f[:, 0], f[:, 1], f[:, 2]


_DR_CACHE: list = []


def double_rounding(rng: np.random.Generator, bits: int, n: int) -> Elements:
    if bits < 8:
        return _elements([], [], [])
    if not _DR_CACHE:
        _DR_CACHE.append(double_rounding_products())
    cs, sigs, ts = _DR_CACHE[0]
    k = 6 * n
    pick = rng.integers(0, len(cs), k)
    c, sig, t = cs[pick], sigs[pick], ts[pick]
    # Scale exponent e (sig < 1024: subnormal, e = 1); the sum's binade is E = t + e - 14 in [-14, 15].
    e = np.where(sig < 1024, 1, rng.integers(np.maximum(1, -t), np.minimum(30, 29 - t) + 1))
    ssign = rng.integers(0, 2, k).astype(np.uint16) << 15
    scale = ssign | (np.where(sig < 1024, 0, e) << 10).astype(np.uint16) | (sig & 1023).astype(np.uint16)
    big_e = t + e - 14
    zsign = np.where(rng.random(k) < 0.7, np.where(ssign, -1.0, 1.0), np.where(ssign, 1.0, -1.0))
    zero = h_bits(zsign * (1024 + rng.integers(0, 1024, k)) * np.exp2(big_e - 10.0))
    cand = _elements(c, scale, zero)
    doc = _elements([185], h_bits([1417 * 2.0**-19]), h_bits([1024.0]))  # pim_dequant's docstring case
    keep = np.array(
        [
            two_rounding_reference(*x) != fused_reference(*x) and two_rounding_reference(*x) is not None
            for x in zip(*cand)
        ],
        bool,
    )
    return _cat([doc, _take(cand, keep, n - 1)])


def subnormal_result(rng: np.random.Generator, bits: int, n: int) -> Elements:
    qmax = 2**bits - 1
    # Tiny products: code x subnormal significand < 1024, plus a subnormal zero.
    c = rng.integers(1, qmax + 1, n)
    sig = rng.integers(1, np.maximum(2, 1024 // c))
    scale = (sig | (rng.integers(0, 2, n) << 15)).astype(np.uint16)
    zero = (rng.integers(0, 1024, n) | (rng.integers(0, 2, n) << 15)).astype(np.uint16)
    tiny = _elements(c, scale, zero)
    # Near-cancellation: zero = -fp16(product) (+- a few units of 2^-24), the sum is tiny or 0.
    c2 = rng.integers(1, qmax + 1, n)
    s2 = _random_fp16(rng, n, -16, -6)
    z2 = -(c2 * h_val(s2)).astype(np.float16).astype(np.float64) + rng.integers(-3, 4, n) * 2.0**-24
    z2 = np.where(np.abs(z2) < 2.0**-14, np.round(z2 * 2**24) / 2**24, z2)
    exact = z2.astype(np.float16).astype(np.float64) == z2
    return _cat([tiny, _take(_elements(c2, s2, h_bits(z2.astype(np.float16))), exact)])


def range_end(rng: np.random.Generator, bits: int, n: int) -> Elements:
    """zero = fp16(T - code x scale) for targets T in [65440, 65560] (both signs)."""
    qmax = 2**bits - 1
    c = rng.integers(max(1, qmax // 2), qmax + 1, n)
    frac = rng.uniform(0.5, 0.999, n)
    sign = rng.choice([-1.0, 1.0], n)
    scale = (sign * FP16_MAX * frac / c).astype(np.float16)
    target = sign * rng.uniform(65440, 65560, n)
    zero = (target - c * scale.astype(np.float64)).astype(np.float16)
    return _elements(c, scale.view(np.uint16), zero.view(np.uint16))


def refused(rng: np.random.Generator, bits: int, n: int) -> Elements:
    qmax = 2**bits - 1
    specials = np.array([0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF], np.uint16)
    good_s, good_z = _random_fp16(rng, n, -8, 2), _random_fp16(rng, n, -4, 4)
    parts = [
        _elements(rng.integers(0, qmax + 1, n), rng.choice(specials, n), good_z),
        _elements(rng.integers(0, qmax + 1, n), good_s, rng.choice(specials, n)),
    ]
    if bits < 8:
        parts.append(_elements(rng.integers(qmax + 1, 256, n), good_s, good_z))
    return _cat(parts)


def element_sets(rng: np.random.Generator, bits: int, n: int = 60, rows: int = 6) -> dict[str, Elements]:
    """Named sets of elements for `bits`-bit codes: n per directed set (about), rows x 64 per-token."""
    pt = per_token_elements(rng, bits, rows)
    sets = {
        "per_token": pt,
        "max_code": (np.full(len(pt[0]) // 4, 2**bits - 1, np.uint8), pt[1][::4], pt[2][::4]),
        "code0_signed_zero": code0_signed_zero(rng, bits, n),
        "subnormal_scale": subnormal_scale(rng, bits, n),
        "ties": ties(rng, bits, n),
        "double_rounding": double_rounding(rng, bits, n),
        "subnormal_result": subnormal_result(rng, bits, n),
        "range_end": range_end(rng, bits, n),
        "refused": refused(rng, bits, n // 2),
    }
    return {k: v for k, v in sets.items() if len(v[0])}


# ---- the model and the independent references ------------------------------------------------------


def model(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(operand fp16 bits uint16, refused bool) per element from pim_dequant.dequant_operand (each
    element its own scale / zero group). A refused element's bits are 0."""
    args = lambda c, s, z: (  # noqa: E731
        c.reshape(1, -1),
        h_val(s).astype(np.float32).reshape(1, -1),
        h_val(z).astype(np.float32).reshape(1, -1),
        bits,
    )
    with np.errstate(invalid="ignore", over="ignore"):
        try:
            w = pim_dequant.dequant_operand(*args(codes, scale, zero))
            return w.view(np.uint16).ravel().copy(), np.zeros(len(codes), bool)
        except CodesignError:
            pass
        out, bad = np.zeros(len(codes), np.uint16), np.zeros(len(codes), bool)
        for i in range(len(codes)):
            try:
                out[i] = pim_dequant.dequant_operand(
                    *args(codes[i : i + 1], scale[i : i + 1], zero[i : i + 1])
                )[0, 0].view(np.uint16)
            except CodesignError:
                bad[i] = True
        return out, bad


def _fp16_fraction(bits: int) -> Fraction | None:
    e, f = (bits >> 10) & 0x1F, bits & 0x3FF
    if e == 31:
        return None
    mag = Fraction(f, 1 << 24) if e == 0 else Fraction(1024 + f) * Fraction(2) ** (e - 25)
    return -mag if bits & 0x8000 else mag


def round_rne(q: Fraction, precision: int, emin: int, emax: int) -> Fraction | None:
    """q rounded to a binary format (precision bits, normal exponents emin..emax, subnormals below),
    half to even; None if it overflows (rounds to 2^(emax+1) or more)."""
    if q == 0:
        return q
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e -= Fraction(2) ** e > a
    ulp = Fraction(2) ** (max(e, emin) - precision + 1)
    n = a / ulp
    f = n.numerator // n.denominator
    rem = n - f
    f += rem > Fraction(1, 2) or (rem == Fraction(1, 2) and f % 2 == 1)
    r = f * ulp
    if r >= Fraction(2) ** (emax + 1):
        return None
    return r if q > 0 else -r


def _to_fp16_bits(v: Fraction, neg_zero: bool) -> int:
    if v == 0:
        return 0x8000 if neg_zero else 0
    return int(np.float16(float(v)).view(np.uint16))  # v is exact in fp16


def exact_sum(code: int, scale_bits: int, zero_bits: int, bits: int) -> tuple[Fraction, bool] | None:
    """(code x scale + zero exactly, whether an exact zero is -0), or None for an element the model refuses
    before rounding (code >= 2^bits, non-finite scale or zero)."""
    s, z = _fp16_fraction(int(scale_bits)), _fp16_fraction(int(zero_bits))
    if s is None or z is None or int(code) >= 2**bits:
        return None
    p = int(code) * s
    p_neg = p < 0 or (p == 0 and bool(int(scale_bits) & 0x8000))  # +code x -0 or 0 x -scale: -0
    z_neg = bool(int(zero_bits) & 0x8000)
    return p + z, p_neg and z_neg  # an exact zero sum is -0 only if both addends are -0 (RNE)


def two_rounding_reference(code: int, scale_bits: int, zero_bits: int, bits: int = 8) -> int | None:
    """fp16 bits of fp16_RNE(fp32_RNE(code x scale + zero)) in exact rational arithmetic (the product
    is exact); None where the model refuses (code >= 2^bits, non-finite metadata or an fp16 overflow)."""
    r = exact_sum(code, scale_bits, zero_bits, bits)
    if r is None:
        return None
    exact, neg_zero = r
    r32 = round_rne(exact, 24, -126, 127)
    r16 = None if r32 is None else round_rne(r32, 11, -14, 15)
    return None if r16 is None else _to_fp16_bits(r16, neg_zero)


def fused_reference(code: int, scale_bits: int, zero_bits: int, bits: int = 8) -> int | None:
    """fp16 bits of fp16_RNE(code x scale + zero), one rounding (what FAULT=1 computes)."""
    r = exact_sum(code, scale_bits, zero_bits, bits)
    if r is None:
        return None
    r16 = round_rne(r[0], 11, -14, 15)
    return None if r16 is None else _to_fp16_bits(r16, r[1])


def is_fp16_tie(code: int, scale_bits: int, zero_bits: int, bits: int = 8) -> bool:
    """The exact sum is exactly halfway between two adjacent fp16 values (and fp32-exact)."""
    r = exact_sum(code, scale_bits, zero_bits, bits)
    if r is None or r[0] == 0 or round_rne(r[0], 24, -126, 127) != r[0]:
        return False
    a = abs(r[0])
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e -= Fraction(2) ** e > a
    n = a / Fraction(2) ** (max(e, -14) - 10)
    return n - n.numerator // n.denominator == Fraction(1, 2)
