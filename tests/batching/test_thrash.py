"""ThrashWatch without a Trainer: exact sequences of allocator retries per step, and what each says."""

import doctest

import pytest

from lightning_memopt.batching import thrash as thrash_module
from lightning_memopt.batching.thrash import ThrashWatch


def feed(watch: ThrashWatch, retries, sizes=None) -> list[int]:
    """The indices of the steps after which ``watch`` said the allocator thrashes."""
    sizes = sizes or [None] * len(retries)
    return [i for i, (r, s) in enumerate(zip(retries, sizes)) if watch.step(r, size=s)]


def test_two_steps_with_retries_within_five_detect():
    assert feed(ThrashWatch(), [0, 1, 1]) == [2]
    assert feed(ThrashWatch(), [1, 0, 0, 0, 1]) == [4]  # the first and the fifth: both in the window
    assert feed(ThrashWatch(), [3, 0, 0, 0, 0, 2]) == []  # five steps apart: two isolated re-packs
    assert feed(ThrashWatch(), [5] + [0] * 20) == []  # many retries in one step are still one step


def test_the_window_starts_again_after_a_detection():
    # steps 0 and 1 detect; step 2's retry is alone in the new window until step 5's
    assert feed(ThrashWatch(), [1, 1, 1, 0, 0, 1, 1, 1]) == [1, 5, 7]
    assert feed(ThrashWatch(), [1] * 6) == [1, 3, 5]


def test_a_new_size_starts_a_new_window():
    # the retry at the new size re-packs once; it does not count with the one before at the old size
    assert feed(ThrashWatch(), [1, 0, 1, 0, 1], sizes=[80, 80, 40, 40, 40]) == [4]
    assert feed(ThrashWatch(), [1, 1], sizes=[None, 40]) == []
    watch = ThrashWatch()
    assert feed(watch, [1], sizes=[40]) == []
    watch.reset(40)  # the engine after an out-of-memory retry: the window is empty again
    assert feed(watch, [1, 0], sizes=[40, 40]) == []


def test_a_counter_that_fell_is_a_step_without_retries():
    assert feed(ThrashWatch(), [1, -7, 0, 0, 0, 1]) == []


def test_other_rules():
    assert feed(ThrashWatch(window=3, min_steps=3), [1, 1, 0, 1, 1, 1]) == [5]
    assert feed(ThrashWatch(window=1, min_steps=1), [0, 1, 0, 2]) == [1, 3]


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="window must be an int >= 1.*got 0"):
        ThrashWatch(window=0)
    with pytest.raises(ValueError, match="window must be an int >= 1.*got True"):
        ThrashWatch(window=True)
    with pytest.raises(ValueError, match=r"min_steps must be an int from 1 to window=5.*got 6"):
        ThrashWatch(min_steps=6)
    with pytest.raises(ValueError, match=r"min_steps must be an int from 1 to window=3.*got 0"):
        ThrashWatch(window=3, min_steps=0)
    with pytest.raises(ValueError, match=r"min_steps must be an int.*got 2.0"):
        ThrashWatch(min_steps=2.0)


def test_docstring_example_runs():
    assert doctest.testmod(thrash_module).failed == 0
