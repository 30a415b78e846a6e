import doctest
import inspect
import math
import random

import pytest
import torch

from lightning_memopt import AutoAccumulation
from lightning_memopt.batching import size_search as sizing_module
from lightning_memopt.batching.size_search import MemoryModel, SizingResult, find_micro_batch_size
from lightning_memopt.batching.split import largest_micro_batch
from lightning_memopt.memory import MemoryTracker
from tests.batching.curves import random_curves


def _device(peak, capacity):
    """A probe for a simulated device: the peak if it fits in ``capacity``, else out of memory."""
    calls = []

    def probe(size):
        calls.append(size)
        return peak(size) if peak(size) <= capacity else None

    return probe, calls


def _true_max(peak, usable, max_size):
    return max(s for s in range(1, max_size + 1) if peak(s) <= usable)


def _check(result, peak, capacity, headroom, max_size, calls):
    usable = math.floor(capacity * (1 - headroom))
    assert result.usable == usable
    assert result.probes == [(s, peak(s) if peak(s) <= capacity else None) for s in calls]
    assert (result.size, peak(result.size)) in result.probes  # probed, and it did not fail
    assert peak(result.size) <= usable
    assert 1 <= result.size <= max_size
    return result.size / _true_max(peak, usable, max_size)


@pytest.mark.parametrize("headroom", [0.0, 0.1])
@pytest.mark.parametrize(
    ("fixed", "per_sample", "true", "max_size"),
    [
        (1e9, 1e6, 300, 8192),
        (1e6, 1e5, 45, 256),
        (5e9, 1e3, 7000, 8192),
        (2e8, 4e6, 1000, 1024),
        (1e7, 1e7, 3, 64),
    ],
)
def test_affine_curve_exact(fixed, per_sample, true, max_size, headroom):
    def peak(s):
        return int(fixed + per_sample * s)

    capacity = math.ceil(peak(true) / (1 - headroom))
    probe, calls = _device(peak, capacity)
    result = find_micro_batch_size(
        probe, max_size=max_size, capacity=capacity, headroom=headroom, max_probes=6
    )
    assert _check(result, peak, capacity, headroom, max_size, calls) == 1.0
    assert len(result.probes) <= 6
    assert result.model.per_sample == pytest.approx(per_sample, rel=1e-6)


@pytest.mark.parametrize("headroom", [0.0, 0.1])
@pytest.mark.parametrize("bend", [0.02, 0.05])
@pytest.mark.parametrize(("true", "max_size"), [(300, 4096), (60, 256), (1500, 4096), (5000, 8192)])
def test_slightly_convex_curve_within_3_percent(true, max_size, bend, headroom):
    # Activations grow `bend` faster than linear by the true maximum.
    fixed, per_sample = 5e8, 1e6
    curve = bend * per_sample / true

    def peak(s):
        return int(fixed + per_sample * s + curve * s * s)

    capacity = math.ceil(peak(true) / (1 - headroom))
    probe, calls = _device(peak, capacity)
    result = find_micro_batch_size(
        probe, max_size=max_size, capacity=capacity, headroom=headroom, max_probes=6
    )
    assert _check(result, peak, capacity, headroom, max_size, calls) >= 0.97


@pytest.mark.parametrize("headroom", [0.0, 0.1])
@pytest.mark.parametrize("bend", [0.5, 2.0, 5.0])
@pytest.mark.parametrize(("true", "max_size"), [(60, 256), (300, 4096), (1500, 4096), (5000, 8192)])
def test_strongly_convex_curve_within_3_percent(true, max_size, bend, headroom):
    # The quadratic part is `bend` times the per-sample part at the true maximum.
    fixed, per_sample = 5e8, 1e6
    curve = bend * per_sample / true

    def peak(s):
        return int(fixed + per_sample * s + curve * s * s)

    capacity = math.ceil(peak(true) / (1 - headroom))
    probe, calls = _device(peak, capacity)
    result = find_micro_batch_size(probe, max_size=max_size, capacity=capacity, headroom=headroom)
    assert len(result.probes) <= 6  # the default max_probes
    assert _check(result, peak, capacity, headroom, max_size, calls) >= 0.97


