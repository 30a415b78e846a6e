"""A simulated device of a chosen capacity: every tensor op may run out of memory, as on a real one.

:class:`OOMInjector` raises at a module's boundary; :class:`MemoryCap` raises *inside* any op, the way
an allocator does: while it is entered, a :class:`~lightning_memopt.memory.MemoryTracker` counts the live
tensor bytes exactly, and the first op that grows them past ``capacity`` raises
``torch.OutOfMemoryError`` (with a CUDA allocator's message) — in a forward, in the middle of a backward,
in an optimizer's state creation, wherever the memory runs out. The op's output is dropped with the
error, so the bytes fall back below the capacity and recovery code can run.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memopt._checks import check_positive_int
from lightning_memopt._compat import in_backward
from lightning_memopt.memory.tracker import MemoryTracker
from lightning_memopt.memory.units import parse_bytes
from lightning_memopt.testing.oom import InjectedOOM, injected_error, process_rank

__all__ = ["MemoryCap"]


class _CapMode(TorchDispatchMode):
    """Runs each op, then asks the cap whether the bytes it added went over the capacity."""

    def __init__(self, cap: MemoryCap) -> None:
        super().__init__()
        self.cap = cap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.cap.tracker.current
        out = func(*args, **(kwargs or {}))
        error = self.cap._check(before, func)
        if error is not None:
            # A real allocator fails before the output exists: drop it here, not via the traceback
            # (whose frames would keep it alive as long as the caller holds the error).
            del out
            try:
                raise error
            finally:
                del error  # else this frame -> error -> traceback -> this frame: a cycle only gc frees
        return out


class MemoryCap:
    """Simulate a device with ``capacity`` bytes: the op that grows live tensor bytes past it raises.

    Use it as a context manager around the code to test (a ``trainer.fit``, one step). The bytes are
    those of a :class:`~lightning_memopt.memory.MemoryTracker` entered with it (:attr:`tracker`):
    storages the code touches, plus the parameters, buffers, gradients and optimizer state of the
    ``modules`` and ``optimizers`` given, counted from entry. An op raises only when it *added* bytes
    and the total is then over the capacity, so the first op that touches an oversized input, or
    allocates past the limit, fails; ops that free memory never do. The tracker's :attr:`peak` may
    exceed the capacity by the failed op's output, which is dropped with the error.

    Args:
        capacity: The simulated device's bytes: an int or a string such as ``"64MiB"``.
        modules: Modules whose parameters and buffers count from entry (otherwise from their first use).
        optimizers: Optimizers whose state counts from entry.
        ranks: Raise only on these ranks (0 when not distributed). Default None: every rank.
        times: Raise at most this many times. Default None: every time the capacity is exceeded.

    Attributes:
        tracker: The :class:`~lightning_memopt.memory.MemoryTracker` that counts the bytes.
        raised: How many errors it raised.
        events: One :class:`~lightning_memopt.testing.InjectedOOM` per error (phase ``"forward"`` or
            ``"backward"``: whether autograd was running a backward; ``bytes`` over the capacity).

    Raises:
        ValueError: For a capacity that is not a positive size, or ``times`` that is not a positive int.

    Example::

        >>> import torch
        >>> from lightning_memopt.testing import MemoryCap
        >>> layer = torch.nn.Linear(256, 256)  # 263,168 bytes of parameters
        >>> with MemoryCap("512KiB", modules=layer) as cap:
        ...     _ = layer(torch.ones(8, 256))  # 8 samples fit
        ...     try:
        ...         _ = layer(torch.ones(512, 256))  # 512 KiB of input alone: the first op fails
        ...     except torch.OutOfMemoryError:
        ...         pass
        >>> cap.raised, cap.allocated() <= cap.capacity
        (1, True)
    """

    def __init__(
        self,
        capacity: int | str,
        *,
        modules: torch.nn.Module | Iterable[torch.nn.Module] | None = None,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        ranks: Iterable[int] | None = None,
        times: int | None = None,
    ) -> None:
        self.capacity = parse_bytes(capacity, name="capacity")
        check_positive_int("times", times, meaning="how many errors to raise at most", none_ok=True)
        self.ranks = None if ranks is None else frozenset(int(r) for r in ranks)
        self.times = times
        self.tracker = MemoryTracker(modules, optimizers)
        self.raised = 0
        self.events: list[InjectedOOM] = []
        self._mode: _CapMode | None = None

    def allocated(self) -> int:
        """Live tensor bytes now (the interface :class:`OOMInjector`'s ``memory`` and device queries use)."""
        return self.tracker.current

    @property
    def peak(self) -> int:
        """The tracker's peak bytes since entry."""
        return self.tracker.peak

    def __enter__(self) -> MemoryCap:
        if self._mode is not None:
            raise RuntimeError("this MemoryCap is already entered; use one per block of code")
        # The tracker's mode first, then ours on top: ours sees each op first and, after running it
        # (through the tracker, which registers its outputs), reads the bytes it added.
        self.tracker.__enter__()
        self._mode = _CapMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)
        self.tracker.__exit__(*exc)

    def _check(self, before: int, func) -> torch.OutOfMemoryError | None:
        """The error to raise for an op that took the bytes from ``before`` to now, or None."""
        live = self.tracker.current
        if live <= self.capacity or live <= before:
            return None
        if self.times is not None and self.raised >= self.times:
            return None
        rank = process_rank()
        if self.ranks is not None and rank not in self.ranks:
            return None
        phase = "backward" if in_backward() else "forward"
        self.raised += 1
        self.events.append(InjectedOOM(phase, None, live, None, rank))
        return injected_error(
            rank,
            f"MemoryCap in {func} ({phase})",
            f"live bytes {live} > capacity {self.capacity}",
            over=live - self.capacity,
            capacity=self.capacity,
        )
