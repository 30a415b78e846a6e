"""Deterministic clocks for the timing that profiles do: the planner's choices, never a wall-clock time.

:class:`WorkClock` counts work instead of time: between a start mark and an end mark it counts the ops
that run (FlopCounterMode's FLOPs of compute-heavy ops, plus the bytes every other op moves, at
``flops_per_byte`` each) and reads one FLOP-equivalent as a nanosecond. The same pass gives the same
"seconds" on every run and machine, so a test can assert what a time-priced plan chooses.
"""

from __future__ import annotations

from lightning_memopt.checkpointing.flops import OpCounter


class WorkClock:
    """A :class:`~lightning_memopt.data.clock.Clock` whose seconds are the work done between two marks.

    Marks come in pairs, as :func:`~lightning_memopt.checkpointing.timing.time_treatments` takes them:
    the first starts counting (a dispatch mode entered), the second stops and reads it.
    """

    def __init__(self, flops_per_byte: float = 50.0) -> None:
        self.flops_per_byte = flops_per_byte
        self._counter: OpCounter | None = None
        self.passes = 0  # how many passes were timed

    def mark(self) -> float:
        if self._counter is None:
            self._counter = OpCounter()
            self._counter.__enter__()
            return 0.0
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        self.passes += 1
        return (counter.flops + self.flops_per_byte * counter.bytes) * 1e-9

    def settle(self, last: float) -> None:
        """Work is counted as it runs."""

    def seconds(self, start: float, end: float) -> float:
        return end - start
