"""Small helpers shared by the cocotb benches: bus packing and X/Z-checked reads (numpy only)."""

from __future__ import annotations

import numpy as np
from cocotb.types import Logic


def pack(values, bits: int) -> int:
    """Pack signed/unsigned ints into one bus value, element i in bits [bits*i + bits-1 : bits*i]."""
    mask = (1 << bits) - 1
    return sum((int(v) & mask) << (bits * i) for i, v in enumerate(values))


def unpack_signed(word: int, n: int, bits: int) -> np.ndarray:
    """Inverse of `pack` for n two's-complement `bits`-wide elements (int64 array; bits <= 64)."""
    mask, sign = (1 << bits) - 1, 1 << (bits - 1)
    vals = [(word >> (bits * i)) & mask for i in range(n)]
    return np.array([v - (1 << bits) if v & sign else v for v in vals], dtype=np.int64)


def read_resolved(handle, errors: list[str], where: str) -> int | None:
    """The unsigned value of a signal, or None (and a message appended to `errors`) if it has X/Z."""
    value = handle.value
    if not value.is_resolvable:
        errors.append(f"{handle._name} = {value} (X/Z) at {where}")
        return None
    # 1-bit ports come back as Logic, wider ones as LogicArray.
    return int(value) if isinstance(value, Logic) else value.to_unsigned()
