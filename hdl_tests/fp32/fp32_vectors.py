"""Operand generators for the fp32 operator benches (numpy only): finite, zero-or-normal fp32 bit patterns.

Each generator returns two uint32 arrays (a, b). Cases are built from their bit fields so that the
interesting situations (wide and narrow exponent gaps, cancellation, ties at half an ulp, signed
zeros) occur by construction rather than by luck. `in_domain` drops pairs whose exact result
leaves the RTL's documented domain (subnormal or overflowing results).
"""

from __future__ import annotations

import numpy as np

SIGN = np.uint32(1 << 31)


def from_fields(sign, exp, frac) -> np.ndarray:
    """fp32 bit patterns from sign (0/1), biased exponent (0..255) and 23-bit fraction arrays."""
    s = np.asarray(sign, np.uint32) << np.uint32(31)
    return s | (np.asarray(exp, np.uint32) << np.uint32(23)) | np.asarray(frac, np.uint32)


def exp_of(bits: np.ndarray) -> np.ndarray:
    return ((bits >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int64)


def f32(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def bits_of(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def random_normals(rng: np.random.Generator, n: int, lo: int = 1, hi: int = 254) -> np.ndarray:
    """n random normal fp32 bit patterns with biased exponents uniform in [lo, hi]."""
    return from_fields(rng.integers(0, 2, n), rng.integers(lo, hi + 1, n), rng.integers(0, 1 << 23, n))


def near(rng: np.random.Generator, a: np.ndarray, gap: int) -> np.ndarray:
    """Random normals whose exponent is within +-gap of a's (clipped to the normal range)."""
    e = np.clip(exp_of(a) + rng.integers(-gap, gap + 1, len(a)), 1, 254)
    return from_fields(rng.integers(0, 2, len(a)), e, rng.integers(0, 1 << 23, len(a)))


def zeros_and_specials(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Signed zeros against each other and against random normals, both orders."""
    z = np.array([0, 1 << 31], np.uint32)
    x = random_normals(rng, n, 60, 190)
    a = np.concatenate([np.repeat(z, 2), x, rng.choice(z, n)])
    b = np.concatenate([np.tile(z, 2), rng.choice(z, n), x])
    return a, b


def add_cases(rng: np.random.Generator, n: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Named operand sets for a + b."""
    a = random_normals(rng, n, 2, 252)
    cases = {
        "wide_gap": (random_normals(rng, n, 1, 253), random_normals(rng, n, 1, 253)),
        "narrow_gap": (a, near(rng, a, 3)),
        "gap_near_27": (
            a,
            from_fields(
                rng.integers(0, 2, n),
                np.clip(exp_of(a) - rng.integers(22, 30, n), 1, 254),
                rng.integers(0, 1 << 23, n),
            ),
        ),
        "signed_zeros": zeros_and_specials(rng, n // 4),
    }
    # Cancellation: b = -a exactly, and -a moved by one or two ulps (massive normalization shifts).
    b = a ^ SIGN
    step = rng.integers(-2, 3, n).astype(np.int64)
    frac_ok = ((a & np.uint32(0x7FFFFF)).astype(np.int64) + step >= 0) & (
        (a & np.uint32(0x7FFFFF)).astype(np.int64) + step < (1 << 23)
    )
    b_near = np.where(frac_ok, (b.astype(np.int64) + step).astype(np.uint32), b)
    cases["cancellation"] = (np.concatenate([a, a]), np.concatenate([b, b_near]))
    # Ties: b = +-(odd) x half an ulp of a (exactly representable), so a + b lies halfway between
    # two fp32 values (odd = 1, 3) and rounds to the even one; +-tiny moves it off the tie.
    e = exp_of(a)
    half_ulp_exp = e - 24
    ok = half_ulp_exp >= 2
    a_t = a[ok]
    he = half_ulp_exp[ok]
    k = len(a_t)
    odd = rng.choice(np.array([1, 3]), k)  # 1 x 2^he, or 1.5 x 2^(he+1)
    b_exp = np.where(odd == 1, he, he + 1)
    b_frac = np.where(odd == 1, 0, 1 << 22)
    b_t = from_fields(rng.integers(0, 2, k), b_exp, b_frac)
    nudge = from_fields(rng.integers(0, 2, k), b_exp, b_frac + rng.integers(1, 3, k))
    cases["ties"] = (np.concatenate([a_t, a_t]), np.concatenate([b_t, nudge]))
    return cases


def div_cases(rng: np.random.Generator, n: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Named operand sets for a / b (b never zero)."""
    a = random_normals(rng, n, 64, 190)
    cases = {
        "random": (random_normals(rng, n, 1, 254), random_normals(rng, n, 1, 254)),
        "similar": (a, near(rng, a, 1)),
        "kv_scale": (  # (mx - mn) / (2^b - 1): the engine's first division
            random_normals(rng, n, 90, 150),
            bits_of(rng.choice(np.array([3.0, 15.0, 255.0], np.float32), n)),
        ),
        "zero_dividend": (rng.choice(np.array([0, 1 << 31], np.uint32), n // 4), random_normals(rng, n // 4)),
    }
    # Exact quotients and ties: q x b with a short q is exact, then ties come from x.5 codes
    # (the engine's (x - zero) / scale lands on k + 1/2 when x sits halfway between two levels).
    b = random_normals(rng, n, 100, 140) & np.uint32(0xFFFFE000)  # 11-bit significands
    q = (rng.integers(0, 512, n) + 0.5 * rng.integers(0, 2, n)).astype(np.float32)
    prod = f32(b).astype(np.float64) * q
    exact = prod.astype(np.float32).astype(np.float64) == prod
    cases["exact_and_half"] = (bits_of(prod[exact].astype(np.float32)), b[exact])
    return cases


def in_domain(y: np.ndarray) -> np.ndarray:
    """True where an fp32 result is zero or normal and finite (the RTL's documented domain)."""
    e = exp_of(y)
    frac = y & np.uint32(0x7FFFFF)
    return ((e > 0) & (e < 255)) | ((e == 0) & (frac == 0))
