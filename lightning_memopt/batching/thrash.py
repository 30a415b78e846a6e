"""Thrash detection: allocator retries that keep coming back mean the steps run too close to the limit.

What the CUDA allocator does near its limit, and why the rule below tells a re-pack from thrashing:
``docs/micro_batching.md``, "Thrashing: near misses on CUDA".
"""

from __future__ import annotations

from collections import deque
from typing import Any

from lightning_memopt.batching.errors import checklist

__all__ = ["ThrashWatch"]


class ThrashWatch:
    """Says when the allocator retried in too many recent training steps at one micro-batch size.

    Args:
        window: How many recent steps are looked at. Default 5.
        min_steps: How many of them must have had allocator retries. Default 2: one step with retries is
            the allocator re-packing its cache once, which the steps after it do not repeat.

    Raises:
        ValueError: If ``window`` is not an int >= 1, or ``min_steps`` not an int in [1, window].

    Example::

        >>> watch = ThrashWatch(window=5, min_steps=2)
        >>> [watch.step(retries) for retries in (1, 0, 0, 0, 0, 0, 1)]  # isolated retries: re-packs
        [False, False, False, False, False, False, False]
        >>> watch.step(3)  # the second step with retries among the last 5
        True
        >>> watch.step(1)  # the window started again after the detection
        False
    """

    def __init__(self, *, window: int = 5, min_steps: int = 2) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 (recent training steps looked at), got {window!r}")
        if isinstance(min_steps, bool) or not isinstance(min_steps, int) or not 1 <= min_steps <= window:
            raise ValueError(
                f"min_steps must be an int from 1 to window={window} (steps of the window with allocator "
                f"retries that count as thrashing), got {min_steps!r}"
            )
        self.window = window
        self.min_steps = min_steps
        self._retried: deque[bool] = deque(maxlen=window)  # per recent step: did the allocator retry?
        self._size: Any = None

    def step(self, retries: int, *, size: Any = None) -> bool:
        """Record one training step that trained; True when the allocator is thrashing.

        Args:
            retries: How many times the allocator retried during the step (the rise of its cumulative
                counter). Zero or less is a step without retries: a counter that fell was reset by
                someone (``torch.cuda.reset_accumulated_memory_stats``).
            size: The micro-batch size the step ran at, in any unit that changes exactly when the size
                does (the engine passes its size in padded tokens). A new value starts a new window.
        """
        if size != self._size:
            self.reset(size)
        self._retried.append(retries > 0)
        if sum(self._retried) < self.min_steps:
            return False
        self.reset(size)
        return True

    def reset(self, size: Any = None) -> None:
        """Forget the recent steps; the next ones run at ``size`` (see :meth:`step`)."""
        self._retried.clear()
        self._size = size


def watch_allocator(
    watch: ThrashWatch, sizes: Any, retries: int, step: Any, key: Any, *, failed: bool
) -> bool:
    """Feed one training step's allocator ``retries`` to ``watch``; when it says the allocator thrashes,
    lower the size for the next steps (``sizes.near_miss``, a :class:`~.sizes.MicroBatchSizes`).

    Args:
        step: The step that trained (its ``size``, ``total`` and ``floor``).
        key: What changes exactly when the size does (the size in tokens, or the memory model's revision).
        failed: The step backed off after an out-of-memory error: the size just changed, a new window.

    Returns:
        True when the allocator thrashes at the floor, where the size cannot go lower (warn the user).
    """
    if failed:
        watch.reset(key)
        return False
    if not watch.step(retries, size=key):
        return False
    sizes.near_misses += 1
    return not sizes.near_miss(step.size, total=step.total, floor=step.floor)


def thrashing_at_the_floor(size: int, done: frozenset[str] = frozenset()) -> str:
    """The one warning when the allocator thrashes at the fewest samples the model can run (``done``: what
    the fit already does of the advice, :func:`~.errors.checklist`)."""
    return (
        f"The CUDA caching allocator keeps freeing its cache and retrying allocations (thrashing: every "
        f"such step synchronizes the device and reallocates, a large slowdown) at {size} samples per "
        f"micro-batch, the fewest this model can run. Training goes on, slowly. Against fragmentation, set "
        f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts; to need less "
        f"memory:\n{checklist(done)}"
    )