def _searched(**search):
    """Each of the 1,500 random curves (seed 0), the sizes the search probed, and its result."""
    for curve in random_curves(1500, seed=0):
        calls = []

        def probe(size, curve=curve, calls=calls):
            calls.append(size)
            return curve.probe(size)

        result = find_micro_batch_size(
            probe, max_size=curve.max_size, capacity=curve.capacity, headroom=curve.headroom, **search
        )
        yield curve, calls, result


def test_random_curve_family_within_3_percent_in_6_probes():
    # 1,500 curves (tests/batching/curves.py): affine, convex, strongly convex (quadratic part up to 5x the
    # per-sample part at the true maximum), kinked (a line that turns 1.5-6x steeper) and kinked convex;
    # true maximum 1 to ~5000, max_size at it or above it, headroom 0 or 0.1. Every search stays within 6
    # probes, never probes a size twice and never returns a size that failed. Every affine, convex and
    # strongly convex curve reaches 97% of its true maximum (affine ones exactly); 41 kinked curves do
    # not. The counts are exact: a change to the search that misses one more curve fails here.
    ratios: dict[str, list[float]] = {}
    total_probes = 0
    for curve, calls, result in _searched(max_probes=6):
        assert result.probes == [(s, curve.probe(s)) for s in calls]
        assert len(calls) <= 6 and len(set(calls)) == len(calls)
        assert (result.size, curve.peak(result.size)) in result.probes
        assert curve.peak(result.size) <= result.usable
        assert 1 <= result.size <= curve.true
        ratios.setdefault(curve.kind, []).append(result.size / curve.true)
        total_probes += len(calls)
    misses = {kind: sum(r < 0.97 for r in values) for kind, values in ratios.items()}
    assert misses == {"affine": 0, "convex": 0, "strongly convex": 0, "kinked": 13, "kinked convex": 28}
    assert all(r == 1.0 for r in ratios["affine"])  # exactly
    assert total_probes == 7316


def _run(peak, capacity, headroom, max_size=1000):
    probe, _ = _device(peak, capacity)
    result = find_micro_batch_size(probe, max_size=max_size, capacity=capacity, headroom=headroom)
    return result.probes, result.size, _true_max(peak, result.usable, max_size)


def test_probe_sequences_of_each_step_of_the_loop():
    # A parabola: from 1, peak proportional to size says 3; the line through (1, 3) predicts 288, more
    # than 3 times 3, so a stepping stone goes first: max(isqrt(3 * 288), 288 // 6) = 48. The parabola
    # through the three probes is the curve itself: 130 exactly; the line through (48, 130) rules out 131.
    probes, size, true = _run(lambda s: 10_000 + 100 * s + s * s, 40_000, 0.0)
    assert probes == [(1, 10_101), (3, 10_309), (48, 17_104), (130, 39_900)] and size == true == 130

    # A kink (the peak moves to a 3x steeper phase past 20 samples), usable 18,000: the parabola through
    # (1, 2, 26) says 68, measured over the usable but under the capacity; the chord from 26 to 68 lies
    # above the curve, and its crossing, 66, is the answer.
    probes, size, true = _run(lambda s: max(10_000 + 50 * s, 8_000 + 150 * s), 20_000, 0.1)
    assert probes == [(1, 10_050), (2, 10_100), (26, 11_900), (68, 18_200), (66, 17_900)]
    assert size == true == 66

    # The same with a 4x steeper phase past 40 and no headroom: the prediction 81 runs out of memory (no
    # peak to draw a chord to), so the next probe bisects; the line through 33 and 57 still mixes the two
    # phases, and the last probe, the parabola's 76, ends at 95% of the true 80.
    probes, size, true = _run(lambda s: max(10_000 + 50 * s, 4_000 + 200 * s), 20_000, 0.0)
    assert probes == [(1, 10_050), (2, 10_100), (33, 11_650), (81, None), (57, 15_400), (76, 19_200)]
    assert (size, true) == (76, 80)


def test_docstring_example():
    assert doctest.testmod(sizing_module).failed == 0


def test_true_maximum_is_one_or_the_whole_batch():
    def peak(s):  # kinked: an optimizer-step phase, then a 4x steeper backward phase
        return max(10_000 + 50 * s, 9_000 + 200 * s)

    for true, max_size in ((1, 64), (64, 64), (1000, 1000), (1000, 1001)):
        for headroom in (0.0, 0.1):
            capacity = math.ceil(peak(true) / (1 - headroom))
            probe, calls = _device(peak, capacity)
            result = find_micro_batch_size(probe, max_size=max_size, capacity=capacity, headroom=headroom)
            assert result.size == true
            assert len(calls) <= 6 and len(set(calls)) == len(calls)


