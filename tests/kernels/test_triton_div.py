"""`codesign.kernels.triton_div` in the interpreter (whose `tl.fma` rounds once, as the hardware's): division by a
shared divisor through its reciprocal and two FMA corrections gives torch's IEEE `x / s` bit for bit, on quotients
built to sit at and beside rounding ties and at every scale of the divisor range, signed zeros included; with one
correction fewer it does not (the test's teeth); `shared_divisor_ok` accepts exactly the stated range."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codesign.backend import use_backend
from codesign.kernels import triton_div
from codesign.kernels.triton_div import div_by_recip, recip_rn, shared_divisor_ok

DIVISOR_MIN = float(triton_div.DIVISOR_MIN.value)
DIVISOR_MAX = float(triton_div.DIVISOR_MAX.value)


@triton.jit
def _divide(x_ptr, s_ptr, out_ptr, ok_ptr, C: tl.constexpr, CORRECTIONS: tl.constexpr):
    row = tl.program_id(0)
    s = tl.load(s_ptr + row + tl.arange(0, 1))
    x = tl.load(x_ptr + row * C + tl.arange(0, C))
    y = recip_rn(s)
    if CORRECTIONS == 2:
        q = div_by_recip(x, s, y)
    elif CORRECTIONS == 1:  # teeth: Markstein's step on q0 = RN(x y), which may be two ulps off
        q0 = x * y
        q = tl.fma(tl.fma(-s, q0, x), y, q0)
    else:
        q = x * y
    tl.store(out_ptr + row * C + tl.arange(0, C), q)
    tl.store(ok_ptr + row + tl.arange(0, 1), shared_divisor_ok(s).to(tl.int8))


def _run(x: torch.Tensor, s: torch.Tensor, corrections: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full_like(x, float("nan"))
    ok = torch.full(s.shape, -1, dtype=torch.int8)
    with use_backend("triton"):
        _divide[(x.shape[0],)](x, s, out, ok, C=x.shape[1], CORRECTIONS=corrections)
    return out, ok


def _cases(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Divisors over the whole range (random mantissas, exponents -60 .. 60, the ends themselves) and numerators
    x = s (k + 1/2) for integer k, and x = s * e4m3 midpoints, each rounded to fp32 and moved 0-3 ulps either way:
    the quotients where a wrong last bit changes a code. Plus random x in [-448 s, 448 s], +-0 and tiny x."""
    g = torch.Generator().manual_seed(seed)
    exps = torch.randint(-60, 60, (rows,), generator=g).double()
    s = (1 + torch.rand(rows, generator=g, dtype=torch.float64)) * torch.pow(2.0, exps)
    s[0], s[1], s[2] = DIVISOR_MIN, DIVISOR_MAX, 1.0 / 127  # the range's ends; an absmax-1 int8 scale
    s = s.float()
    k = torch.randint(-127, 127, (rows, cols // 2), generator=g).double() + 0.5
    mid = torch.randint(-448, 448, (rows, cols // 4), generator=g).double() + 0.5  # near e4m3's coarse midpoints
    mant = torch.randint(8, 16, (rows, cols - cols // 2 - cols // 4), generator=g).double() + 0.5
    e4m3_mid = mant * torch.pow(2.0, torch.randint(-9, 6, mant.shape, generator=g).double()) / 8
    quot = torch.cat([k, mid, e4m3_mid * torch.sign(torch.rand(mant.shape, generator=g) - 0.5)], 1)
    x = (quot * s.double()[:, None]).float()
    step = torch.randint(-3, 4, x.shape, generator=g)
    for _ in range(3):  # move by `step` ulps, one ulp at a time
        up, down = step > 0, step < 0
        x = torch.where(up, torch.nextafter(x, torch.full_like(x, float("inf"))), x)
        x = torch.where(down, torch.nextafter(x, torch.full_like(x, float("-inf"))), x)
        step = step - up.int() + down.int()
    x[:, :8] = (torch.rand(rows, 8, generator=g) * 896 - 448) * s[:, None]
    x[:, 8], x[:, 9] = 0.0, -0.0
    x[:, 10] = -torch.tensor(1e-45)  # the smallest subnormal: a quotient far below every code's step
    return x, s


def test_division_by_recip_is_ieee_division_bit_for_bit():
    x, s = _cases(256, 2048, seed=7)
    out, ok = _run(x, s)
    want = x / s[:, None]
    assert bool(ok.bool().all())
    exact = want.abs() >= 2.0**-43  # the stated range; below it within two ulps, so the same (signed zero) code
    assert torch.equal(out[exact].view(torch.int32), want[exact].view(torch.int32))
    assert torch.equal(out[~exact].view(torch.int32).sign(), want[~exact].view(torch.int32).sign())
    assert bool((out[~exact] - want[~exact]).abs().le(2.0**-149 * 2).all())
    assert (~exact).sum() >= 2 * 256 and torch.equal(torch.signbit(out[:, 9]), torch.ones(256, dtype=torch.bool))


def test_fewer_corrections_miss_ties():
    """The teeth: without the second correction (or both) the same cases give other bits, so the test above can
    tell the exact sequence from a cheaper one."""
    x, s = _cases(64, 2048, seed=7)
    want = (x / s[:, None]).view(torch.int32)
    for corrections in (0, 1):
        out, _ = _run(x, s, corrections)
        assert not torch.equal(out.view(torch.int32), want), corrections


def test_divisor_range():
    s = torch.tensor([DIVISOR_MIN, DIVISOR_MAX, DIVISOR_MIN / 2, DIVISOR_MAX * 2, 0.0, float("inf"), float("nan"),
                      1.0, 2.0**-149])  # fmt: skip
    _, ok = _run(torch.ones(len(s), 16), s)
    assert ok.tolist() == [1, 1, 0, 0, 0, 0, 0, 1, 0]
