"""Step clocks: the only module of :mod:`lightning_memopt.data` that calls ``torch.cuda``.

A clock hands out opaque marks and turns two marks into seconds. On CPU the work is synchronous, so a
mark is the host's ``perf_counter``. On CUDA the host runs ahead of the device, so host times would
measure kernel *launches*; a mark is a CUDA event recorded on the current stream instead, and the gap
between two events is the device's own idle or busy time. Events are read only in :meth:`settle`
(at logging points), so measuring never makes the loop wait for the device.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

__all__ = ["Clock", "HostClock", "CudaClock", "step_clock"]


class Clock(Protocol):
    """Marks points of the loop and measures the seconds between two of them."""

    def mark(self) -> Any:
        """A mark for now (on the device's timeline)."""

    def settle(self, last: Any) -> None:
        """Wait until ``last`` (and every mark before it) can be read."""

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``; only after :meth:`settle` of ``end`` or a later mark."""


class HostClock:
    """The host's ``time.perf_counter``: exact for devices that compute synchronously (CPU)."""

    def mark(self) -> float:
        return time.perf_counter()

    def settle(self, last: float) -> None:
        """Host marks are readable at once."""

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    """CUDA events on the device's current stream: the device's timeline, without synchronizing per mark."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def settle(self, last: Any) -> None:
        last.synchronize()  # the one wait for the device, once per logging window

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0  # elapsed_time is in milliseconds


def step_clock(device: torch.device | str) -> Clock:
    """The clock that measures the loop on ``device``: CUDA events on CUDA, host time elsewhere."""
    device = torch.device(device)
    return CudaClock(device) if device.type == "cuda" else HostClock()
