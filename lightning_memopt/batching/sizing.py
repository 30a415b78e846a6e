"""Find the largest micro-batch that fits in memory, in a handful of probe steps.

A probe is one training micro-step at a given size that reports its peak bytes (or runs out of
memory). Searching by OOM alone, as Lightning's ``BatchSizeFinder`` does (double until it fails, then
bisect), spends tens of steps and only finds powers of two unless it bisects long. Peak memory, though, is
close to an affine function of the micro-batch size: a fixed part (parameters, gradients, optimizer
state, workspaces) plus a per-sample part (activations, inputs). Two probes fit that line; the line
predicts the largest size under the budget; one more probe checks it. When the curve is not a line
(activations that grow faster than the batch, a peak that moves from forward to backward as the batch
grows), the search keeps the largest size known to fit and the smallest known not to, refits the line
through the two points nearest the boundary, approaches long extrapolations through stepping stones and
stops a little short of them, and backs off (then bisects) when a probe runs out of memory; it always ends
on a size that was probed and fitted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_memopt._checks import check_positive_int
from lightning_memopt.batching.oom import is_out_of_memory
from lightning_memopt.memory.units import parse_bytes

__all__ = ["MemoryModel", "SizingResult", "find_micro_batch_size"]

# After a probe ran out of memory, the next one goes this fraction of the way from the largest size known
# to fit towards it: first 0.8 (predictions usually overshoot by less than 20%), then bisection.
_BACKOFF = (0.8, 0.5)
# An extrapolation more than this many times the largest fitting size is not trusted in one jump: the
# points it rests on are small batches, whose peak is often dominated by a phase (the optimizer step,
# gradients) that grows more slowly with the batch than the activations do at larger sizes.
_MAX_JUMP = 4
# Peaks are whole bytes: a line through two of them predicts a third within a few bytes.
_ROUNDING = 2
_FREE = False
_FREE_RATIO = 0.97
_GUARANTEE = 1 / 0.975
_FLOOR = 6
# An extrapolation (not bracketed by a size measured over the budget) is probed this fraction of the way.
_SHORT_OF = 0.98


@dataclass(frozen=True)
class MemoryModel:
    """Peak bytes as a function of the micro-batch size: ``fixed + per_sample * size + curvature * size**2``."""

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
    """The last line fitted, through the two measured points nearest the boundary (None if fewer than
    two probes measured a peak)."""

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
    max_probes: int = 8,
    start: int | None = None,
) -> SizingResult:
    """Find the largest micro-batch size whose peak memory fits ``capacity * (1 - headroom)``.

    The search: probe ``start``; from one measured point, jump to the largest size that surely fits if
    peak memory is proportional to size (or double, whichever is larger); from two, fit
    ``fixed + per_sample * size`` through the two points nearest the boundary and probe the largest size
    it predicts to fit (95% of the way there when it extrapolates), or, if that is more than 4 times the
    largest size known to fit, the geometric mean of the two (small batches often peak in a phase that
    grows more slowly than the activations of large ones, so a long extrapolation overshoots). A probe that runs out of memory is followed by one
    80% of the way back from it to the largest size known to fit, then by bisection. The search stops
    when the line predicts no larger size, when sizes ``n`` (fits) and ``n + 1`` (does not) are both
    known, or after ``max_probes`` probes. Sizes are any integers in ``[min_size, max_size]``.

    Args:
        probe: ``probe(size)`` runs one training micro-step on ``size`` samples and returns its peak
            bytes, or None if it ran out of memory (an out-of-memory error it raises counts as None too;
            any other error propagates).
        max_size: The largest size to consider: the batch size, since a micro-batch never exceeds it.
        capacity: Bytes the device has for this process (int, or a string such as ``"16GiB"``).
        headroom: Fraction of ``capacity`` to keep free, for fragmentation and for batches that need more
            memory than the probed ones (longer sequences). Default 0.1.
        min_size: The smallest size to consider. Default 1 (use 2 with BatchNorm in training mode).
        max_probes: At most this many probes. Default 8.
        start: The size of the first probe. Default ``min_size`` (the probe most likely to fit); pass
            ``max_size`` to try the whole batch first, which costs one probe when it fits.

    Returns:
        A :class:`SizingResult`; ``result.size`` was probed and its peak fitted the budget.

    Raises:
        ValueError: If an argument is out of range, or ``probe`` returns something other than a
            positive int or None.
        RuntimeError: If even ``min_size`` does not fit the budget.

    Example::

        >>> peak = lambda size: 1000 + 10 * size  # bytes; a device of 2000 bytes fits 100 samples
        >>> result = find_micro_batch_size(
        ...     lambda s: peak(s) if peak(s) <= 2000 else None, max_size=512, capacity=2000, headroom=0.0
        ... )
        >>> result.size, result.probes
        (100, [(1, 1010), (2, 1020), (16, 1160), (40, 1400), (100, 2000)])
    """
    for name, value in (("max_size", max_size), ("min_size", min_size), ("max_probes", max_probes)):
        check_positive_int(name, value)
    if min_size > max_size:
        raise ValueError(f"min_size ({min_size}) must be at most max_size ({max_size}); lower min_size")
    capacity = parse_bytes(capacity, name="capacity")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}; e.g. 0.1 keeps 10% free")
    if start is None:
        start = min_size
    if isinstance(start, bool) or not isinstance(start, int) or not min_size <= start <= max_size:
        raise ValueError(
            f"start must be an int in [min_size, max_size] = [{min_size}, {max_size}], got {start!r}"
        )
    budget = math.floor(capacity * (1 - headroom))

    probes: list[tuple[int, int | None]] = []
    peaks: dict[int, int | None] = {}

    def run(size: int) -> None:
        try:
            peak = probe(size)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            peak = None
        if peak is not None and (isinstance(peak, bool) or not isinstance(peak, int) or peak <= 0):
            raise ValueError(f"probe({size}) must return peak bytes as a positive int or None, got {peak!r}")
        probes.append((size, peak))
        peaks[size] = peak

    def fits(size: int) -> bool:
        return peaks[size] is not None and peaks[size] <= budget

    model: MemoryModel | None = None
    size: int | None = start
    while size is not None and len(probes) < max_probes:
        run(size)
        if not any(fits(s) for s in peaks):
            if min_size in peaks:
                raise RuntimeError(
                    f"even min_size={min_size} does not fit: its probe "
                    + (
                        "ran out of memory"
                        if peaks[min_size] is None
                        else f"peaked at {peaks[min_size]} bytes"
                    )
                    + f", over the budget of {budget} bytes (capacity {capacity}, headroom {headroom}); "
                    "free memory (activation checkpointing, a smaller model) or raise capacity"
                )
            size = min_size  # the first probe was too large: start again from the bottom
            continue
        model, size = _next_size(peaks, budget, max_size, max_probes - len(probes))
    good = [s for s in peaks if fits(s)]
    if not good:  # max_probes ran out before anything fitted
        raise RuntimeError(
            f"no probed size fitted the budget of {budget} bytes within max_probes={max_probes} "
            f"(probes: {probes}); raise max_probes or free memory"
        )
    return SizingResult(size=max(good), budget=budget, probes=probes, model=model)


def _next_size(
    peaks: dict[int, int | None], budget: int, max_size: int, left: int
) -> tuple[MemoryModel | None, int | None]:
    """The model fitted to the probes so far and the next size to probe (None: stop)."""
    good = sorted(s for s, p in peaks.items() if p is not None and p <= budget)
    bad = sorted(s for s in peaks if s not in good)
    lo = good[-1]
    hi = bad[0] if bad else max_size + 1
    if lo == max_size or hi - lo <= 1:
        return None, None  # the answer is known exactly
    point = {s: (s, peaks[s]) for s in peaks}
    upper = hi - 1
    model: MemoryModel | None = None
    if len(good) >= 2:
        # A convex curve stays above the line through two points beyond them: no size past this fits.
        model = MemoryModel.through(point[good[-2]], point[lo])
        upper = min(upper, model.largest_fitting(budget + _ROUNDING))
        if upper <= lo:
            return model, None
    measured = [s for s in bad if peaks[s] is not None]
    if measured and measured[0] == hi:
        # Bracketed by measured peaks. The chord through them lies above a convex curve: its crossing fits.
        chord = MemoryModel.through(point[lo], point[hi])
        lower = max(lo, chord.largest_fitting(budget))
        model, estimate = chord, lower
        near = [s for s in (good[-2] if len(good) >= 2 else None, *measured[1:2]) if s is not None]
        if near:
            third = min(near, key=lambda s: min(abs(s - lo), abs(s - hi)))
            quad = MemoryModel.through3(point[third], point[lo], point[hi])
            if quad.curvature > 0:
                model, estimate = quad, quad.largest_fitting(budget)
        estimate = min(max(estimate, lower), upper)
        if left <= 1 or estimate <= lo:
            estimate = max(lower, lo + 1)
        return model, int(min(estimate, hi - 1))
    # Extrapolating from below (the smallest failing size, if any, ran out of memory: no peak).
    if len(good) == 1:
        # If peak memory were proportional to size (no fixed part) this size would just fit; with a
        # fixed part it fits with room to spare. Double at least, to spread the points.
        estimate = max(math.floor(lo * budget / peaks[lo]), 2 * lo)
    else:
        estimate = upper
        if len(good) >= 3:
            quad = MemoryModel.through3(point[good[-3]], point[good[-2]], point[lo])
            if quad.curvature > 0:
                model, estimate = quad, min(quad.largest_fitting(budget), upper)
    # The curve is straight here if the line through the two fitting sizes before the largest one
    # predicted its peak.
    straight = False
    if len(good) >= 3:
        g3, g2 = good[-3], good[-2]
        error = MemoryModel.through(point[g3], point[g2]).predict(lo) - peaks[lo]
        # rounding of the two points, carried by the extrapolation, plus 0.1% of the rise
        tolerance = _ROUNDING * (1 + 2 * (lo - g3) / (g2 - g3)) + 1e-3 * (peaks[lo] - peaks[g3])
        straight = abs(error) <= tolerance
    if straight or (_FREE and upper * _FREE_RATIO <= lo and upper < math.inf):
        # (or the upper bound is within 3% of the largest fitting size: the result is already close
        # enough for a convex curve, so try the bound itself)
        model, estimate, straight = MemoryModel.through(point[good[-2]], point[lo]), upper, True
    misses = 0
    for p in reversed(peaks.values()):
        if p is not None:
            break
        misses += 1
    if hi <= max_size and (hi - lo <= 2**left or (hi / lo) ** (0.5**left) <= _GUARANTEE):
        # Bisection reaches the exact size, or within 3% of it, with the probes left: it cannot miss.
        estimate = (lo + hi) // 2 if hi - lo <= 2**left else math.isqrt(lo * hi)
    elif hi <= max_size:
        # Below a size that ran out of memory: back off from it (80% of the way after one miss, then
        # bisect), unless the model predicts less.
        step = _BACKOFF[min(misses, len(_BACKOFF)) - 1] if misses else 0.5
        estimate = min(estimate, lo + math.floor(step * (hi - lo)))
    elif _MAX_JUMP * lo < estimate < math.inf:
        # a stepping stone: the geometric mean of here and there
        estimate = max(math.isqrt(lo * estimate), math.floor(estimate / _FLOOR))
    elif model is not None and estimate < math.inf and not straight:
        estimate = lo + math.floor(_SHORT_OF * (estimate - lo))
    return model, int(min(max(estimate, lo + 1), hi - 1, max_size))
