"""accel_model.pim_mac: the PIM bank MAC unit's functional GEMV and its cycle model.

The functional model is checked against an independent reference in exact rational arithmetic
(fractions.Fraction) with its own round-to-nearest-even to binary32; the cycle model against the
DRAM timing rules re-derived here, and against pim.py's `_stream_ns` for the same bytes per unit.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from codesign.accel_model import pim_mac
from codesign.accel_model.dram import dram_preset
from codesign.accel_model.pim import PIMSpec, _stream_ns
from codesign.specs.errors import CodesignError


def _round_fp32(q: Fraction) -> Fraction:
    """q rounded to binary32, nearest, ties to even (normal range only: the unit's domain)."""
    if q == 0:
        return Fraction(0)
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    assert -126 <= e <= 127, "left the normal range"
    ulp = Fraction(2) ** (e - 23)
    m = a / ulp
    f = math.floor(m)
    if m - f > Fraction(1, 2) or (m - f == Fraction(1, 2) and f % 2):
        f += 1
    return (f * ulp) if q > 0 else -(f * ulp)


def _as_f32(q: Fraction, neg_zero: bool = False) -> np.float32:
    return np.float32(-0.0) if q == 0 and neg_zero else np.float32(float(q))


def _reference(w: np.ndarray, x: np.ndarray, lanes: int) -> np.ndarray:
    """y per the documented order, exact rationals + RNE after each add; zero signs by IEEE rules."""
    n, k = w.shape
    out = np.empty(n, np.float32)
    for r in range(n):
        level = []
        for j in range(lanes):
            acc, neg = None, False
            for c in range(k // lanes):
                a, b = float(w[r, c * lanes + j]), float(x[c * lanes + j])
                p = Fraction(a) * Fraction(b)
                p_neg = p == 0 and math.copysign(1, a) * math.copysign(1, b) < 0
                if acc is None:
                    acc, neg = p, p_neg  # the first product loads the accumulator
                else:
                    s = _round_fp32(acc + p)
                    neg = s == 0 and neg and p_neg  # only (-0) + (-0) stays -0 under RNE
                    acc = s
            level.append((acc, neg))
        while len(level) > 1:
            level = [
                (_round_fp32(a + b), _round_fp32(a + b) == 0 and na and nb)
                for (a, na), (b, nb) in zip(level[0::2], level[1::2])
            ]
        out[r] = _as_f32(*level[0])
    return out


def _fp16(rng, shape, lo=-10, hi=8):
    sig = 1 + rng.integers(0, 1024, shape) / 1024
    v = rng.choice([-1.0, 1.0], shape) * sig * np.exp2(rng.integers(lo, hi, shape))
    v[rng.random(shape) < 0.05] = 0.0
    v[rng.random(shape) < 0.05] = -0.0
    sub = rng.random(shape) < 0.05
    v[sub] = rng.integers(-1023, 1024, sub.sum()) * 2.0**-24  # fp16 subnormals
    return v.astype(np.float16)


@pytest.mark.parametrize("lanes", pim_mac.LANES)
@pytest.mark.parametrize(("n", "kcols"), [(1, 1), (3, 5), (2, 8)])
def test_gemv_matches_exact_reference_bit_for_bit(lanes, n, kcols):
    rng = np.random.default_rng()
    w, x = _fp16(rng, (n, kcols * lanes)), _fp16(rng, kcols * lanes)
    w[0, : lanes // 2] = -w[0, lanes // 2 : lanes]  # some cancellation
    y = pim_mac.gemv(w, x, lanes)
    assert y.dtype == np.float32
    assert np.array_equal(y.view(np.uint32), _reference(w, x, lanes).view(np.uint32))


def test_gemv_rounds_ties_to_even():
    """Hand-derived from the IEEE rules (binary32 ulp of 1.0 is 2^-23), not from the code."""
    # 1 + 2^-23 then + 2^-24: a tie that RNE rounds up to the even 1 + 2^-22 (truncation would not).
    w = np.array([[1.0, 2.0**-12, 2.0**-12, 0.0]], np.float16)  # lanes=2 columns: lane 0 gets w[0], w[2]
    x = np.array([1.0, 1.0, 2.0**-12, 1.0], np.float16)
    # lane 0: 1 + 2^-24 -> tie, even is 1.0; lane 1: 2^-12 + 0 -> 2^-12; tree: 1 + 2^-12 exact.
    assert pim_mac.gemv(w, x, 2)[0] == np.float32(1 + 2.0**-12)
    w = np.array([[1.0, 2.0**-11, 2.0**-12, 0.0, 2.0**-12, 0.0]], np.float16)
    x = np.array([1.0, 2.0**-12, 2.0**-12, 1.0, 2.0**-12, 1.0], np.float16)
    # lane 0: 1 + 2^-24 (tie -> 1) + 2^-24 (tie -> 1); lane 1: 2^-23. tree: 1 + 2^-23 exact.
    assert pim_mac.gemv(w, x, 2)[0] == np.float32(1 + 2.0**-23)
    # Odd accumulator then a tie: rounds up to even.
    w = np.array([[1.0, 0.0, 2.0**-11, 0.0, 2.0**-12, 0.0]], np.float16)
    x = np.array([1.0, 0.0, 2.0**-12, 0.0, 2.0**-12, 0.0], np.float16)
    assert pim_mac.gemv(w, x, 2)[0] == np.float32(1 + 2.0**-22)


def test_gemv_signed_zeros_follow_ieee():
    x = np.array([-1.0, -2.0, 3.0, -4.0], np.float16)
    zero = np.zeros((1, 4), np.float16)
    y = pim_mac.gemv(zero, np.array([-1.0, -2.0, -3.0, -4.0], np.float16), 2)
    assert y[0] == 0 and np.signbit(y[0])  # (-0) + (-0) stays -0 through accumulate and tree
    y = pim_mac.gemv(zero, x, 2)
    assert y[0] == 0 and not np.signbit(y[0])
    w = np.array([[1.0, 1.0, -1.0, 1.0]], np.float16)
    xs = np.array([3.0, 5.0, 3.0, -5.0], np.float16)  # lane 0: 3 - 3 = +0; lane 1: 5 - 5 = +0
    y = pim_mac.gemv(w, xs, 2)
    assert y[0] == 0 and not np.signbit(y[0])


@pytest.mark.parametrize(
    ("w", "x", "lanes", "match"),
    [
        (np.ones((2, 4), np.float32), np.ones(4, np.float16), 2, "w must be"),
        (np.ones((2, 4), np.float16), np.ones(4, np.float64), 2, "x must be"),
        (np.full((2, 4), np.inf, np.float16), np.ones(4, np.float16), 2, "finite"),
        (np.ones((2, 4), np.float16), np.array([1, np.nan, 1, 1], np.float16), 2, "finite"),
        (np.ones((2, 6), np.float16), np.ones(6, np.float16), 4, "K"),
        (np.ones((2, 4), np.float16), np.ones(3, np.float16), 2, "K"),
        (np.ones((2, 4), np.float16), np.ones(4, np.float16), 3, "lanes"),
    ],
)
def test_gemv_rejects_inputs_outside_the_domain(w, x, lanes, match):
    with pytest.raises(CodesignError, match=match):
        pim_mac.gemv(w, x, lanes)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(lanes=12, tccd=1, trcd=1, trp=1, cols_per_row=4), "lanes"),
        (dict(lanes=4, tccd=0, trcd=1, trp=1, cols_per_row=4), "tccd"),
        (dict(lanes=4, tccd=1, trcd=1.5, trp=1, cols_per_row=4), "trcd"),
        (dict(lanes=4, tccd=1, trcd=1, trp=1, cols_per_row=2**16), "cols_per_row"),
    ],
)
def test_unit_config_rejects_bad_parameters(kwargs, match):
    with pytest.raises(CodesignError, match=match):
        pim_mac.PIMUnitConfig(**kwargs)


