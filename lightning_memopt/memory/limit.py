"""Memory limits: the one place where a callback's ``max_memory`` and ``headroom`` become bytes.

Every callback that takes a memory limit takes the same two options with the same meaning:

- ``max_memory``: the memory one training step may use on one device. An ``int`` (bytes), a string
  such as ``"6GiB"`` or ``"1.5 GB"``, or a ``float`` in (0, 1]: that fraction of the device's capacity.
  ``None`` (the default) means the device's capacity.
- ``headroom``: the fraction of that limit kept free (for the allocator's rounding and fragmentation,
  and for what a measurement cannot see). The usable bytes are ``limit * (1 - headroom)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_memopt.memory.units import parse_bytes

__all__ = ["MemoryLimit", "StepLimit", "check_headroom", "check_max_memory", "usable_bytes"]

MemoryLimit = int | float | str | None  # float before str: jsonargparse reads "0.5" as a fraction


def check_max_memory(value: Any, *, name: str = "max_memory") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a valid memory limit (see the module doc)."""
    if value is None:
        return
    if isinstance(value, float):
        if not (math.isfinite(value) and 0 < value <= 1):
            raise ValueError(
                f"{name} as a float is a fraction of the device's capacity and must be in (0, 1], got "
                f"{value!r}; pass bytes (an int or a string like '6GiB') for an absolute limit"
            )
        return
    parse_bytes(value, name=name)


def check_headroom(value: Any, *, name: str = "headroom") -> float:
    """Return ``value`` as a float, or raise ``ValueError`` unless it is a fraction in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(
            f"{name} must be a number in [0, 1) (the fraction of the memory limit kept free), got "
            f"{value!r}; e.g. 0.1 keeps 10% free, 0 uses the whole limit"
        )
    return float(value)


def usable_bytes(
    max_memory: MemoryLimit, headroom: float, capacity: int | None, *, name: str = "max_memory"
) -> int | None:
    """The bytes a step may use: ``limit * (1 - headroom)``, or None where no limit is known.

    Args:
        max_memory: The user's limit (see the module doc); checked with :func:`check_max_memory`.
        headroom: Fraction of the limit kept free, in [0, 1).
        capacity: The device's capacity in bytes, or None where unknown (CPU).
        name: The option's name, for error messages.

    Raises:
        ValueError: For a fraction of capacity where the capacity is unknown.

    Example::

        >>> usable_bytes("1KiB", 0.25, None), usable_bytes(0.5, 0.0, 4000), usable_bytes(None, 0.1, None)
        (768, 2000, None)
    """
    check_max_memory(max_memory, name=name)
    headroom = check_headroom(headroom)
    if max_memory is None:
        limit = capacity
    elif isinstance(max_memory, float):
        if capacity is None:
            raise ValueError(
                f"{name}={max_memory!r} is a fraction of the device's capacity, but this device's capacity is "
                f"unknown (CPU); pass bytes instead, e.g. {name}='6GiB'"
            )
        limit = int(capacity * max_memory)
    else:
        limit = parse_bytes(max_memory, name=name)
    if limit is None:
        return None
    return math.floor(limit * (1 - headroom))


@dataclass(frozen=True)
class StepLimit:
    """A training step's memory limit as the user gave it, and the bytes it leaves usable.

    Example::

        >>> limit = StepLimit.resolve("1MiB", 0.25, capacity=None)
        >>> limit.usable, limit.describe()
        (786432, "max_memory='1MiB'")
    """

    max_memory: MemoryLimit
    """The limit as passed: bytes, a string such as ``"6GiB"``, a fraction of capacity, or None (capacity)."""
    headroom: float
    """Fraction of the limit kept free."""
    usable: int | None
    """``limit * (1 - headroom)`` in bytes; None where no limit is known (no ``max_memory``, CPU)."""

    @classmethod
    def resolve(cls, max_memory: MemoryLimit, headroom: float, capacity: int | None) -> StepLimit:
        """The limit on a device of ``capacity`` bytes (None: unknown).

        Raises:
            ValueError: For a bad limit or headroom, or a fraction of an unknown capacity (the message
                names ``max_memory`` and the fix).
        """
        usable = usable_bytes(max_memory, headroom, capacity)
        return cls(max_memory, check_headroom(headroom), usable)

    def describe(self) -> str:
        """The limit in the user's terms: ``"max_memory='6GiB'"``, or ``"the capacity"``."""
        return f"max_memory={self.max_memory!r}" if self.max_memory is not None else "the capacity"

    def needed(self, usable: int) -> int:
        """The smallest limit (bytes) that leaves ``usable`` bytes after the headroom."""
        return int(usable / (1 - self.headroom)) + 1
