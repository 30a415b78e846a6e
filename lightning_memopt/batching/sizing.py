"""Find the largest micro-batch that fits in memory, in a handful of probe steps.

A probe is one training micro-step at a given size that reports its peak bytes (or runs out of
memory). Searching by OOM alone, as Lightning's ``BatchSizeFinder`` does (double until it fails, then
bisect), spends tens of steps and only finds powers of two unless it bisects long. Peak memory, though, is
a smooth function of the micro-batch size: a fixed part (parameters, gradients, optimizer state,
workspaces) plus a per-sample part (activations, inputs), often bending upwards (activations that grow
faster than the batch, a peak that moves from the optimizer step to backward as the batch grows). The
search fits that curve to the probes and predicts the largest size under the budget: a line through two
points, a parabola through three when the line's prediction missed, and, once a probe measured a peak
over the budget, the chord and parabola between the sizes that bracket the answer. Because the curve is
convex, the line through the two largest fitting sizes bounds the answer from above and the chord across
the bracket bounds it from below. Long extrapolations go through stepping stones, a probe that runs out
of memory is followed by a back-off and then bisection, and bisection takes over whenever it is sure to
end within 2.5%. The search always ends on a size that was probed and fitted.

The rules, in order (:func:`find_micro_batch_size`): probe ``start``; from one measured point, jump to
the largest size that surely fits if peak memory is proportional to size (or double, whichever is
larger). From two fitting points, fit the line ``fixed + per_sample * size`` through the two largest; no
larger size than its prediction fits a convex curve. When the newest point is off the line through the
two before it, the curve bends: fit the parabola through the three largest and probe 2% short of its
prediction; when the line held, probe the line's prediction itself; when the newest point is the first
off a line that three points had confirmed (a kink: the peak moved to a steeper phase), probe 60% of the
way to the prediction, which measures the new slope. When the prediction is at least 90% of ``max_size``
and the line does not rule ``max_size`` out, probe ``max_size`` (and, if it fails, the prediction). A
prediction more than 4 times the largest fitting size is approached through a stepping stone (the
geometric mean of the two, but at least a sixth of the prediction): small batches often peak in a phase
that grows more slowly than the activations of large ones. A probe measured over the budget (between
``capacity * (1 - headroom)`` and ``capacity``) brackets the answer with a peak: the next probe is the
parabola's crossing through the two brackets and the nearest third point, kept between the chord's
crossing (which fits) and the line's bound; the last probe takes the chord's. A probe that runs out of
memory is followed by one 80% of the way back to the largest fitting size, then by bisection, or by
bisection at once when it is sure to end on the answer or within 2.5% of it. The search stops when the
largest fitting size is known exactly, when the line rules out every larger size, or after
``max_probes`` probes. Sizes are any integers in ``[min_size, max_size]``. On the 4,500 random curves of
``benchmarks/batching.py`` (affine, convex, strongly convex and kinked), 6 probes reach 97% of the true
maximum on 4,392, every affine one exactly; 107 of the 108 misses are kinked curves, 70 of them with the
steeper phase starting past the second-largest size that fitted, so that at most one probe saw it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from lightning_memopt._checks import check_positive_int
from lightning_memopt._compat import BatchNormBase
from lightning_memopt.batching.oom import is_out_of_memory
from lightning_memopt.memory.budget import check_headroom, usable_bytes
from lightning_memopt.memory.units import parse_bytes

__all__ = ["MemoryModel", "NoSizeFits", "SizingResult", "find_micro_batch_size", "smallest_micro_batch"]

# Peaks are whole bytes: a line through two measured peaks predicts a third within a few bytes of rounding.
_ROUNDING = 2
# An extrapolation more than this many times the largest fitting size is not trusted in one jump: the
# points it rests on are small batches, whose peak is often dominated by a phase (the optimizer step,
# gradients) that grows more slowly with the batch than the activations do at larger sizes. The next
# probe is then a stepping stone, the geometric mean of here and there, but at least a sixth of the way
# there (the steeper phase is rarely more than six times steeper).
_MAX_JUMP = 4
_MIN_STONE = 1 / 6
# An extrapolation along a curve that bends stops short of the prediction by this fraction of the way
# there, rounded down to whole samples (a probe that fits tells more than one that runs out of memory);
# along a line that the newest point confirmed, it goes all the way.
_SHORT_BY = 0.02
# When the newest point is the first off a line that three points had confirmed, a kink has just begun
# (the peak moved to a steeper phase): every model through the points so far underestimates the new
# slope, so the next probe goes only this fraction of the way to the estimate, and measures that slope.
_AFTER_KINK = 0.6
# When the estimate is within this fraction of the whole batch and nothing rules the whole batch out,
# probe the whole batch.
_WHOLE = 0.9
# After a probe ran out of memory, the next one goes this fraction of the way from the largest size known
# to fit towards it: first 0.8 (predictions usually overshoot by less than 20%), then bisection.
_BACKOFF = (0.8, 0.5)
# Bisection is used instead whenever it is sure to end within this ratio of the true maximum (or on it).
_BISECT_WITHIN = 0.975


class NoSizeFits(RuntimeError):
    """No probed micro-batch size fitted the budget (a ``RuntimeError`` subclass, so callers can tell it
    from an error raised inside a probe)."""


def smallest_micro_batch(module: nn.Module, *, training: bool = True) -> int:
    """The smallest micro-batch ``module`` can train on: 2 with BatchNorm layers in training mode, else 1.

    BatchNorm normalizes over the micro-batch: with one sample its statistics are those of one sample
    (and torch refuses outright when there is one value per channel). Evaluation uses running statistics.
    """
    if training and any(isinstance(m, BatchNormBase) and m.training for m in module.modules()):
        return 2
    return 1


@dataclass(frozen=True)
class MemoryModel:
    """Peak bytes vs the micro-batch size: ``fixed + per_sample * size + curvature * size**2``."""

    fixed: float
    """Bytes that do not depend on the micro-batch (parameters, gradients, optimizer state, ...)."""
    per_sample: float
    """Bytes each sample adds to the peak (activations, inputs, outputs)."""
    curvature: float = 0.0
    """Bytes that grow with the square of the size (0 for a line): activations that grow faster than the
    batch, or a peak that moves to a steeper phase as the batch grows."""

    @classmethod
    def through(cls, a: tuple[int, int], b: tuple[int, int]) -> MemoryModel:
        """The line through two ``(size, peak)`` points of different sizes."""
        (s1, p1), (s2, p2) = a, b
        per_sample = (p2 - p1) / (s2 - s1)
        return cls(fixed=p1 - per_sample * s1, per_sample=per_sample)

    @classmethod
    def through3(cls, a: tuple[int, int], b: tuple[int, int], c: tuple[int, int]) -> MemoryModel:
        """The parabola through three ``(size, peak)`` points of different sizes."""
        (s1, p1), (s2, p2), (s3, p3) = sorted((a, b, c))
        d12, d23 = (p2 - p1) / (s2 - s1), (p3 - p2) / (s3 - s2)  # the slopes of the two chords
        curvature = (d23 - d12) / (s3 - s1)
        per_sample = d12 - curvature * (s1 + s2)
        return cls(
            fixed=p1 - per_sample * s1 - curvature * s1 * s1, per_sample=per_sample, curvature=curvature
        )

    def predict(self, size: int) -> float:
        """Predicted peak bytes at ``size``."""
        return self.fixed + self.per_sample * size + self.curvature * size * size

    def largest_fitting(self, budget: float) -> float:
        """The largest size whose predicted peak is at most ``budget``, on the rising side of the model
        (``inf`` when peaks do not grow, ``-inf`` when no size fits)."""
        if self.curvature <= 0:
            if self.per_sample <= 0:
                return math.inf
            return math.floor((budget - self.fixed) / self.per_sample)
        # the larger root of curvature * s**2 + per_sample * s + fixed - budget = 0
        discriminant = self.per_sample**2 + 4 * self.curvature * (budget - self.fixed)
        if discriminant < 0:
            return -math.inf
        root = math.sqrt(discriminant)
        if self.per_sample > 0:  # the same root, without cancelling two large numbers
            return math.floor(2 * (budget - self.fixed) / (self.per_sample + root))
        return math.floor((root - self.per_sample) / (2 * self.curvature))


@dataclass
class SizingResult:
    """What :func:`find_micro_batch_size` found."""

    size: int
    """The largest micro-batch size that was probed and fitted the budget."""
    budget: int
    """``capacity * (1 - headroom)`` in bytes: a probe fits when its peak is at most this."""
    probes: list[tuple[int, int | None]] = field(default_factory=list)
    """Every probe in order, as ``(size, peak bytes)``; the peak is None when the probe ran out of memory."""
    model: MemoryModel | None = None
    """The last model fitted: a line through two measured points near the boundary, or a parabola
    through three (None if fewer than two probes measured a peak)."""

    @property
    def peak(self) -> int:
        """The measured peak bytes of the returned size."""
        return max(p for s, p in self.probes if s == self.size and p is not None)


def find_micro_batch_size(
    probe: Callable[[int], int | None],
    *,
    max_size: int,
    capacity: int | str,
    headroom: float = 0.1,
    min_size: int = 1,
    max_probes: int = 6,
    start: int | None = None,
) -> SizingResult:
    """Find the largest micro-batch size whose peak memory fits ``capacity * (1 - headroom)``.

    The search (the module docstring has its rules and its measured accuracy) fits the memory curve to
    the probes and predicts the largest size under the budget; sizes are any integers in
    ``[min_size, max_size]``.

    Args:
        probe: ``probe(size)`` runs one training micro-step on ``size`` samples and returns its peak
            bytes, or None if it ran out of memory (an out-of-memory error it raises counts as None too;
            any other error propagates).
        max_size: The largest size to consider: the batch size, since a micro-batch never exceeds it.
        capacity: Bytes the device has for this process (int, or a string such as ``"16GiB"``).
        headroom: Fraction of ``capacity`` to keep free, for fragmentation and for batches that need more
            memory than the probed ones (longer sequences). Default 0.1.
        min_size: The smallest size to consider. Default 1 (use 2 with BatchNorm in training mode).
        max_probes: At most this many probes. Default 6.
        start: The size of the first probe. Default ``min_size`` (the probe most likely to fit); pass
            ``max_size`` to try the whole batch first, which costs one probe when it fits.

    Returns:
        A :class:`SizingResult`; ``result.size`` was probed and its peak fitted the budget.

    Raises:
        ValueError: If an argument is out of range, or ``probe`` returns something other than a
            positive int or None.
        NoSizeFits: If even ``min_size`` does not fit the budget, or ``max_probes`` ran out before
            any probe fitted (a ``RuntimeError``).

    Example::

        >>> peak = lambda size: 1000 + 10 * size  # bytes; a device of 2000 bytes fits 100 samples
        >>> result = find_micro_batch_size(
        ...     lambda s: peak(s) if peak(s) <= 2000 else None, max_size=512, capacity=2000, headroom=0.0
        ... )
        >>> result.size, result.probes
        (100, [(1, 1010), (2, 1020), (16, 1160), (40, 1400), (100, 2000)])
    """
    capacity, headroom, start = _check_search(max_size, min_size, max_probes, capacity, headroom, start)
    budget = usable_bytes(capacity, headroom, None, name="capacity")  # the package's one rule
    probes = _Probes(probe, budget)
    model: MemoryModel | None = None
    size: int | None = start
    while size is not None and len(probes.log) < max_probes:
        probes.run(size)
        if not probes.good():
            if min_size in probes.peaks:
                peak = probes.peaks[min_size]
                raise NoSizeFits(
                    f"even min_size={min_size} does not fit: its probe "
                    + ("ran out of memory" if peak is None else f"peaked at {peak} bytes")
                    + f", over the budget of {budget} bytes (capacity {capacity}, headroom {headroom}); "
                    "free memory (activation checkpointing, a smaller model) or raise capacity"
                )
            size = min_size  # the first probe was too large: start again from the bottom
            continue
        fitted, size = _next_size(probes.peaks, budget, max_size, max_probes - len(probes.log))
        model = fitted or model
    if not probes.good():  # max_probes ran out before anything fitted
        raise NoSizeFits(
            f"no probed size fitted the budget of {budget} bytes within max_probes={max_probes} "
            f"(probes: {probes.log}); raise max_probes or free memory"
        )
    return SizingResult(size=max(probes.good()), budget=budget, probes=probes.log, model=model)


def _check_search(
    max_size: int, min_size: int, max_probes: int, capacity: int | str, headroom: float, start: int | None
) -> tuple[int, float, int]:
    """:func:`find_micro_batch_size`'s arguments checked: ``capacity`` in bytes, ``headroom``, ``start``."""
    for name, value in (("max_size", max_size), ("min_size", min_size), ("max_probes", max_probes)):
        check_positive_int(name, value)
    if min_size > max_size:
        raise ValueError(f"min_size ({min_size}) must be at most max_size ({max_size}); lower min_size")
    capacity, headroom = parse_bytes(capacity, name="capacity"), check_headroom(headroom)
    start = min_size if start is None else start
    if isinstance(start, bool) or not isinstance(start, int) or not min_size <= start <= max_size:
        raise ValueError(
            f"start must be an int in [min_size, max_size] = [{min_size}, {max_size}], got {start!r}"
        )
    return capacity, headroom, start


