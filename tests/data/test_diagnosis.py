import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from lightning_memopt.data import LoaderSettings, StepTime, StepTimes, batch_cost, cores_per_rank, diagnose
from lightning_memopt.data import diagnosis as diagnosis_module
from tests.data.helpers import CostlyItems, FakeClock


def _times(wait, compute, transfer=0.0, steps=4, max_wait=None):
    times = StepTimes()
    times.add([StepTime(wait, transfer, compute)] * steps)
    if max_wait is not None:
        times.max_wait = max_wait
    return times


def _settings(**kwargs):
    return {f.setting: (f.current, f.suggested) for f in kwargs.pop("diagnosis").fixes}


def test_compute_bound_loop_is_not_data_bound_and_gets_no_fix():
    result = diagnose(_times(0.0625, 1.0), LoaderSettings(), threshold=0.1, cores=2)
    assert result.wait_fraction == 0.0625 / 1.0625
    assert not result.data_bound and result.fixes == ()
    assert result.summary_line() == "data: not data-bound, wait fraction 0.06 over 4 steps"


def test_main_process_loading_asks_for_workers_up_to_the_cores():
    result = diagnose(_times(0.375, 0.125), LoaderSettings(), threshold=0.1, cores=8)
    # one batch costs 375 ms in one process, compute 125 ms: 3 workers keep up
    assert _settings(diagnosis=result) == {"num_workers": (0, 3), "persistent_workers": (False, True)}
    assert result.data_bound and result.wait_fraction == 0.75
    message = result.message()
    assert message.startswith("the training loop is data-bound: 75% of its time goes to feeding input")
    assert "waiting for the next batch 375.0 ms" in message and "compute 125.0 ms" in message
    assert "num_workers=0 -> 3 (one batch costs 375.0 ms to load in one process" in message
    assert "3 workers on the 8 CPU cores of this rank bring the wait fraction to about 0.00" in message
    assert result.summary_line() == (
        "data: data-bound, wait fraction 0.75 over 4 steps; fix: num_workers=3, persistent_workers=True"
    )


def test_too_few_cores_caps_the_workers_and_says_what_remains():
    result = diagnose(_times(0.5, 0.125), LoaderSettings(), threshold=0.1, cores=2)
    assert _settings(diagnosis=result)["num_workers"] == (0, 2)
    # 2 workers deliver a 500 ms batch every 250 ms against 125 ms of compute: half the time waits
    assert "bring the wait fraction to about 0.50" in result.message()
    assert "needs 4 workers but this rank has 2 CPU cores" in result.note


def test_workers_that_cannot_keep_up_are_counted_from_the_loops_pace():
    # 1 worker, step = 125 ms compute + 125 ms wait: the worker needs 250 ms per batch, so 2 keep up
    result = diagnose(
        _times(0.125, 0.125), LoaderSettings(num_workers=1, persistent_workers=True), threshold=0.1, cores=4
    )
    assert _settings(diagnosis=result) == {"num_workers": (1, 2)}


def test_pin_memory_only_on_cuda_and_persistent_only_for_several_epochs():
    settings = LoaderSettings(num_workers=2, persistent_workers=False, start_method="spawn")
    cpu = diagnose(_times(0.25, 0.25), settings, threshold=0.1, cores=2, epochs=1)
    assert "pin_memory" not in _settings(diagnosis=cpu) and "persistent_workers" not in _settings(
        diagnosis=cpu
    )
    cuda = diagnose(
        _times(0.25, 0.25, transfer=0.03125), settings, threshold=0.1, cores=2, device_type="cuda", epochs=3
    )
    assert _settings(diagnosis=cuda)["pin_memory"] == (False, True)
    assert "the copy took 31.2 ms per step" in cuda.message()
    assert _settings(diagnosis=cuda)["persistent_workers"] == (False, True)
    assert "importing everything anew under the 'spawn' start method" in cuda.message()


def test_bursty_waits_with_enough_workers_ask_for_a_deeper_queue():
    settings = LoaderSettings(num_workers=2, persistent_workers=True, prefetch_factor=2)
    result = diagnose(_times(0.0625, 0.25, max_wait=0.25), settings, threshold=0.1, cores=2)
    assert _settings(diagnosis=result) == {"prefetch_factor": (2, 4)}
    assert result.note == ""  # bursts say nothing about the workers' pace
    steady = diagnose(_times(0.0625, 0.25, max_wait=0.125), settings, threshold=0.1, cores=2)
    assert steady.fixes == ()  # 2 workers at 312.5 ms per batch: 3 would keep up, the rank has 2 cores
    assert "needs 3 workers but this rank has 2 CPU cores" in steady.note


