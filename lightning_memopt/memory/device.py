"""Device queries: the only module of the package that calls ``torch.cuda``.

Everything else asks :func:`device_memory` for a :class:`DeviceMemory` and reads the same six numbers,
so the logic above it runs unchanged on CPU and is tested on CPU with a faked ``torch.cuda``. The
overlapped activation offload (``checkpointing/offload.py``) gets its streams, events and pinned host
memory from the small functions at the end of this module, for the same reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from lightning_memopt.memory.tracker import MemoryTracker
from lightning_memopt.memory.units import parse_bytes

__all__ = [
    "DeviceMemory",
    "is_out_of_memory",
    "CudaMemory",
    "TrackedMemory",
    "device_memory",
    "cuda_available",
    "indexed",
    "new_stream",
    "current_stream",
    "use_stream",
    "new_event",
    "synchronize",
    "pinned_empty",
    "measure_transfer_rate",
    "measure_matmul_rate",
    "memory_of",
    "cuda_rng_states",
    "set_cuda_rng_states",
]


class DeviceMemory(Protocol):
    """Five numbers about one device's memory, in bytes, a count of its allocator's retries, and a way to
    release its cache."""

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

    def alloc_retries(self) -> int | None:
        """How many times the caching allocator freed its whole cache and retried an allocation, since the
        process started (cumulative); None where there is no caching allocator, hence no such counter."""


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

    def alloc_retries(self) -> int:
        # ``num_alloc_retries`` counts the allocations that failed, made the allocator synchronize and free
        # every unused cached block, and were tried again (whether the retry then fit or ran out of memory).
        # An allocator that never retried may not report the key at all.
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))


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

    def alloc_retries(self) -> None:
        """None: no caching allocator, so nothing is ever freed and retried (see :class:`DeviceMemory`)."""
        return None


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


# Streams, events and pinned host memory, for the overlapped offload. Each is one torch call, kept here
# so that tests replace ``torch.cuda`` (and ``pinned_empty``, which a CPU-only torch refuses) with fakes.


def cuda_available() -> bool:
    """Whether a CUDA device can be used."""
    return bool(torch.cuda.is_available())


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index: ``cuda`` is the current CUDA device (``cuda:0`` unless ``set_device``
    chose another), so that ``cuda`` and ``cuda:0`` name one device; other devices unchanged."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def new_stream(device: torch.device) -> Any:
    """A new CUDA stream on ``device`` (a side stream for copies)."""
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> Any:
    """The stream that compute on ``device`` runs on now."""
    return torch.cuda.current_stream(device)


def use_stream(stream: Any) -> contextlib.AbstractContextManager:
    """A context in which kernels and copies go to ``stream``."""
    return torch.cuda.stream(stream)


def new_event(*, timing: bool = False) -> Any:
    """A CUDA event (with timing enabled when ``timing``, for :func:`measure_transfer_rate`)."""
    return torch.cuda.Event(enable_timing=timing)


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device``."""
    torch.cuda.synchronize(device)


def pinned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory (uint8), the target of asynchronous device-to-host copies.

    Pinning is slow and synchronizes the device, so callers allocate once and reuse (a pool), never per
    copy.
    """
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@contextlib.contextmanager
def _timed(device: torch.device, elapsed: list[float]) -> Iterator[None]:
    """Append the seconds the work queued inside the context took on ``device``'s current stream."""
    start, end = new_event(timing=True), new_event(timing=True)
    start.record(current_stream(device))
    yield
    end.record(current_stream(device))
    end.synchronize()
    elapsed.append(start.elapsed_time(end) / 1000.0)  # elapsed_time is in milliseconds


