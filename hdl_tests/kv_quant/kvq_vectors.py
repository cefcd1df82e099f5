"""fp16 K/V vectors for the KV-quant engine bench (numpy only): realistic keys and hand-made corners.

Every generator returns float16 arrays [n, head_dim] without -0 (the engine compares -0 as +0,
while numpy's min/max may return either zero, which would only change the zero point's sign bit).
Thresholds are fp16 values, hence exact in fp32 on both sides of the compare.
"""

from __future__ import annotations

import numpy as np

# Thresholds per job kind: (lo, hi), all fp16- (so fp32-) representable.
THRESHOLDS = {"corner": (-48.0, 40.0), "keys": (-6.0, 6.0), "plain": (-2.5, 2.0)}


def no_neg_zero(x: np.ndarray) -> np.ndarray:
    """float16 copy of x with -0 replaced by +0."""
    x = np.asarray(x, np.float16)
    return np.where(x == 0, np.float16(0), x).astype(np.float16)


def plain(rng: np.random.Generator, n: int, head_dim: int) -> np.ndarray:
    """i.i.d. N(0, 1) values (value vectors look like this)."""
    return no_neg_zero(rng.standard_normal((n, head_dim)))


def keys_like(rng: np.random.Generator, n: int, head_dim: int, outlier_channels: int = 2) -> np.ndarray:
    """Keys with fixed outlier channels: a few channels 8-16x larger (and offset) in every token.

    This is the per-channel outlier structure measured on real keys (e.g. the MiniLM layer-3
    keys in TOOLCHAIN.md: per-channel absmax 6.3 against a median of 2.4), exaggerated so the
    Oaken thresholds cut exactly those channels most of the time.
    """
    channels = rng.choice(head_dim, size=min(outlier_channels, head_dim), replace=False)
    scale = np.ones(head_dim)
    bias = np.zeros(head_dim)
    scale[channels] = rng.uniform(8, 16, len(channels))
    bias[channels] = rng.choice([-1.0, 1.0], len(channels)) * rng.uniform(4, 10, len(channels))
    return no_neg_zero(rng.standard_normal((n, head_dim)) * scale + bias)


def corner(rng: np.random.Generator, n: int, head_dim: int, bits: int, oaken: bool, max_outliers: int):
    """n hand-made vectors (cycled if n exceeds the list), each a corner of the quantizer.

    ties:       min 0, max qmax x s, other elements (k + 1/2) s: (x - zero) / scale = k + 1/2 exactly,
                so round-half-even and round-half-up differ on every even k;
    ties_shift: the same around min = -2 (x - zero exact in fp32);
    subnormal:  fp16-subnormal inputs m x 2^-20: the scale is an fp16 subnormal;
    scale_zero: inputs 0 and 2^-24: (max - min) / qmax rounds to an fp16 zero, all codes 0;
    constant, two_values, extremes (+-65504), offset (1000 + noise), mixed magnitudes.
    With Oaken: an all-outlier vector (no inner elements: min = max = 0), one with max_outliers + 2
    outliers (over budget), elements exactly on the thresholds (inner), and one outlier planted in
    the ties vectors (it must get code 0 and stay out of the min/max).
    """
    d, qmax = head_dim, 2**bits - 1
    lo, hi = THRESHOLDS["corner"]

    planted = int(rng.integers(0, d)) if oaken else -1  # the outlier planted in the ties vectors

    def ties(base: float, s: float) -> np.ndarray:
        x = base + (rng.integers(0, qmax, d) + 0.5) * s
        ends = rng.choice([i for i in range(d) if i != planted], 2, replace=False)
        x[ends] = [base, base + qmax * s]
        if oaken:
            x[planted] = 1000.0
        return x

    vecs = {
        "ties": ties(0.0, 2.0**-3),
        "ties_shift": ties(-2.0, 2.0**-4),
        "subnormal": rng.integers(0, 60, d) * 2.0**-20,
        "scale_zero": rng.integers(0, 2, d) * 2.0**-24,
        "constant": np.full(d, 1.375),
        "two_values": rng.choice([-0.75, 3.5], d),
        "extremes": rng.uniform(-60000, 60000, d),
        "offset": 1000 + rng.standard_normal(d),
        "mixed": rng.standard_normal(d) * rng.choice([1e-3, 1.0, 30.0], d),
    }
    # Both ends present whatever the draw.
    vecs["subnormal"][:2] = [0.0, 59 * 2.0**-20]
    vecs["scale_zero"][:2] = [0.0, 2.0**-24]
    vecs["two_values"][:2] = [-0.75, 3.5]
    if oaken:
        vecs["all_outliers"] = rng.choice([-1.0, 1.0], d) * rng.uniform(100, 200, d)
        over = rng.uniform(-1, 1, d)
        over[rng.choice(d, min(d, max_outliers + 2), replace=False)] = 500.0
        vecs["over_budget"] = over
        edge = rng.uniform(lo, hi, d)
        edge[rng.choice(d, 2, replace=False)] = [lo, hi]
        vecs["on_thresholds"] = edge
    names = list(vecs)
    order = [names[i % len(names)] for i in range(n)]
    return no_neg_zero(np.stack([vecs[k] for k in order])), order


def job_vectors(rng: np.random.Generator, kind: str, n: int, cfg: dict) -> tuple[np.ndarray, list[str]]:
    """(float16 [n, head_dim], one name per vector) for a job of `kind` (corner / keys / plain)."""
    d = cfg["head_dim"]
    if kind == "corner":
        return corner(rng, n, d, cfg["bits"], cfg["oaken"], cfg["max_outliers"])
    if kind == "keys":
        # K and V of each token alternate: keys carry channel outliers, values do not.
        k = keys_like(rng, (n + 1) // 2, d)
        v = plain(rng, n // 2, d)
        out = np.empty((n, d), np.float16)
        out[0::2], out[1::2] = k, v
        return out, ["key" if i % 2 == 0 else "value" for i in range(n)]
    if kind == "plain":
        return plain(rng, n, d), ["plain"] * n
    raise ValueError(f"unknown job kind {kind!r}")
