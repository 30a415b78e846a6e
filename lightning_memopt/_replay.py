"""Passes whose results are thrown away, which what learns from a step's forwards must not learn from.

The micro-batching engine's one-time exactness check runs a batch's leading micro-batches again as another
split after the step's own micro-batches; ``AutoCheckpoint`` profiles the inputs of the step's last forward of each block. Inside
:func:`replaying`, :func:`is_replaying` is true and such observers skip the forwards.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["is_replaying", "replaying"]

_REPLAYING = contextvars.ContextVar("lightning_memopt_replaying", default=False)


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Mark the forwards run inside as a replay (see the module docstring)."""
    token = _REPLAYING.set(True)
    try:
        yield
    finally:
        _REPLAYING.reset(token)


def is_replaying() -> bool:
    return _REPLAYING.get()
