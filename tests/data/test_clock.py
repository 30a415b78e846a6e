import types

import pytest
import torch

from lightning_memopt.data import clock as clock_module
from lightning_memopt.data.clock import CudaClock, HostClock, step_clock


class FakeEvent:
    """Stands in for torch.cuda.Event: records the fake device time of the stream it is recorded on."""

    def __init__(self, cuda, enable_timing=False):
        assert enable_timing
        self.cuda, self.time, self.synced = cuda, None, False

    def record(self, stream):
        self.cuda.calls.append(("record", stream))
        self.time = self.cuda.device_ms

    def synchronize(self):
        self.cuda.calls.append(("synchronize",))
        self.synced = True

    def elapsed_time(self, end):
        assert end.synced, "elapsed_time read before the end event was synchronized"
        return end.time - self.time


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = types.SimpleNamespace(calls=[], device_ms=0.0)
    fake.Event = lambda enable_timing=False: FakeEvent(fake, enable_timing)
    fake.current_stream = lambda device: f"stream of {device}"
    monkeypatch.setattr(clock_module.torch, "cuda", fake)
    return fake


def test_cpu_gets_the_host_clock():
    clock = step_clock("cpu")
    assert isinstance(clock, HostClock)
    a = clock.mark()
    b = clock.mark()
    clock.settle(b)
    assert clock.seconds(a, b) >= 0.0


def test_cuda_records_events_and_synchronizes_only_when_settled(fake_cuda):
    clock = step_clock("cuda:1")
    assert isinstance(clock, CudaClock)
    start = clock.mark()
    fake_cuda.device_ms = 250.0
    end = clock.mark()
    assert fake_cuda.calls == [("record", "stream of cuda:1")] * 2  # no synchronization per mark
    clock.settle(end)
    assert fake_cuda.calls[-1] == ("synchronize",)
    assert clock.seconds(start, end) == 0.25
    assert torch.device("cuda:1") == clock.device
