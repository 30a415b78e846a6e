"""Device memory queries: the only module of the package that calls ``torch.cuda`` memory APIs.

Everything else asks :func:`device_memory` for a :class:`DeviceMemory` and reads the same five numbers,
so the logic above it runs unchanged on CPU and is tested on CPU with a faked ``torch.cuda``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lightning_memopt.memory.tracker import MemoryTracker
from lightning_memopt.memory.units import parse_bytes

__all__ = ["DeviceMemory", "CudaMemory", "TrackedMemory", "device_memory"]


class DeviceMemory(Protocol):
    """Five numbers about one device's memory, in bytes, and a way to release its cache."""

    def capacity(self) -> int | None:
        """Total bytes the device has, or None where that is unknown (CPU without a user cap)."""

    def allocated(self) -> int:
        """Bytes held by live tensors now."""

    def reserved(self) -> int:
        """Bytes the allocator holds (live tensors plus its cache)."""

    def peak(self) -> int:
        """Largest ``allocated`` since the last :meth:`reset_peak`."""

    def reset_peak(self) -> None:
        """Start a new peak window."""

    def empty_cache(self) -> None:
        """Give cached, unused blocks back to the device (after recovering from an out-of-memory error)."""


class CudaMemory:
    """A CUDA device, read from the caching allocator's statistics."""

    def __init__(self, device: torch.device | int | str, capacity: int | None = None) -> None:
        self.device = torch.device(device)
        self._capacity = capacity

    def capacity(self) -> int:
        if self._capacity is not None:
            return self._capacity
        _free, total = torch.cuda.mem_get_info(self.device)
        return int(total)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


class TrackedMemory:
    """Any other device (CPU, meta, fake): live tensor bytes from a :class:`MemoryTracker`.

    Args:
        tracker: The tracker that sees the work; its counts are the device's.
        capacity: Bytes the user says the device has (there is no way to ask a CPU); None if unknown.
    """

    def __init__(self, tracker: MemoryTracker, capacity: int | None = None) -> None:
        self.tracker = tracker
        self._capacity = capacity

    def capacity(self) -> int | None:
        return self._capacity

    def allocated(self) -> int:
        return self.tracker.current

    def reserved(self) -> int:
        return self.tracker.current  # no caching allocator to account for

    def peak(self) -> int:
        return self.tracker.peak

    def reset_peak(self) -> None:
        self.tracker.reset_peak()

    def empty_cache(self) -> None:
        """Nothing is cached outside live tensors."""


def device_memory(
    device: torch.device | str, *, tracker: MemoryTracker | None = None, capacity: int | str | None = None
) -> DeviceMemory:
    """The :class:`DeviceMemory` for ``device``.

    CUDA devices read the allocator (``capacity`` overrides what the device reports, e.g. to leave room
    for another process); other devices need a ``tracker`` and know only the capacity they are given.
    ``capacity`` is bytes (an int, or a string such as ``"6GiB"``, read by
    :func:`~lightning_memopt.memory.units.parse_bytes`).

    Raises:
        ValueError: a ``capacity`` that is not a positive byte size, or no ``tracker`` off CUDA.
    """
    if capacity is not None:
        capacity = parse_bytes(capacity, name="capacity")
    device = torch.device(device)
    if device.type == "cuda":
        return CudaMemory(device, capacity)
    if tracker is None:
        raise ValueError(f"measuring memory on a {device.type!r} device needs a MemoryTracker; pass tracker=")
    return TrackedMemory(tracker, capacity)
