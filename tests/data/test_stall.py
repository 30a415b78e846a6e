import pytest

from lightning_memopt.data import StallMeter, StepTime, StepTimes
from tests.data.helpers import FakeClock


def _step(meter, clock, *, wait, transfer=0.0, compute):
    clock.advance(wait)
    meter.transfer_start()
    clock.advance(transfer)
    meter.transfer_end()
    meter.step_start()
    clock.advance(compute)
    meter.step_end()


def test_the_first_step_has_no_wait_start_and_is_not_counted():
    clock = FakeClock()
    meter = StallMeter(clock)
    _step(meter, clock, wait=5.0, compute=1.0)  # waited since when? unknown: skipped
    _step(meter, clock, wait=0.25, transfer=0.125, compute=0.5)
    _step(meter, clock, wait=0.75, compute=0.25)
    assert meter.pending == 2
    assert meter.read() == [StepTime(0.25, 0.125, 0.5), StepTime(0.75, 0.0, 0.25)]
    assert clock.settles == 1  # one settle per read: one device sync on CUDA
    assert meter.read() == [] and clock.settles == 1


def test_stop_waiting_drops_the_gap_and_wait_from_now_restarts_it():
    clock = FakeClock()
    meter = StallMeter(clock)
    meter.wait_from_now()
    _step(meter, clock, wait=0.5, compute=1.0)
    meter.stop_waiting()  # validation
    clock.advance(100.0)
    _step(meter, clock, wait=0.0, compute=1.0)  # no wait start: not counted
    clock.advance(7.0)  # e.g. epoch-end hooks
    meter.wait_from_now(epoch_start=True)
    _step(meter, clock, wait=0.25, compute=1.0)
    _step(meter, clock, wait=0.125, compute=1.0)
    times = meter.read()
    assert times == [StepTime(0.5, 0.0, 1.0), StepTime(0.25, 0.0, 1.0, True), StepTime(0.125, 0.0, 1.0)]
    total = StepTimes()
    total.add(times)
    # the epoch start's wait counts in the wait, and apart; the longest wait is of the other steps
    assert (total.wait, total.epoch_starts, total.epoch_start_wait, total.max_wait) == (0.875, 1, 0.25, 0.5)


def test_a_step_without_end_is_dropped():
    clock = FakeClock()
    meter = StallMeter(clock)
    meter.wait_from_now()
    meter.step_start()  # on_train_batch_start returned -1: no on_train_batch_end
    clock.advance(1.0)
    meter.wait_from_now()
    _step(meter, clock, wait=0.5, compute=0.5)
    assert meter.read() == [StepTime(0.5, 0.0, 0.5)]


def test_step_times_sums_fraction_and_means():
    times = StepTimes()
    times.add([StepTime(0.25, 0.25, 1.5), StepTime(0.75, 0.0, 1.25)])
    other = StepTimes()
    other.add([StepTime(2.0, 0.0, 0.0)])
    times.add(other)
    assert (times.steps, times.wait, times.transfer, times.compute, times.max_wait) == (
        3,
        3.0,
        0.25,
        2.75,
        2.0,
    )
    assert times.wait_fraction == pytest.approx(3.25 / 6.0, rel=1e-12)
    assert times.per_step() == StepTime(1.0, 0.25 / 3, 2.75 / 3)
    assert StepTimes().wait_fraction == 0.0
    assert times.as_metrics() == {
        "wait_ms": 1000.0,
        "transfer_ms": 0.25 / 3 * 1e3,
        "compute_ms": 2.75 / 3 * 1e3,
        "wait_fraction": 3.25 / 6.0,
    }