class _Probes:
    """The probes of one search, in order, and their peaks."""

    def __init__(self, probe: Callable[[int], int | None], budget: int) -> None:
        self.probe, self.budget = probe, budget
        self.log: list[tuple[int, int | None]] = []
        self.peaks: dict[int, int | None] = {}

    def run(self, size: int) -> None:
        try:
            peak = self.probe(size)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            peak = None
        if peak is not None and (isinstance(peak, bool) or not isinstance(peak, int) or peak <= 0):
            raise ValueError(f"probe({size}) must return peak bytes as a positive int or None, got {peak!r}")
        self.log.append((size, peak))
        self.peaks[size] = peak

    def good(self) -> list[int]:
        """The probed sizes whose peak fitted the budget."""
        return [s for s, p in self.peaks.items() if p is not None and p <= self.budget]


def _next_size(
    peaks: dict[int, int | None], budget: int, max_size: int, left: int
) -> tuple[MemoryModel | None, int | None]:
    """The model fitted to the probes so far (in probe order) and the next size to probe (None: stop)."""
    good = sorted(s for s, p in peaks.items() if p is not None and p <= budget)
    bad = sorted(s for s in peaks if s not in good)
    lo = good[-1]  # the largest size known to fit
    hi = bad[0] if bad else max_size + 1  # the smallest size known not to
    if lo == max_size or hi - lo <= 1:
        return None, None  # the answer is known exactly
    point = {s: (s, p) for s, p in peaks.items()}

    # Memory curves are convex (activations that grow faster than the batch, a peak that moves to a
    # steeper phase as the batch grows): past the two largest fitting sizes the curve stays above the
    # line through them, so no size beyond that line's crossing of the budget fits.
    upper = hi - 1
    model: MemoryModel | None = None
    if len(good) >= 2:
        model = MemoryModel.through(point[good[-2]], point[lo])
        upper = min(upper, model.largest_fitting(budget + _ROUNDING))
        if upper <= lo:
            return model, None

    if hi <= max_size and peaks[hi] is not None:
        return _between(peaks, point, good, bad, budget, upper, left)
    return _beyond(peaks, point, good, budget, max_size, upper, model, left)