def test_default_max_probes_is_6_in_the_search_and_the_callback():
    default = inspect.signature(find_micro_batch_size).parameters["max_probes"].default
    assert default == AutoAccumulation().max_probes == 6


def test_whole_batch_fits():
    probe, calls = _device(lambda s: 1000 + s, 10**6)
    result = find_micro_batch_size(probe, max_size=32, capacity=10**6)
    assert result.size == 32
    assert calls == [1, 32]  # the stepping stone towards the extrapolated 899 is past the batch
    result = find_micro_batch_size(probe, max_size=32, capacity=10**6, start=32)
    assert result.probes == [(32, 1032)]


def test_oom_at_first_probe_goes_down():
    def peak(s):
        return 10_000 + 100 * s

    probe, calls = _device(peak, peak(40))
    result = find_micro_batch_size(probe, max_size=512, capacity=peak(40), headroom=0.0, start=512)
    assert result.probes[0] == (512, None)
    assert calls[1] == 1  # started again from min_size
    assert result.size == 40
    assert len(result.probes) <= 6


def test_probe_raising_oom_counts_as_none_and_other_errors_propagate():
    def probe(size):
        if size > 10:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return 100 + size

    # The peaks say 10**6 bytes would hold thousands of samples: only bisection between out-of-memory
    # errors finds 10, and that takes more than the default 6 probes.
    result = find_micro_batch_size(probe, max_size=64, capacity=10**6, headroom=0.0, max_probes=8)
    assert result.size == 10
    assert (11, None) in result.probes or any(p is None for _, p in result.probes)

    def broken(size):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        find_micro_batch_size(broken, max_size=64, capacity=10**6)


def test_nothing_fits():
    with pytest.raises(RuntimeError, match=r"even min_size=2 does not fit: its probe ran out of memory"):
        find_micro_batch_size(lambda s: None, max_size=64, capacity="1GiB", min_size=2)
    with pytest.raises(
        RuntimeError,
        match=r"even min_size=1 does not fit: its probe peaked at 950 bytes, over the usable 900",
    ):
        find_micro_batch_size(lambda s: 950, max_size=64, capacity=1000)


def test_max_probes_spent_before_anything_fits():
    with pytest.raises(
        RuntimeError, match=r"no probed size fitted the usable 1000 bytes within max_probes=1"
    ):
        find_micro_batch_size(
            lambda s: None, max_size=64, capacity=1000, headroom=0.0, start=64, max_probes=1
        )


def test_random_curves_never_return_a_failed_size():
    rng = random.Random(0)
    for _ in range(300):
        fixed, per_sample = rng.choice([1e6, 1e9]), rng.choice([1e3, 1e6])
        kink, ratio = rng.randint(1, 500), rng.choice([1.0, 2.0, 3.5])
        max_size, true = rng.choice([64, 1024, 4096]), rng.randint(1, 3000)

        def peak(s, fixed=fixed, per_sample=per_sample, kink=kink, ratio=ratio):
            return int(
                max(fixed + per_sample * s, fixed + per_sample * kink + ratio * per_sample * (s - kink))
            )

        headroom = rng.choice([0.0, 0.1])
        capacity = math.ceil(peak(true) / (1 - headroom))
        if peak(1) > capacity * (1 - headroom):
            continue
        probe, calls = _device(peak, capacity)
        result = find_micro_batch_size(
            probe, max_size=max_size, capacity=capacity, headroom=headroom, max_probes=6
        )
        _check(result, peak, capacity, headroom, max_size, calls)
        assert len(calls) <= 6 and len(set(calls)) == len(calls)  # never probes a size twice


