"""`kernels/host_math.py`: the launchers' integer helpers equal Triton's own (`triton.cdiv`,
`triton.next_power_of_2`) on every value a launcher meets (the host cost they save: CHANGELOG.md)."""

from __future__ import annotations

import triton

from codesign.kernels.host_math import cdiv, next_pow2


def test_equal_to_tritons_own():
    for n in [*range(0, 4200), 2**20 - 1, 2**20, 2**20 + 1, 3 * 2**30]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for b in (1, 2, 3, 7, 16, 64, 128, 1000):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)

