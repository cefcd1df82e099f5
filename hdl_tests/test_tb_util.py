"""The bench helpers outside a simulator: bus packing round-trips, and X/Z on a read is reported.

The monitors call `read_resolved` on every checked output every cycle; the RTL never drives X,
so this is where the X/Z check itself is shown to bite.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cocotb", reason="cocotb not installed (pip install -e .[hdl])")

from cocotb.types import Logic, LogicArray  # noqa: E402
from tb_util import pack, read_resolved, unpack_signed  # noqa: E402


class _Handle:
    def __init__(self, value):
        self.value, self._name = value, "out_data"


@pytest.mark.parametrize("bits", [4, 8, 16, 32, 64])
def test_pack_unpack_round_trip(bits):
    rng = np.random.default_rng(bits)
    vals = rng.integers(-(2 ** (bits - 1)), 2 ** (bits - 1), 7, dtype=np.int64)
    vals[:2] = [-(2 ** (bits - 1)), 2 ** (bits - 1) - 1]
    assert np.array_equal(unpack_signed(pack(vals, bits), 7, bits), vals)


@pytest.mark.parametrize("value", [LogicArray("01X0"), LogicArray("Z000"), Logic("X")])
def test_read_resolved_flags_x_and_z(value):
    errors: list[str] = []
    assert read_resolved(_Handle(value), errors, "10 ns") is None
    assert len(errors) == 1 and "X/Z" in errors[0] and "10 ns" in errors[0]


def test_read_resolved_returns_the_value():
    errors: list[str] = []
    assert read_resolved(_Handle(LogicArray("1010")), errors, "0 ns") == 10
    assert read_resolved(_Handle(Logic("1")), errors, "0 ns") == 1
    assert errors == []