def _between(
    peaks: dict[int, int | None],
    point: dict[int, tuple[int, int | None]],
    good: list[int],
    bad: list[int],
    budget: int,
    upper: float,
    left: int,
) -> tuple[MemoryModel, int]:
    """The next probe when the answer is bracketed by a measured peak over the budget (``bad[0]``)."""
    lo, hi = good[-1], bad[0]
    # The chord between the two brackets lies above a convex curve, so its crossing fits; a parabola
    # through the brackets and the nearest third point estimates the crossing itself. The last probe
    # takes the chord's, the one sure to fit.
    chord = MemoryModel.through(point[lo], point[hi])
    lower = max(lo, chord.largest_fitting(budget))
    model, estimate = chord, lower
    near = good[-2:-1] + [s for s in bad[1:2] if peaks[s] is not None]
    if near:
        third = min(near, key=lambda s: min(abs(s - lo), abs(s - hi)))
        parabola = MemoryModel.through3(point[third], point[lo], point[hi])
        if parabola.curvature > 0:
            model, estimate = parabola, parabola.largest_fitting(budget)
    estimate = min(max(estimate, lower), upper)
    if left <= 1 or estimate <= lo:
        estimate = max(lower, lo + 1)
    return model, int(min(estimate, hi - 1))


def _beyond(
    peaks: dict[int, int | None],
    point: dict[int, tuple[int, int | None]],
    good: list[int],
    budget: int,
    max_size: int,
    upper: float,
    model: MemoryModel | None,
    left: int,
) -> tuple[MemoryModel | None, int]:
    """The next probe extrapolating from below (the smallest failing size, if any, ran out of memory:
    no peak to use)."""
    lo = good[-1]
    hi = min((s for s in peaks if s not in good), default=max_size + 1)
    straight = kink = False
    if len(good) == 1:
        # If peak memory were proportional to size (no fixed part) this size would just fit; with a
        # fixed part it fits with room to spare. Double at least, to spread the points.
        estimate = max(math.floor(lo * budget / peaks[lo]), 2 * lo)
    else:
        estimate = upper
    if len(good) >= 3:
        g3, g2 = good[-3], good[-2]
        # Straight if the line through the two points before the newest predicted the newest's peak.
        straight = _on_line(point[g3], point[g2], point[lo])
        kink = not straight and len(good) >= 4 and _on_line(point[good[-4]], point[g3], point[g2])
        parabola = MemoryModel.through3(point[g3], point[g2], point[lo])
        if not straight and parabola.curvature > 0:
            model, estimate = parabola, min(parabola.largest_fitting(budget), upper)
    if hi <= max_size:
        estimate = _below_failure(peaks, lo, hi, estimate, max_size, left)
    elif _MAX_JUMP * lo < estimate < math.inf:
        estimate = max(math.isqrt(lo * estimate), math.floor(_MIN_STONE * estimate))  # a stepping stone
    elif len(good) >= 2 and upper >= max_size and estimate >= _WHOLE * max_size:
        estimate = max_size
    elif kink and estimate < math.inf:
        estimate = lo + math.floor(_AFTER_KINK * (estimate - lo))
    elif model is not None and estimate < math.inf and not straight:
        estimate -= math.floor(_SHORT_BY * (estimate - lo))
    return model, int(min(max(estimate, lo + 1), hi - 1, max_size))


