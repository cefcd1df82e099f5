"""The one exception type for bad input, and the small checks that raise it.

Every user-facing error in codesign is a `CodesignError` (a `ValueError`), whose
message names the argument and what was expected. The CLI turns it into exit
status 2 with no traceback.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any


class CodesignError(ValueError):
    """Bad input: the message names the argument and the accepted values."""


def check_integer(name: str, value: Any) -> int:
    """`value` as an int if it is an integer (numpy's too; not a bool or a float), else raise naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise CodesignError(f"{name} must be an integer, got {value!r}")
    return int(value)


def check_positive_int(name: str, value: Any) -> int:
    """Return `value` if it is an int > 0 (bools refused), else raise naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CodesignError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_nonneg_int(name: str, value: Any) -> int:
    """Return `value` if it is an int >= 0 (bools refused), else raise naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CodesignError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Return `value` if it is one of `choices`, else raise listing them."""
    choices = tuple(choices)
    if value not in choices:
        raise CodesignError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
    return value


def check_positive_ints(name: str, values: Any) -> tuple[int, ...]:
    """Return a non-empty tuple of positive ints, else raise naming `name`."""
    if isinstance(values, int | str) or not isinstance(values, Iterable):
        raise CodesignError(f"{name} must be a non-empty sequence of positive integers, got {values!r}")
    out = tuple(values)
    if not out:
        raise CodesignError(f"{name} must not be empty")
    for i, v in enumerate(out):
        check_positive_int(f"{name}[{i}]", v)
    return out
