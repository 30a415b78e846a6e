"""The stream, event, pinned-memory, allocator-retry and timed-copy functions of memory/device.py, against a
faked torch.cuda (and, marked ``cuda``, on a real device)."""

import pytest
import torch

from lightning_memopt.memory import MemoryTracker, device
from tests.memory.fake_cuda import install


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch)


def test_streams_and_events_are_torch_cuda_calls(fake):
    side = device.new_stream(torch.device("cuda"))
    assert device.current_stream(torch.device("cuda")) is fake.compute
    with device.use_stream(side):
        assert device.current_stream(torch.device("cuda")) is side
        event = device.new_event()
        event.record(side)
    assert device.current_stream(torch.device("cuda")) is fake.compute
    assert not event.timing and device.new_event(timing=True).timing
    device.synchronize(torch.device("cuda"))
    assert device.cuda_available()
    assert fake.log == [("record", event.name, side.name), ("synchronize_device",)]


def test_alloc_retries_reads_the_allocator_counter(fake):
    memory = device.device_memory("cuda:0")
    assert memory.alloc_retries() == 0
    fake.alloc_retries = 7
    assert memory.alloc_retries() == 7
    fake.alloc_retries = None  # an allocator that reports no such key has never retried
    assert memory.alloc_retries() == 0


def test_tracked_memory_has_no_retry_counter():
    assert device.device_memory("cpu", tracker=MemoryTracker()).alloc_retries() is None


def test_indexed_names_the_current_cuda_device(fake):
    assert device.indexed("cuda") == torch.device("cuda:0")
    assert device.indexed("cuda:1") == torch.device("cuda:1")
    assert device.indexed("cpu") == torch.device("cpu")


def test_round_trip_rate_is_bytes_both_ways_over_fastest_round_trip(fake):
    fake.elapsed_ms = [4.0, 2.0, 3.0]
    host = torch.arange(250, dtype=torch.int32)
    on_device = torch.zeros(250, dtype=torch.int32)
    rate = device._round_trip_rate(host, on_device, repeats=3)
    assert rate == 2 * 1000 / 0.002
    assert torch.equal(on_device, torch.arange(250, dtype=torch.int32))
    # one device-wide wait after the warm-up, then per round trip: start and end recorded, end waited on
    assert fake.log[0] == ("synchronize_device",)
    assert len(fake.entries("record")) == 6 and len(fake.entries("synchronize")) == 3
    assert fake.elapsed_ms == []


def test_matmul_rate_counts_two_flops_per_multiply_add(fake):
    fake.elapsed_ms = [1.0, 0.5]
    assert device._matmul_rate(torch.ones(8, 8), repeats=2) == 2 * 8**3 / 0.0005


@pytest.mark.parametrize("measure", [device.measure_transfer_rate, device.measure_matmul_rate])
def test_measuring_off_cuda_is_an_error(measure):
    with pytest.raises(ValueError, match="on a CUDA device, got 'cpu'"):
        measure("cpu")


def test_measuring_needs_positive_sizes():
    with pytest.raises(ValueError, match="nbytes and repeats must be >= 1, got nbytes=0"):
        device.measure_transfer_rate("cuda", nbytes=0)
    with pytest.raises(ValueError, match="size and repeats must be >= 1, got size=4, repeats=0"):
        device.measure_matmul_rate("cuda", size=4, repeats=0)


@pytest.mark.cuda
def test_real_pinned_memory_and_rates():
    host = device.pinned_empty(1024)
    assert host.is_pinned() and host.dtype == torch.uint8 and host.numel() == 1024
    # PCIe 3 x16 moves ~12 GB/s, NVLink-C2C ~450 GB/s; anything outside 1-1000 GB/s is a timing bug
    assert 1e9 < device.measure_transfer_rate("cuda", nbytes=2**24) < 1e12
    assert device.measure_matmul_rate("cuda", size=2048) > 1e12
