import types

import pytest
import torch

from lightning_memopt.memory import MemoryTracker
from lightning_memopt.memory import device as device_module
from lightning_memopt.memory.device import CudaMemory, TrackedMemory, device_memory


class FakeCuda(types.SimpleNamespace):
    """Stands in for torch.cuda: the allocator statistics of one device."""

    def __init__(self):
        super().__init__(calls=[], allocated=100, reserved=256, peak=180, total=8 * 2**30)

    def mem_get_info(self, device):
        self.calls.append(("mem_get_info", device))
        return (self.total - self.reserved, self.total)

    def memory_allocated(self, device):
        return self.allocated

    def memory_reserved(self, device):
        return self.reserved

    def max_memory_allocated(self, device):
        return self.peak

    def reset_peak_memory_stats(self, device):
        self.calls.append(("reset", device))
        self.peak = self.allocated

    def empty_cache(self):
        self.calls.append(("empty_cache",))
        self.reserved = self.allocated


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(device_module.torch, "cuda", fake)
    return fake


def test_cuda_branch_reads_allocator(fake_cuda):
    mem = device_memory("cuda:1")
    assert isinstance(mem, CudaMemory)
    assert mem.capacity() == 8 * 2**30
    assert fake_cuda.calls == [("mem_get_info", torch.device("cuda:1"))]
    assert (mem.allocated(), mem.reserved(), mem.peak()) == (100, 256, 180)
    mem.reset_peak()
    assert mem.peak() == 100
    mem.empty_cache()
    assert mem.reserved() == 100


def test_cuda_capacity_override(fake_cuda):
    assert device_memory("cuda", capacity=1000).capacity() == 1000
    assert fake_cuda.calls == []


def test_cpu_branch_uses_tracker():
    tracker = MemoryTracker()
    mem = device_memory("cpu", tracker=tracker, capacity=10**6)
    assert isinstance(mem, TrackedMemory)
    with tracker:
        x = torch.ones(100)
        assert mem.allocated() == 400 and mem.peak() == 400
        del x
        mem.reset_peak()
        assert mem.peak() == 0
    assert mem.capacity() == 10**6
    assert device_memory("cpu", tracker=tracker).capacity() is None


def test_cpu_without_tracker_is_an_error():
    with pytest.raises(ValueError, match="'cpu' device needs a MemoryTracker"):
        device_memory("cpu")


def test_capacity_is_a_byte_size():
    tracker = MemoryTracker()
    assert device_memory("cpu", tracker=tracker, capacity="1KiB").capacity() == 1024
    with pytest.raises(ValueError, match=r"capacity must be positive, got 0; pass an int number of bytes"):
        device_memory("cpu", tracker=tracker, capacity=0)
    with pytest.raises(ValueError, match=r"capacity must be a byte size, got True"):
        device_memory("cuda", capacity=True)
    with pytest.raises(ValueError, match=r"capacity must be a byte size, got 1.5 \(float\)"):
        device_memory("cpu", tracker=tracker, capacity=1.5)