def _below_failure(
    peaks: dict[int, int | None], lo: int, hi: int, estimate: float, max_size: int, left: int
) -> float:
    """The next probe between ``lo`` (fits) and ``hi`` (ran out of memory)."""
    if hi - lo <= 2**left or (lo / hi) ** (0.5**left) >= _BISECT_WITHIN:
        # Bisection (by size, or by ratio) ends on the answer, or close enough, with the probes left.
        return (lo + hi) // 2 if hi - lo <= 2**left else math.isqrt(lo * hi)
    # Back off from it (80% of the way after one miss, then bisect), unless the model says less.
    misses = 0  # probes in a row that ran out of memory
    for peak in reversed(peaks.values()):
        if peak is not None:
            break
        misses += 1
    step = _BACKOFF[min(misses, len(_BACKOFF)) - 1] if misses else 0.5
    if hi == max_size and misses == 1 and lo < estimate < hi:
        # The whole batch was tried on an estimate below it and failed: probe the estimate.
        return estimate - math.floor(_SHORT_BY * (estimate - lo))
    return min(estimate, lo + math.floor(step * (hi - lo)))


def _on_line(a: tuple[int, int], b: tuple[int, int], c: tuple[int, int]) -> bool:
    """Whether the line through ``a`` and ``b`` predicts ``c``'s peak (sizes increasing), within the bytes
    of rounding of the two points as the extrapolation carries them, plus 0.1% of the rise."""
    (s1, p1), (s2, _), (s3, p3) = a, b, c
    error = MemoryModel.through(a, b).predict(s3) - p3
    return abs(error) <= _ROUNDING * (1 + 2 * (s3 - s1) / (s2 - s1)) + 1e-3 * (p3 - p1)
