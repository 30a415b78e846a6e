import random

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from lightning_memopt.data import TuneResult, TuneRow, tune_num_workers, worker_candidates
from tests.data.helpers import CostlyItems


def _scripted_clock(values):
    """A clock returning ``values`` in order: per candidate its start, first batch and end."""
    it = iter(values)
    return lambda: next(it)


def test_times_each_candidate_and_picks_the_fewest_workers_among_the_fastest():
    loader = DataLoader(CostlyItems(n=12), batch_size=4)
    clock = _scripted_clock([0.0, 1.0, 3.0, 10.0, 10.5, 11.0, 20.0, 20.25, 21.04])
    result = tune_num_workers(loader, candidates=[0, 1, 2], batches=3, clock=clock)
    assert [(r.num_workers, r.first_batch, r.total, r.batches) for r in result.rows] == [
        (0, 1.0, 3.0, 3),
        (1, 0.5, 1.0, 3),
        (2, 0.25, pytest.approx(1.04, rel=1e-12), 3),
    ]
    assert result.epoch_batches == 3
    assert result.best == 1  # 2 workers are within 5% of 1 worker: the fewer win
    assert loader.num_workers == 0  # the loader itself is not changed
    assert result.rows[0].per_batch == 1.0
    assert result.table().splitlines() == [
        "num_workers | first batch (s) | per batch (ms) | epoch of 3 batches (s, est.)",
        "          0 |           1.000 |         1000.0 |     3.000",
        "          1 |           0.500 |          250.0 |     1.000  <- fastest",
        "          2 |           0.250 |          395.0 |     1.040",
    ]


def test_a_short_loader_times_the_batches_it_has():
    result = tune_num_workers(DataLoader(CostlyItems(n=8), batch_size=4), candidates=[0], batches=16)
    assert result.rows[0].batches == 2 and result.best == 0


def test_slow_start_fast_pace_wins_over_a_long_epoch():
    # 0 workers: 1 s per batch from the start; 2 workers: 3.5 s to start, then 0.25 s per batch.
    loader = DataLoader(CostlyItems(n=4 * 20), batch_size=4)  # 20 batches per epoch
    clock = _scripted_clock([0.0, 1.0, 4.0, 10.0, 13.5, 14.25])
    result = tune_num_workers(loader, candidates=[0, 2], batches=4, clock=clock)
    assert [row.total for row in result.rows] == [4.0, 4.25]  # over the 4 timed batches 0 workers lead
    assert result.rows[0].epoch(20) == 20.0 and result.rows[1].epoch(20) == 3.5 + 19 * 0.25
    assert result.best == 2  # over an epoch the pace decides


def test_workers_win_a_near_tie_with_the_main_process():
    # 0 workers: 0.95 s; 1 worker: 0.99 s (within 5%): in training only workers load while the model computes
    loader = DataLoader(CostlyItems(n=8), batch_size=4)
    clock = _scripted_clock([0.0, 0.5, 0.95, 10.0, 10.5, 10.99])
    assert tune_num_workers(loader, candidates=[0, 1], batches=2, clock=clock).best == 1
    clock = _scripted_clock([0.0, 0.5, 0.9, 10.0, 10.5, 11.0])  # 1 worker 11% slower: the main process
    assert tune_num_workers(loader, candidates=[0, 1], batches=2, clock=clock).best == 0


def _indices(loader):
    return [batch[:, 0].long().tolist() for batch in loader]


@pytest.mark.parametrize("generator", [False, True])
def test_tuning_never_changes_which_samples_come_or_their_order(generator):
    dataset = CostlyItems(n=24)
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(3) if generator else None)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    torch.manual_seed(0)
    random.seed(0)
    state = sampler.generator.get_state() if generator else None
    expected = _indices(loader)
    after_expected = (torch.rand(1).item(), random.random())

    torch.manual_seed(0)
    random.seed(0)
    if generator:
        sampler.generator.set_state(state)
    tune_num_workers(loader, candidates=[0, 1], batches=3)  # 1 worker: a forked process draws a seed too
    assert _indices(loader) == expected
    assert (torch.rand(1).item(), random.random()) == after_expected


def test_bad_arguments():
    loader = DataLoader(CostlyItems(), batch_size=4)
    with pytest.raises(ValueError, match="batches must be a positive int, got 0"):
        tune_num_workers(loader, batches=0)
    with pytest.raises(ValueError, match=r"candidates must be non-negative ints, got \[0, -1\]"):
        tune_num_workers(loader, candidates=[0, -1])
    with pytest.raises(ValueError, match="candidates must be non-negative ints, got \\[\\]"):
        tune_num_workers(loader, candidates=[])

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ValueError, match="cannot tune a DataLoader over an IterableDataset"):
        tune_num_workers(DataLoader(Stream()))


def test_candidates_are_powers_of_two_up_to_the_cores_and_the_current_value():
    assert worker_candidates(0, 2) == [0, 1, 2]
    assert worker_candidates(3, 8) == [0, 1, 2, 3, 4, 8]
    assert worker_candidates(0, 1) == [0, 1]


def test_result_is_plain_data():
    result = TuneResult((TuneRow(0, 1.0, 2.0, 3),), 10, 0)
    assert result.rows[0].per_batch == 0.5 and result.rows[0].epoch(10) == 5.5
