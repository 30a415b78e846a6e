"""How a message lists names and counts things: the one format every note and error of the package uses."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["counted", "first_line", "listed"]

_MOST = 6  # names a message shows before it counts the rest


def listed(names: Sequence[str]) -> str:
    """The first few of ``names``, joined, and how many more there are.

    Example::

        >>> listed(["a", "b"])
        'a, b'
        >>> listed([f"layers.{i}" for i in range(8)])
        'layers.0, layers.1, layers.2, layers.3, layers.4, layers.5 and 2 more'
    """
    shown = ", ".join(names[:_MOST])
    return shown + (f" and {len(names) - _MOST} more" if len(names) > _MOST else "")


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural where ``n`` is not 1.

    Example::

        >>> counted(1, "sample"), counted(3, "step")
        ('1 sample', '3 steps')
    """
    return f"{n} {noun}{'' if n == 1 else 's'}"


def first_line(error: BaseException, limit: int | None = None) -> str:
    """The first line of ``error``'s message (at most ``limit`` characters), for a one-line note.

    Example::

        >>> first_line(RuntimeError("CUDA out of memory.\\nTried to allocate 2 MiB"))
        'CUDA out of memory.'
    """
    return (str(error).strip().splitlines() or [""])[0][:limit]