@pytest.fixture(scope="module")
def mlp_peak():
    """Peak live bytes of one real training step of the MLP of ``benchmarks/batching.py`` on n samples."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 2),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    measured = {}

    def peak(n):
        if n not in measured:
            x, y = torch.randn(n, 32), torch.randint(0, 2, (n,))
            with MemoryTracker(model, opt) as tracker:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            measured[n] = tracker.peak
        return measured[n]

    return peak


@pytest.mark.parametrize("headroom", [0.0, 0.1])
@pytest.mark.parametrize("cap", ["300 samples", 2**19, 2**21, 2**23])
def test_real_mlp_measured_with_memory_tracker(mlp_peak, cap, headroom):
    peak = mlp_peak
    # The curve is convex with a kink: small batches peak in the optimizer step, large ones in backward.
    assert peak(2) - peak(1) < (peak(101) - peak(100)) / 2
    capacity = peak(300) if cap == "300 samples" else cap  # the caps of benchmarks/batching.py
    probe, calls = _device(peak, capacity)
    result = find_micro_batch_size(probe, max_size=4096, capacity=capacity, headroom=headroom)
    lo, hi = 0, 4097  # the true maximum, by bisection
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= result.usable else (lo, mid)
    if cap == "300 samples" and headroom == 0.0:
        assert lo == 300
    assert len(result.probes) <= 6
    assert (result.size, peak(result.size)) in result.probes and peak(result.size) <= result.usable
    assert result.size >= 0.97 * lo


def test_memory_model():
    model = MemoryModel.through((2, 1200), (10, 2000))
    assert (model.fixed, model.per_sample, model.curvature) == (1000.0, 100.0, 0.0)
    assert model.predict(5) == 1500.0
    assert model.largest_fitting(1550) == 5
    parabola = MemoryModel.through3((10, 1300), (1, 1012), (5, 1100))  # 1000 + 10 s + 2 s^2, any order
    assert (parabola.fixed, parabola.per_sample, parabola.curvature) == pytest.approx((1000, 10, 2))
    assert parabola.predict(20) == pytest.approx(2000)
    assert (parabola.largest_fitting(2000), parabola.largest_fitting(1999)) == (20, 19)
    assert parabola.largest_fitting(900) == -math.inf  # even size 0 is over the usable
    assert MemoryModel(fixed=5.0, per_sample=0.0).largest_fitting(10) == math.inf
    result = SizingResult(size=3, usable=10, probes=[(3, 7), (4, None)])
    assert result.peak == 7
    probes = [(10, 2000), (1, 1100), (2, 1200), (20, None), (15, 2600)]  # 1000 + 100 s up to 10 fits 2000
    assert MemoryModel.through_largest(probes, 2000) == MemoryModel(fixed=1000.0, per_sample=100.0)
    assert MemoryModel.through_largest(probes[:1] + probes[3:], 2000) is None  # one size fitted


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_size": 0}, "max_size must be a positive int, got 0"),
        ({"min_size": 1.5}, "min_size must be a positive int, got 1.5"),
        ({"max_probes": True}, "max_probes must be a positive int, got True"),
        ({"min_size": 9, "max_size": 8}, r"min_size \(9\) must be at most max_size \(8\)"),
        ({"capacity": "big"}, "capacity must be a byte size, got 'big'"),
        ({"headroom": 1.0}, r"headroom must be a number in \[0, 1\) .*, got 1.0"),
        ({"headroom": -0.1}, r"headroom must be a number in \[0, 1\) .*, got -0.1"),
        ({"start": 100}, r"start must be an int in \[min_size, max_size\] = \[1, 8\], got 100"),
    ],
)
def test_bad_arguments(kwargs, match):
    kwargs = {"max_size": 8, "capacity": 1000, **kwargs}
    with pytest.raises(ValueError, match=match):
        find_micro_batch_size(lambda s: 1, **kwargs)


def test_bad_probe_result():
    with pytest.raises(
        ValueError, match=r"probe\(1\) must return peak bytes as a positive int or None, got 1.5"
    ):
        find_micro_batch_size(lambda s: 1.5, max_size=8, capacity=1000)


def test_fixed_bytes_from_an_earlier_search_predict_the_second_probe():
    """From one size that fits, the line through the fixed bytes and its peak predicts the largest size:
    two probes where the proportional guess takes three; a wrong guess still returns a size probed to fit."""
    peak = lambda size: 1000 + 10 * size  # noqa: E731 - 100 samples fit 2,000 bytes
    search = dict(max_size=512, capacity=2000, headroom=0.0, start=40)
    assert find_micro_batch_size(peak, **search, fixed=1000).probes == [(40, 1400), (100, 2000)]
    assert find_micro_batch_size(peak, **search).probes == [(40, 1400), (80, 1800), (100, 2000)]
    wrong = find_micro_batch_size(peak, **search, fixed=1300)  # too high: 280 predicted, over the limit
    assert wrong.size == 100 and wrong.probes == [(40, 1400), (280, 3800), (100, 2000)]
    # fixed bytes above the peak measured say nothing: the proportional guess
    assert (
        find_micro_batch_size(peak, **search, fixed=1500).probes
        == find_micro_batch_size(peak, **search).probes
    )


def test_split_probes_only_the_sizes_that_run_the_batch_in_fewer_micro_batches():
    """39 samples fit, but a batch of 48 runs as 2 micro-batches of 24 at any size from 24 to 47: the
    search probes 24 (from 12 and the fixed bytes' line, which predicts 39) and stops, where it would go
    on to 39; a start between two such sizes is taken down to the lower (13: 4 micro-batches of 12)."""
    peak = lambda size: 1000 + 10 * size  # noqa: E731
    search = dict(max_size=48, capacity=1390, headroom=0.0, fixed=1000)
    assert find_micro_batch_size(peak, **search, start=12).probes == [(12, 1120), (39, 1390)]
    for start in (12, 13):
        result = find_micro_batch_size(peak, **search, start=start, split=True)
        assert result.probes == [(12, 1120), (24, 1240)] and result.size == 24


def test_split_takes_a_size_one_sample_past_a_guess_from_another_search_s_fixed_bytes():
    """48 samples fit 1,480 bytes exactly. From 12 and fixed bytes a byte low (999, as another way's line
    may measure them), the line crosses the usable bytes at 47.7: the search takes 48, a sample past it,
    and not 24, the size below it; from fixed bytes 11 low (45.2), 24."""
    peak = lambda size: 1000 + 10 * size  # noqa: E731
    search = dict(max_size=48, capacity=1480, headroom=0.0, start=12, split=True)
    assert find_micro_batch_size(peak, **search, fixed=999).probes == [(12, 1120), (48, 1480)]
    assert find_micro_batch_size(peak, **search, fixed=989).probes[:2] == [(12, 1120), (24, 1240)]


def test_split_reaches_a_size_one_sample_past_a_rounded_line():
    """Peaks rounded to whole bytes: the line through 849 and 1,273 crosses the usable bytes at 2,544
    (3 bytes over at 2,545, beyond the 2 bytes of :data:`_ROUNDING`); 2,545, the whole batch, fits. With
    ``split`` the next lower size is half of it (1,273): the rounding carried along the line allows the one
    size that runs the batch whole."""
    peak = lambda size: int(931_042.91 + 2_684.92 * size)  # noqa: E731
    search = dict(max_size=2545, capacity=peak(2545), headroom=0.0, start=849)
    line = MemoryModel.through((849, peak(849)), (1273, peak(1273)))
    assert line.largest_fitting(peak(2545) + 2) == 2544
    result = find_micro_batch_size(peak, **search, split=True)
    assert result.probes == [(849, 3_210_539), (1273, 4_348_946), (2545, 7_764_164)] and result.size == 2545


def test_split_random_curve_family_reaches_the_even_split_of_the_true_maximum():
    # The 1,500 curves of test_random_curve_family_within_3_percent_in_6_probes, searched with split: every
    # probe a size ceil(max_size / n), none twice, at most 6; every affine, convex and strongly convex
    # curve ends at the even split of its true maximum (the micro-batch that runs it), 12 kinked and 14
    # kinked convex curves below it; 6,699 probes in all, where the search over every size takes 7,316.
    misses: dict[str, int] = {}
    total_probes = 0
    for curve, calls, result in _searched(split=True):
        assert len(calls) <= 6 and len(set(calls)) == len(calls)
        assert all(largest_micro_batch(curve.max_size, s) == s for s in calls)
        assert (result.size, curve.peak(result.size)) in result.probes
        assert curve.peak(result.size) <= result.usable
        target = largest_micro_batch(curve.max_size, curve.true)
        assert result.size <= target
        misses[curve.kind] = misses.get(curve.kind, 0) + (result.size < target)
        total_probes += len(calls)
    assert misses == {"affine": 0, "convex": 0, "strongly convex": 0, "kinked": 12, "kinked convex": 14}
    assert total_probes == 6699
