"""Checked reads of the numbers in a model's JSON files and GGUF metadata.

Those files come from outside: a value of the wrong type (a string, a list, zero heads) must be a
ModelLoadError naming the file and field, not a ValueError or ZeroDivisionError from deep inside
the loader. No torch here, so the tokenizer loader can use it too.
"""

from __future__ import annotations

import numbers
from typing import Any

from ferrox.errors import ModelLoadError


def to_int(value: Any, what: str, minimum: int = 1) -> int:
    """`value` as an integer of at least `minimum`; an integral float such as 2.0 passes (some
    JSON writers emit them). `what` names the file and field in the error."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ModelLoadError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def to_float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ModelLoadError(f"{what} must be a number, got {value!r}")
    return float(value)
