"""MicroBatchSizes without a Trainer: halving, the BatchNorm floor, growing back, never to a size that failed."""

import doctest

import pytest

from lightning_memopt.batching import sizes as sizes_module
from lightning_memopt.batching.errors import MicroBatchOOMError
from lightning_memopt.batching.sizes import MicroBatchSizes


def size_for(sizes: MicroBatchSizes, total: int, width: int | None = None) -> int:
    """The samples per micro-batch of a batch of ``total`` samples of ``width`` tokens (None: as the last)."""
    if width is not None:
        sizes.see(width)
    return sizes.size(total)


def test_back_off_halves_rounding_up_and_remembers_the_start():
    policy = MicroBatchSizes()
    assert size_for(policy, 10) == 10  # None: the whole batch
    policy.failed(10, total=10, floor=1, failure="OOM")
    assert (policy.micro_batch_size, policy.max_micro_batch_size, policy.smallest_failed_size) == (5, 10, 10)
    policy.failed(5, total=10, floor=1, failure="OOM")
    assert (policy.micro_batch_size, policy.smallest_failed_size, policy.oom_retries) == (3, 5, 2)
    assert size_for(policy, 2) == 2  # never more than the batch


def test_back_off_stops_at_one_sample_and_at_the_batchnorm_floor():
    with pytest.raises(MicroBatchOOMError, match="one sample per micro-batch.*\nthe failure\n"):
        MicroBatchSizes(micro_batch_size=1).failed(1, total=8, floor=1, failure="the failure")
    with pytest.raises(MicroBatchOOMError, match="with 2 samples per micro-batch.*BatchNorm"):
        MicroBatchSizes(micro_batch_size=2).failed(2, total=8, floor=2, failure="OOM")
    policy = MicroBatchSizes(micro_batch_size=3)
    policy.failed(3, total=8, floor=2, failure="OOM")
    assert policy.micro_batch_size == 2  # ceil(3 / 2) = 2, the floor itself


class _Fallback:
    """A Recompute that can still recompute once (``acts``), recording why it was asked."""

    def __init__(self, acts: bool) -> None:
        self.acts, self.asked = acts, []

    def fall_back(self, why: str) -> bool:
        self.asked.append(why)
        return self.acts


def test_at_the_floor_a_fallback_that_recomputes_retries_the_same_size():
    policy = MicroBatchSizes(micro_batch_size=1)
    policy.see(640)
    policy.fallback = _Fallback(acts=True)
    policy.failed(1, total=8, floor=1, failure="OOM")  # no error: the same sample again, recomputing
    assert policy._retry == 1 and policy.smallest_failed_size is None and policy.oom_retries == 1
    assert policy.fallback.asked == [
        "1 sample of a batch of 8 ran out of memory with every block kept (640 tokens a sample)"
    ]
    policy.fallback = _Fallback(acts=False)  # already recomputing (or nothing to recompute): the error stands
    with pytest.raises(MicroBatchOOMError, match="one sample per micro-batch"):
        policy.failed(1, total=8, floor=1, failure="OOM")
    above = MicroBatchSizes(micro_batch_size=4)
    above.fallback = _Fallback(acts=True)
    above.failed(4, total=8, floor=1, failure="OOM")  # above the floor: halved, recompute not asked
    assert above.micro_batch_size == 2 and above.fallback.asked == []


def test_grows_after_clean_steps_up_to_the_start_and_below_the_smallest_failure():
    policy = MicroBatchSizes(micro_batch_size=16, grow_after=2)
    policy.failed(16, total=16, floor=1, failure="OOM")  # 8
    policy.failed(8, total=16, floor=1, failure="OOM")  # 4, smallest failure 8
    policy.succeeded(retried=True, total=16)  # the step that backed off counts as stable, not clean
    assert (policy.clean_steps, policy.stable_steps) == (0, 1)
    policy.succeeded(retried=False, total=16)
    assert policy.micro_batch_size == 4
    policy.succeeded(retried=False, total=16)
    assert (policy.micro_batch_size, policy.clean_steps, policy.stable_steps) == (7, 0, 0)  # below 8
    for _ in range(4):
        policy.succeeded(retried=False, total=16)
    assert policy.micro_batch_size == 7  # 8 failed once: never again
    assert policy.last_total == 16


def test_never_grows_without_grow_after_or_from_the_whole_batch():
    policy = MicroBatchSizes(micro_batch_size=4)
    for _ in range(5):
        policy.succeeded(retried=False, total=8)
    assert policy.micro_batch_size == 4 and policy.stable_steps == 5
    whole = MicroBatchSizes(grow_after=1)
    whole.succeeded(retried=False, total=8)
    assert whole.micro_batch_size is None


def test_near_miss_halves_and_records_the_size_without_a_retry():
    policy = MicroBatchSizes(grow_after=1)
    assert policy.near_miss(10, total=10, floor=1) is True
    assert (policy.micro_batch_size, policy.max_micro_batch_size, policy.smallest_failed_size) == (5, 10, 10)
    assert (policy.oom_retries, policy.clean_steps, policy.stable_steps) == (0, 0, 0)
    policy.succeeded(retried=False, total=10)
    assert policy.micro_batch_size == 9  # grows, but below the size that thrashed
    assert policy.near_miss(9, total=10, floor=1) is True
    assert (policy.micro_batch_size, policy.smallest_failed_size, policy.max_micro_batch_size) == (5, 9, 10)


def test_near_miss_at_the_floor_keeps_the_size_and_stops_growth():
    policy = MicroBatchSizes(micro_batch_size=1, grow_after=1)
    assert policy.near_miss(1, total=8, floor=1) is False
    assert (policy.micro_batch_size, policy.smallest_failed_size, policy.oom_retries) == (1, 1, 0)
    policy.succeeded(retried=False, total=8)
    assert policy.micro_batch_size == 1
    batchnorm = MicroBatchSizes(micro_batch_size=3)
    assert batchnorm.near_miss(3, total=8, floor=2) is True and batchnorm.micro_batch_size == 2
    assert batchnorm.near_miss(2, total=8, floor=2) is False and batchnorm.micro_batch_size == 2


def test_near_miss_is_kept_in_tokens():
    policy = MicroBatchSizes(micro_batch_size=8)
    size_for(policy, 8, 32)  # 8 samples of 32 tokens: 256
    assert policy.near_miss(8, total=8, floor=1) is True
    assert (policy.tokens, policy.failed_tokens) == (128, 256)
    assert size_for(policy, 64, 8) == 16  # a batch 4x shorter runs 4x the samples


def halve_eval(size: int, *, hook: str, failure: str | None) -> int:
    sizes = MicroBatchSizes()
    sizes.halve_eval(size, hook=hook, failure=failure)
    return sizes.eval_size


def test_evaluation_halves_without_a_floor():
    assert halve_eval(5, hook="validation_step", failure=None) == 3
    assert halve_eval(2, hook="validation_step", failure=None) == 1
    with pytest.raises(
        MicroBatchOOMError, match="in test_step with one sample per micro-batch.\non another rank"
    ):
        halve_eval(1, hook="test_step", failure=None)


def test_docstring_example_runs():
    assert doctest.testmod(sizes_module).failed == 0
