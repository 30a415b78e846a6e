"""Argument checks shared by the cores and callbacks (the one place their wording lives)."""

from __future__ import annotations

from typing import Any


def check_positive_int(
    name: str, value: Any, *, minimum: int = 1, meaning: str = "", none_ok: bool = False
) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= ``minimum`` (bools are not ints
    here), or None where ``none_ok``; ``meaning`` says in the message what the number is."""
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        what = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must be {kind}{what}{' or None' if none_ok else ''}, got {value!r}")


def check_bool(name: str, value: Any, *, none_ok: bool = False) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``value`` is ``True`` or ``False`` (or None, where allowed).

    A string such as ``'no'`` or ``'false'`` is truthy, so accepting any value would silently do the
    opposite of what was written (a YAML config quoting the value, a typo).
    """
    if not isinstance(value, bool) and not (none_ok and value is None):
        allowed = "True or False or None" if none_ok else "True or False"
        raise TypeError(f"{name} must be {allowed}, got {value!r}; pass a bool, e.g. {name}=False")
