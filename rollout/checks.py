"""Argument checks shared by every layer (pure Python, no imports beyond the standard library)."""

from __future__ import annotations

import math
from numbers import Integral, Real


def is_int(value) -> bool:
    """An integer that is not a bool (``True`` is an ``int`` in Python, never a count here)."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite real number that is not a bool (numpy scalars such as ``np.float32(0.5)`` included)."""
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def require(condition: bool, field: str, message: str) -> None:
    """``ValueError("<field>: <message>")`` unless ``condition`` holds."""
    if not condition:
        raise ValueError(f"{field}: {message}")


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for ints (no float rounding)."""
    return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return ceil_div(value, multiple) * multiple


def pow2_at_least(value: int, least: int) -> int:
    """The smallest power of two >= ``value`` and >= ``least`` (a Triton block size for ``value`` elements)."""
    return max(least, 1 << (max(1, value) - 1).bit_length())


def require_bools(record, section: str, names: tuple[str, ...]) -> None:
    """``ValueError`` naming ``<section>.<name>`` (or ``<name>`` where ``section`` is empty) for the first of the
    record's fields ``names`` that is not a bool."""
    for name in names:
        value = getattr(record, name)
        require(isinstance(value, bool), f"{section}.{name}" if section else name, f"must be a bool; got {value!r}")


def as_python_numbers(record, ints: tuple[str, ...], floats: tuple[str, ...]) -> None:
    """The frozen record's checked number fields ``ints`` and ``floats`` as Python ``int``/``float`` (None kept):
    a numpy ``int8`` budget overflowed deep in the memory plan."""
    for names, kind in ((ints, int), (floats, float)):
        for name in names:
            value = getattr(record, name)
            if value is not None:
                object.__setattr__(record, name, kind(value))
