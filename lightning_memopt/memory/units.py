"""Byte sizes: the one parser every option of the package goes through, and a formatter."""

from __future__ import annotations

import math
import numbers
import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_HELP = "pass an int number of bytes or a string such as '512MB', '6GiB' or '1.5 GB'"


def parse_bytes(value: int | str, *, name: str = "size") -> int:
    """Turn ``value`` into a positive number of bytes.

    Args:
        value: An ``int`` number of bytes, or a string made of a number and a unit: ``B``, SI units
            (``KB``, ``MB``, ``GB``, ``TB``; powers of 1000) or IEC units (``KiB``, ``MiB``, ``GiB``,
            ``TiB``; powers of 1024). Units are case-insensitive; a bare number means bytes.
        name: The option's name, used in the error message.

    Returns:
        The size in bytes, rounded down to a whole byte.

    Raises:
        ValueError: If ``value`` is not positive or cannot be read as a size.

    Example::

        >>> parse_bytes("1.5 GB"), parse_bytes("6GiB"), parse_bytes(512)
        (1500000000, 6442450944, 512)
    """
    if isinstance(value, bool):  # bool is an int subclass; True bytes is never what was meant
        raise ValueError(f"{name} must be a byte size, got {value!r}; {_HELP}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS and unit != "":
            raise ValueError(f"{name} must be a byte size, got {value!r}; {_HELP}")
        number = float(match.group(1)) * _UNITS.get(unit, 1)
        if not math.isfinite(number):
            raise ValueError(f"{name} must be a finite byte size, got {value!r}; {_HELP}")
        n = math.floor(number)
    else:
        raise ValueError(f"{name} must be a byte size, got {value!r} ({type(value).__name__}); {_HELP}")
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}; {_HELP}")
    return n


def format_bytes(n: int | float) -> str:
    """Format a byte count for people: ``format_bytes(3 * 2**20) == '3.00 MiB'``.

    Raises:
        TypeError: ``n`` is not a real number (a bool or a string such as ``"5"`` included).
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(f"format_bytes expects a number of bytes (int or float), got {n!r}")
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} B" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