def measure_transfer_rate(device: torch.device | str, *, nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Bytes per second that cross between pinned host memory and ``device``, one way on average.

    Times ``repeats`` round trips (host to device, device to host) of ``nbytes`` after one warm-up, and
    returns ``2 * nbytes`` over the fastest round trip: the rate at which an offloaded byte goes out and
    comes back, which is what the planner's cost charges.

    Raises:
        ValueError: a device that is not CUDA, or ``nbytes``/``repeats`` below 1.
    """
    device = _timing_device("measure_transfer_rate times copies", device, nbytes=nbytes, repeats=repeats)
    return _round_trip_rate(
        pinned_empty(nbytes), torch.empty(nbytes, dtype=torch.uint8, device=device), repeats
    )


def _timing_device(what: str, device: torch.device | str, **counts: int) -> torch.device:
    """``device`` as a CUDA ``torch.device``, after checking it is one and that every count is >= 1."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{what} on a CUDA device, got {str(device)!r}")
    if any(n < 1 for n in counts.values()):
        given = ", ".join(f"{k}={v!r}" for k, v in counts.items())
        raise ValueError(f"{' and '.join(counts)} must be >= 1, got {given}")
    return device


def _round_trip_rate(host: torch.Tensor, on_device: torch.Tensor, repeats: int) -> float:
    device = on_device.device
    on_device.copy_(host, non_blocking=True)  # warm-up: first-use costs are not the link's
    host.copy_(on_device, non_blocking=True)
    synchronize(device)
    elapsed: list[float] = []
    for _ in range(repeats):
        with _timed(device, elapsed):
            on_device.copy_(host, non_blocking=True)
            host.copy_(on_device, non_blocking=True)
    return 2 * host.numel() * host.element_size() / min(elapsed)


def measure_matmul_rate(
    device: torch.device | str, *, size: int = 4096, dtype: torch.dtype = torch.bfloat16, repeats: int = 3
) -> float:
    """FLOPs per second of a ``size`` x ``size`` matmul in ``dtype`` on ``device`` (fastest of ``repeats``).

    Raises:
        ValueError: a device that is not CUDA, or ``size``/``repeats`` below 1.
    """
    device = _timing_device("measure_matmul_rate times a matmul", device, size=size, repeats=repeats)
    return _matmul_rate(torch.randn(size, size, device=device).to(dtype), repeats)


def _matmul_rate(a: torch.Tensor, repeats: int) -> float:
    a @ a  # warm-up: kernel selection
    synchronize(a.device)
    elapsed: list[float] = []
    for _ in range(repeats):
        with _timed(a.device, elapsed):
            a @ a
    return 2 * a.shape[0] ** 3 / min(elapsed)


# Messages of allocators that raise a plain RuntimeError (older torch, the CPU allocator, cuDNN/cuBLAS
# workspaces, ROCm, MPS, XPU), matched case-insensitively. Specific on purpose: a user's own
# "out of memory" text in an unrelated error must not start a retry, so bare "out of memory" alone
# counts only with a device word before it.
_MESSAGES = (
    "cuda out of memory",
    "hip out of memory",
    "xpu out of memory",
    "mps backend out of memory",
    "defaultcpuallocator: can't allocate memory",
    "defaultcpuallocator: not enough memory",
    "cudnn_status_alloc_failed",
    "cublas_status_alloc_failed",
    "cuda error: out of memory",
)


def is_out_of_memory(error: BaseException) -> bool:
    """True if ``error`` is an accelerator's or the CPU allocator's out-of-memory error; never for any other.

    Example::

        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_out_of_memory(RuntimeError("shape mismatch"))
        False
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if type(error) is not RuntimeError:  # subclasses (NotImplementedError, ...) are never allocator errors
        return False
    text = str(error).lower()
    return any(message in text for message in _MESSAGES)


def memory_of(device: torch.device, tracker: MemoryTracker | None = None) -> DeviceMemory | None:
    """What measures ``device``: its allocator (CUDA), else ``tracker``'s live tensors, else None."""
    if device.type == "cuda":
        return device_memory(device)
    return None if tracker is None else device_memory(device, tracker=tracker)


def cuda_rng_states() -> list[torch.Tensor] | None:
    """Every CUDA device's RNG state, or None where CUDA is not in use (nothing to save)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_rng_state_all()
    return None


def set_cuda_rng_states(states: list[torch.Tensor]) -> None:
    torch.cuda.set_rng_state_all(states)