def test_settings_are_read_from_a_dataloader():
    loader = DataLoader(
        CostlyItems(),
        batch_size=4,
        num_workers=2,
        pin_memory=True,
        persistent_workers=True,
        prefetch_factor=5,
        multiprocessing_context="spawn",
    )
    assert LoaderSettings.of(loader) == LoaderSettings(2, True, True, 5, "spawn")
    plain = LoaderSettings.of(DataLoader(CostlyItems()))
    assert (plain.num_workers, plain.pin_memory, plain.persistent_workers, plain.prefetch_factor) == (
        0,
        False,
        False,
        None,
    )
    assert LoaderSettings.of([torch.zeros(1)]).num_workers == 0  # any iterable: the defaults


def test_cores_are_shared_by_the_ranks_of_a_node(monkeypatch):
    monkeypatch.setattr(diagnosis_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)
    assert (cores_per_rank(), cores_per_rank(2), cores_per_rank(8)) == (5, 2, 1)


def test_a_measured_batch_cost_decides_the_workers():
    settings = LoaderSettings(num_workers=1, persistent_workers=True)
    # the waits alone would say 1 worker x (125 + 125) ms = 250 ms per batch: 2 workers;
    # measured, one batch costs 375 ms: 3 workers keep up with 125 ms of compute
    result = diagnose(_times(0.125, 0.125), settings, threshold=0.1, cores=8, batch_cost=0.375)
    assert _settings(diagnosis=result) == {"num_workers": (1, 3)}
    enough = diagnose(_times(0.125, 0.125), settings, threshold=0.1, cores=8, batch_cost=0.0625)
    assert enough.data_bound and enough.fixes == ()  # 1 worker keeps up: the waits come from elsewhere


def test_epoch_starts_are_not_bursts_and_get_their_own_note():
    times = StepTimes()
    times.add([StepTime(0.03125, 0.0, 0.25)] * 6 + [StepTime(0.5, 0.0, 0.25, epoch_start=True)] * 2)
    assert (times.epoch_starts, times.epoch_start_wait, times.max_wait) == (2, 1.0, 0.03125)
    settings = LoaderSettings(num_workers=2, persistent_workers=True)
    result = diagnose(times, settings, threshold=0.1, cores=2, batch_cost=0.25)
    assert result.fixes == ()  # 2 workers at 250 ms per batch keep up with 250 ms of compute
    assert result.note == (
        "84% of the input time is the first batch of each epoch (500.0 ms each): workers fill their queue only "
        "when an epoch begins, so fewer, longer epochs amortize it."
    )


def test_batch_cost_loads_one_batch_in_this_process_and_keeps_the_order():
    clock = FakeClock()
    dataset = CostlyItems(clock, cost=1 / 128, n=32)
    loader = DataLoader(dataset, batch_size=4, sampler=RandomSampler(dataset))
    torch.manual_seed(0)
    expected = [b[:, 0].tolist() for b in loader]
    torch.manual_seed(0)
    assert batch_cost(loader, clock=lambda: clock.now) == 4 / 128
    assert [b[:, 0].tolist() for b in loader] == expected
    assert batch_cost(DataLoader(dataset, batch_size=None), clock=lambda: clock.now) == 1 / 128

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    assert batch_cost(DataLoader(Stream())) is None
    assert batch_cost([1, 2]) is None


def test_waits_the_measured_loading_does_not_explain_are_not_data_bound():
    times = _times(0.25, 0.5)  # a third of the time between steps
    result = diagnose(times, LoaderSettings(), threshold=0.1, cores=2, batch_cost=0.0625)  # 8% of the step
    assert result.wait_fraction == 1 / 3 and not result.data_bound and result.outside_loader
    assert result.fixes == ()
    assert result.note.startswith(
        "Loading a batch takes only 62.50 ms of the 250.0 ms wait per step (measured)"
    )
    assert result.summary_line() == (
        "data: not data-bound, wait fraction 0.33 over 4 steps (spent outside the DataLoader)"
    )
    loading = diagnose(times, LoaderSettings(), threshold=0.1, cores=2, batch_cost=0.125)  # 17%: it is
    assert loading.data_bound and _settings(diagnosis=loading)["num_workers"] == (0, 1)