def test_check_shape_rejects_bad_gemv_sizes():
    cfg = pim_mac.PIMUnitConfig(4, 1, 1, 1, 4, xcols=3)
    for n, k, match in ((0, 4, "n"), (2, 6, "multiple"), (2, 16, "register"), (2**16, 4, "n")):
        with pytest.raises(CodesignError, match=match):
            cfg.check_shape(n, k)
    with pytest.raises(CodesignError, match="DRAM rows"):  # 65535 x 2 columns, one per row
        pim_mac.PIMUnitConfig(4, 1, 1, 1, 1, xcols=2).check_shape(2**16 - 1, 8)


def _random_config(rng) -> pim_mac.PIMUnitConfig:
    return pim_mac.PIMUnitConfig(
        int(rng.choice(pim_mac.LANES)),
        int(rng.integers(1, 6)),
        int(rng.integers(1, 20)),
        int(rng.integers(1, 20)),
        int(rng.integers(1, 9)),
        int(rng.integers(1, 9)),
    )


def test_command_trace_obeys_dram_rules_and_is_as_early_as_they_allow():
    """Each command at the earliest cycle the rules (tRCD, tRP, tCCD slots) allow; W read in order."""
    rng = np.random.default_rng()
    for _ in range(200):
        cfg = _random_config(rng)
        n, kc = int(rng.integers(1, 12)), int(rng.integers(1, cfg.xcols + 1))
        trace = pim_mac.command_trace(cfg, n, kc * cfg.lanes)
        cmds = [e for e in trace if e[1] in ("ACT", "RD", "PRE")]
        t_act = t_rd = t_pre = None
        g = 0
        for t, kind, row, col in cmds:
            if kind == "ACT":
                assert t == (0 if t_pre is None else t_pre + cfg.trp)
                t_act = t
            elif kind == "RD":
                assert (row, col) == divmod(g, cfg.cols_per_row)
                g += 1
                assert t == max(t_act + cfg.trcd, -(10**9) if t_rd is None else t_rd + cfg.tccd)
                t_rd = t
            else:
                assert t == t_rd + cfg.tccd
                t_pre = t
        c, rows = pim_mac.columns_and_rows(cfg, n, kc * cfg.lanes)
        assert g == c and sum(e[1] == "ACT" for e in cmds) == rows and cmds[-1][1] == "PRE"
        # Outputs leave the tree `drain - 1` cycles after their last column's RD, in order.
        ys = [e for e in trace if e[1] == "Y"]
        rds = [e[0] for e in cmds if e[1] == "RD"]
        assert [e[2] for e in ys] == list(range(n))
        assert [e[0] for e in ys] == [rds[(i + 1) * kc - 1] + cfg.drain - 1 for i in range(n)]
        # done: the later of the last y and the cycle before tRP has passed since the closing PRE.
        assert trace[-1][1] == "DONE"
        assert trace[-1][0] == max(ys[-1][0], cmds[-1][0] + cfg.trp - 1)
        assert trace[-1][0] + 1 == pim_mac.unit_cycles(cfg, n, kc * cfg.lanes)
        assert cmds[-1][0] + cfg.trp == pim_mac.bank_cycles(cfg, n, kc * cfg.lanes)


