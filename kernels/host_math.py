"""Integer helpers for the launchers' host code: `cdiv` and `next_pow2`.

Triton's own (`triton.cdiv`, `triton.next_power_of_2`) are constexpr functions, usable inside kernels: called from
Python each unwraps its arguments first and costs ~2 us, where the arithmetic costs ~0.03; a launcher calls them
several times a launch, and at decode the launches' host time is the step's time (`bench/hf_host_time.py`).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n, as `triton.next_power_of_2` (which gives 0 for 0)."""
    return n if n <= 1 else 1 << (n - 1).bit_length()
