"""A fake ``torch.cuda`` for CPU tests: streams, events and pinned memory that log what they are asked, and
the allocator's retry counter (``FakeCuda.alloc_retries``, read through ``memory_stats``).

CPU tensors play the device's. Every call lands in ``FakeCuda.log`` as a tuple, so tests assert the order
of stream waits, event records and synchronizations; ``copies`` (a dispatch mode) logs every ``copy_``
with the stream current when it ran, so tests assert which stream a copy was queued on.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memopt.checkpointing import offload
from lightning_memopt.memory import device as device_module

_REAL_CUDA = torch.cuda


class FakeEvent:
    def __init__(self, cuda: FakeCuda, enable_timing: bool = False) -> None:
        self.cuda = cuda
        self.name = f"e{next(cuda.ids)}"
        self.timing = enable_timing
        self.done = False
        self.stream: FakeStream | None = None

    def __repr__(self) -> str:
        return self.name

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream or self.cuda.current
        self.done = self.cuda.complete_on_record
        self.cuda.log.append(("record", self.name, self.stream.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.cuda.log.append(("synchronize", self.name))
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.timing and end.timing, "elapsed_time needs events created with enable_timing=True"
        return self.cuda.elapsed_ms.pop(0)


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str) -> None:
        self.cuda, self.name = cuda, name

    def __repr__(self) -> str:
        return self.name

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait_event", self.name, event.name))


class FakeCuda:
    """Stands in for ``torch.cuda``: one device, a compute stream and the side streams asked for."""

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.log: list[tuple] = []
        self.complete_on_record = False  # events finish only when synchronized (the slowest device)
        self.elapsed_ms: list[float] = []  # what elapsed_time returns, in order
        self.compute = FakeStream(self, "compute")
        self.current = self.compute
        self.pinned: list[int] = []  # sizes of the pinned allocations, in order
        self.alloc_retries: int | None = 0  # memory_stats()["num_alloc_retries"]; None: the key is absent
        self._streams = itertools.count(1)

    def __getattr__(self, name: str):
        # What the fake does not define (torch's own calls, such as manual_seed's) goes to the real module.
        return getattr(_REAL_CUDA, name)

    def is_available(self) -> bool:
        return True

    def Stream(self, device=None) -> FakeStream:  # noqa: N802 (torch's name)
        return FakeStream(self, f"s{next(self._streams)}")

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802
        return FakeEvent(self, enable_timing)

    def current_stream(self, device=None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def current_device(self) -> int:
        return 0

    def synchronize(self, device=None) -> None:
        self.log.append(("synchronize_device",))

    def memory_stats(self, device=None) -> dict[str, int]:
        return {} if self.alloc_retries is None else {"num_alloc_retries": self.alloc_retries}

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        self.pinned.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def entries(self, kind: str) -> list[tuple]:
        return [e for e in self.log if e[0] == kind]


class CopyLog(TorchDispatchMode):
    """Logs ``("copy", stream, nbytes)`` for every ``copy_``, with the fake stream current at the time."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.cuda.log.append(("copy", self.cuda.current.name, args[0].numel() * args[0].element_size()))
        return func(*args, **(kwargs or {}))


def install(monkeypatch) -> FakeCuda:
    """Replace ``torch.cuda`` and the pinned allocation with a :class:`FakeCuda`; return it."""
    fake = FakeCuda()
    monkeypatch.setattr(device_module.torch, "cuda", fake)
    monkeypatch.setattr(device_module, "pinned_empty", fake.pinned_empty)
    monkeypatch.setattr(offload, "pinned_empty", fake.pinned_empty)  # imported by name there
    return fake