def test_unit_cycles_closed_form_on_a_hand_worked_case():
    # 4 lanes, tCCD 2, tRCD 3, tRP 5, 3 columns a row; N = 2, K = 8 -> C = 4 columns in 2 rows.
    # ACT 0, RD 3, 5, 7 (row 0), PRE 9, ACT 14, RD 17 (row 1), closing PRE 19, bank free at 24;
    # last y at 17 + drain - 1 = 17 + 7 - 1 = 23 -> done in cycle 23, 24 cycles.
    cfg = pim_mac.PIMUnitConfig(4, 2, 3, 5, 3)
    assert cfg.drain == 7
    assert pim_mac.unit_cycles(cfg, 2, 8) == 24 == pim_mac.bank_cycles(cfg, 2, 8)
    assert [e[:2] for e in pim_mac.command_trace(cfg, 2, 8) if e[1] != "Y"] == [
        (0, "ACT"), (3, "RD"), (5, "RD"), (7, "RD"), (9, "PRE"), (14, "ACT"), (17, "RD"), (19, "PRE"),
        (23, "DONE"),
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["HBM2", "HBM2e", "HBM3"])
@pytest.mark.parametrize(("n", "k"), [(1, 16), (3, 128), (17, 96), (40, 128)])
def test_unit_cycles_tie_to_pim_stream_time(name, n, k):
    """pim.py streaming the same bytes per unit = bank_cycles + tRCD; cycles add only the tail drain."""
    pim = PIMSpec(dram_preset(name), banks_per_unit=2, lanes=16)
    cfg = pim_mac.PIMUnitConfig.from_pim(pim)
    mem = pim.memory
    ns = _stream_ns(pim, n * k * 2 * pim.units, reuse=1)  # W of every unit, balanced
    stream_cycles = ns * (1 - mem.refresh_loss) / mem.tCK_ns
    assert stream_cycles == pytest.approx(round(stream_cycles), abs=1e-6)
    assert round(stream_cycles) == pim_mac.bank_cycles(cfg, n, k)
    tail = max(0, cfg.drain - cfg.tccd - cfg.trp)
    assert pim_mac.unit_cycles(cfg, n, k) == round(stream_cycles) + tail
    assert tail == 0  # on HBM presets tCCD + tRP >= 21 > drain = 9: closing the bank ends the job
