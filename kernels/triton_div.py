"""IEEE (correctly rounded) fp32 division by a divisor many elements share — a row's or a token's scale — by its
reciprocal and two FMA corrections an element, instead of `tl.math.div_rn`'s expansion.

The quantizers need IEEE division: codes must equal torch's `x / s` bit for bit, and fp32 "/" lowers to an
approximate divide on GPUs (off by an ulp, which flips codes at rounding ties). `div_rn` per element is correct but
costs a reciprocal (MUFU, a quarter-rate unit), a range check (FCHK) and a branch to an out-of-line slow path an
element (sm_90: 8-9 instructions on its fast path; the activation quantizer's step went 145 -> 117 SASS without it).

With the divisor's reciprocal y = RN(1 / s) computed once (`recip_rn`, one `div_rn`), each quotient is q0 = RN(x y),
then two corrections q1 = RN(q0 + RN(x - s q0) y), q2 = RN(q1 + RN(x - s q1) y) (FMAs, so each remainder x - s q
is computed exactly). q0 is within two ulps of x / s, q1 within one, and by Markstein's theorem (y within half an
ulp of 1 / s, q1 within an ulp of x / s, the remainder exact) q2 is x / s correctly rounded: the sequence of the
fast path of CUDA's own `div.rn.f32`, with the reciprocal hoisted out of the loop.

The theorem assumes no underflow or overflow. `shared_divisor_ok` is the range where that holds for the quotients a
quantizer rounds (|x / s| <= 2^24): 2^-60 <= s <= 2^60 keeps y normal and the remainder x - s q1 exact (a multiple
of ulp(s) ulp(q1) >= 2^-149) for every |x / s| >= 2^-43; a smaller quotient is within two ulps of x / s and rounds
to the same signed zero code as `div_rn`'s (the smallest e4m3 step is 2^-9). Outside the range (a row whose absmax
is below ~1e-16, an inf or NaN scale) callers divide by `div_rn` instead. The interpreter runs the same sequence
(its `tl.fma` rounds once), so CPU tests check these bits against torch's division.
"""

from __future__ import annotations

import triton
import triton.language as tl

DIVISOR_MIN = tl.constexpr(2.0**-60)  # `shared_divisor_ok`'s range
DIVISOR_MAX = tl.constexpr(2.0**60)


@triton.jit
def recip_rn(s):
    """RN(1 / s): the reciprocal `div_by_recip` needs, correctly rounded (one `div_rn` a divisor)."""
    return tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def shared_divisor_ok(s):
    """Whether `div_by_recip` gives `div_rn`'s bits for this divisor (module docstring: 2^-60 <= s <= 2^60; false
    for 0, inf and NaN)."""
    return (s >= DIVISOR_MIN) & (s <= DIVISOR_MAX)


@triton.jit
def div_by_recip(x, s, y):
    """x / s correctly rounded, given y = `recip_rn(s)` and `shared_divisor_ok(s)`, for 2^-43 <= |x / s| <= 2^24
    (below, within two ulps): one multiply and four FMAs an element (module docstring). x = +-0 gives +-0, as IEEE
    division does (the remainder sums would turn -0 into +0)."""
    q0 = x * y
    q1 = tl.fma(tl.fma(-s, q0, x), y, q0)
    q2 = tl.fma(tl.fma(-s, q1, x), y, q1)
    return tl.where(q0 == 0.0, q0, q2)


@triton.jit
def div_rn_shared(x, s, y, shared):
    """x / s correctly rounded, as `tl.math.div_rn(x, s)` gives it: by `div_by_recip` where `shared` (a scalar: every
    divisor here `shared_divisor_ok`), else by `div_rn` itself (a uniform branch)."""
    if shared:
        q = div_by_recip(x, s, y)
    else:
        q = tl.math.div_rn(x, s)
    return q
