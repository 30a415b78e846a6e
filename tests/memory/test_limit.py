import pytest

from lightning_memopt.memory.limit import StepLimit, check_headroom, check_max_memory, usable_bytes


@pytest.mark.parametrize(
    ("max_memory", "headroom", "capacity", "expected"),
    [
        ("1KiB", 0.25, None, 768),
        (1000, 0.0, 5000, 1000),
        (0.5, 0.0, 4000, 2000),
        (0.5, 0.5, 4000, 1000),
        (None, 0.1, 1000, 900),
        (None, 0.1, None, None),
        (1.0, 0, 123, 123),
    ],
)
def test_usable_bytes(max_memory, headroom, capacity, expected):
    assert usable_bytes(max_memory, headroom, capacity) == expected


def test_fraction_without_capacity():
    with pytest.raises(
        ValueError, match=r"max_memory=0.5 is a fraction .* pass bytes instead, e.g. max_memory='6GiB'"
    ):
        usable_bytes(0.5, 0.1, None)


@pytest.mark.parametrize("value", [0.0, 1.5, float("nan"), float("inf"), -0.2])
def test_bad_fractions(value):
    with pytest.raises(ValueError, match=r"max_memory as a float is a fraction .* must be in \(0, 1\]"):
        check_max_memory(value)


@pytest.mark.parametrize("value", ["abc", True, [1], 0, "1e400GB"])
def test_bad_sizes(value):
    with pytest.raises(ValueError, match="max_memory must be"):
        check_max_memory(value)


@pytest.mark.parametrize("value", ["0.1", None, 1, 1.0, -0.1, True])
def test_bad_headroom(value):
    with pytest.raises(ValueError, match=rf"headroom must be a number in \[0, 1\) .* got {value!r}"):
        check_headroom(value)


def test_step_limit_resolves_the_users_terms():
    assert StepLimit.resolve(4000, 0.5, None) == StepLimit(4000, 0.5, 2000)
    assert StepLimit.resolve(0.5, 0.1, 4000).usable == 1800  # a fraction of the capacity
    assert StepLimit.resolve(None, 0.1, None).usable is None  # no limit known: nothing to plan under
    assert StepLimit.resolve(None, 0.0, 4096).describe() == "the capacity"
    assert StepLimit.resolve("1KiB", 0.0, None).describe() == "max_memory='1KiB'"
    assert StepLimit(4000, 0.5, 2000).needed(2001) == 4003  # the smallest limit leaving 2001 usable
    with pytest.raises(ValueError, match=r"max_memory=0.5 is a fraction of the device's capacity, but"):
        StepLimit.resolve(0.5, 0.1, None)
    with pytest.raises(ValueError, match=r"headroom must be a number in \[0, 1\)"):
        StepLimit.resolve(4000, 1.0, None)
