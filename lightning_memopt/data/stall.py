"""Input stalls of a training loop: how long each step waited for its batch, against its compute.

The loop is cut at five points per step (marks of a :class:`~lightning_memopt.data.clock.Clock`)::

    previous step ends ─ wait ─┬─ transfer ─┬─ … ─ step starts ─ compute ─ step ends
                               t0           t1

``wait`` is everything between the end of one step and the start of the next except the host-to-device
transfer (``t0``→``t1``, when the caller marks it): fetching the batch from the DataLoader, which is
what DataLoader settings change. A step whose wait has no start (the first of a fit, whose batch comes
with the workers' start-up, or the first after validation) is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_memopt.data.clock import Clock

__all__ = ["StepTime", "StepTimes", "StallMeter"]


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step."""

    wait: float
    """Waiting for the next batch (the DataLoader's fetch, and anything else between steps)."""
    transfer: float
    """Moving the batch to the device (0 where the transfer is not marked)."""
    compute: float
    """The step itself: forward, backward, optimizer step and the hooks in between."""
    epoch_start: bool = False
    """The first step of an epoch (after the first): its wait includes the DataLoader's ``iter()``."""


@dataclass
class StepTimes:
    """Sums of :class:`StepTime` over some steps (a logging window, a diagnosis window, a fit)."""

    steps: int = 0
    wait: float = 0.0
    transfer: float = 0.0
    compute: float = 0.0
    max_wait: float = 0.0
    """The longest wait of a step that does not start an epoch (bursty loading shows as ``max_wait`` far
    above the mean)."""
    epoch_starts: int = 0
    """Steps that start an epoch (their waits are in ``wait`` too)."""
    epoch_start_wait: float = 0.0
    """Their waits: workers starting again, and their queue filling, at every epoch."""

    def add(self, times: list[StepTime] | StepTimes) -> None:
        """Add steps (or another sum) to this sum."""
        if isinstance(times, StepTimes):
            self.steps += times.steps
            self.wait += times.wait
            self.transfer += times.transfer
            self.compute += times.compute
            self.max_wait = max(self.max_wait, times.max_wait)
            self.epoch_starts += times.epoch_starts
            self.epoch_start_wait += times.epoch_start_wait
            return
        for step in times:
            self.steps += 1
            self.wait += step.wait
            self.transfer += step.transfer
            self.compute += step.compute
            if step.epoch_start:
                self.epoch_starts += 1
                self.epoch_start_wait += step.wait
            else:
                self.max_wait = max(self.max_wait, step.wait)

    @property
    def wait_fraction(self) -> float:
        """Share of the loop's time spent feeding input: (wait + transfer) / (wait + transfer + compute)."""
        total = self.wait + self.transfer + self.compute
        return (self.wait + self.transfer) / total if total > 0 else 0.0

    def as_metrics(self) -> dict[str, float]:
        """Means per step in milliseconds, and the wait fraction: ``wait_ms``, ``transfer_ms``,
        ``compute_ms``, ``wait_fraction``."""
        step = self.per_step()
        ms = {
            "wait_ms": step.wait * 1e3,
            "transfer_ms": step.transfer * 1e3,
            "compute_ms": step.compute * 1e3,
        }
        return {**ms, "wait_fraction": self.wait_fraction}

    def per_step(self) -> StepTime:
        """Mean seconds per step."""
        n = max(self.steps, 1)
        return StepTime(self.wait / n, self.transfer / n, self.compute / n)


class StallMeter:
    """Collects the marks of each step and turns them into :class:`StepTime` when asked.

    Args:
        clock: Where the marks come from (see :func:`~lightning_memopt.data.clock.step_clock`).

    Example::

        meter = StallMeter(HostClock())
        for batch in loader:       # the wait starts at the previous step's end
            meter.step_start()
            train(batch)
            meter.step_end()
        times = meter.read()       # one StepTime per step (the first has no wait start: skipped)
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._since: Any = None  # the mark where waiting began
        self._epoch_start = False  # whether it began at an epoch's start
        self._transfer: list[Any] = []  # [t0] or [t0, t1] of the batch being moved
        self._open: tuple[Any, ...] | None = None  # (since, t0, t1, start, epoch_start) of the step under way
        self._done: list[tuple[Any, ...]] = []  # (since, t0, t1, start, end, epoch_start) not yet read

    def wait_from_now(self, *, epoch_start: bool = False) -> None:
        """Waiting for the next batch starts now (also after validation, or at an epoch's start)."""
        self._since = self.clock.mark()
        self._epoch_start = epoch_start
        self._transfer = []

    def stop_waiting(self) -> None:
        """The time until the next step is not waiting for data (e.g. validation runs in between)."""
        self._since = None
        self._transfer = []

    def transfer_start(self) -> None:
        if self._since is not None:
            self._transfer = [self.clock.mark()]

    def transfer_end(self) -> None:
        if len(self._transfer) == 1:
            self._transfer.append(self.clock.mark())

    def step_start(self) -> None:
        t0, t1 = self._transfer if len(self._transfer) == 2 else (None, None)
        self._open = (self._since, t0, t1, self.clock.mark(), self._epoch_start)
        self._since, self._transfer, self._epoch_start = None, [], False

    def step_end(self) -> None:
        """The step ends; waiting for the next batch starts."""
        if self._open is None:
            return
        end = self.clock.mark()
        since, t0, t1, start, epoch_start = self._open
        self._open = None
        if since is not None:
            self._done.append((since, t0, t1, start, end, epoch_start))
        self._since = end

    @property
    def pending(self) -> int:
        """Finished steps not yet read."""
        return len(self._done)

    def read(self) -> list[StepTime]:
        """The finished steps since the last read (settles the clock once: one device sync on CUDA)."""
        if not self._done:
            return []
        done, self._done = self._done, []
        self.clock.settle(done[-1][4])
        seconds = self.clock.seconds
        times = []
        for since, t0, t1, start, end, epoch_start in done:
            transfer = seconds(t0, t1) if t0 is not None else 0.0
            wait = max(seconds(since, start) - transfer, 0.0)
            times.append(StepTime(wait, transfer, seconds(start, end), epoch_start))
        return times
