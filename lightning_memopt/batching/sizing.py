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
# An extrapolation (not bracketed by a size measured over the budget) is probed this fraction of the way.
_SHORT_OF = 0.95


@dataclass(frozen=True)
class MemoryModel:
    """Peak bytes as an affine function of the micro-batch size: ``fixed + per_sample * size``."""

    fixed: float
    """Bytes that do not depend on the micro-batch (parameters, gradients, optimizer state, ...)."""
    per_sample: float
    """Bytes each sample adds to the peak (activations, inputs, outputs)."""

    @classmethod
    def through(cls, a: tuple[int, int], b: tuple[int, int]) -> MemoryModel:
        """The line through two ``(size, peak)`` points of different sizes."""
        (s1, p1), (s2, p2) = a, b
        per_sample = (p2 - p1) / (s2 - s1)
        return cls(fixed=p1 - per_sample * s1, per_sample=per_sample)

    def predict(self, size: int) -> float:
        """Predicted peak bytes at ``size``."""
        return self.fixed + self.per_sample * size

    def largest_fitting(self, budget: float) -> float:
        """The largest size whose predicted peak is at most ``budget`` (``inf`` when peaks do not grow)."""
        if self.per_sample <= 0:
            return math.inf
        return math.floor((budget - self.fixed) / self.per_sample)


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
        (100, [(1, 1010), (2, 1020), (14, 1140), (37, 1370), (100, 2000)])
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
    misses = 0  # probes in a row that ran out of memory
    while size is not None and len(probes) < max_probes:
        run(size)
        misses = misses + 1 if peaks[size] is None else 0
        good = sorted(s for s in peaks if fits(s))
        bad = sorted(s for s in peaks if not fits(s))
        lo = good[-1] if good else 0
        hi = bad[0] if bad else max_size + 1
        if not good:
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
        if lo == max_size or hi - lo <= 1:
            break  # the answer is known exactly

        # The line nearest the boundary: through the largest fitting size and the smallest size measured
        # over the budget (bracketing), else through the two largest fitting sizes (extrapolating).
        bracketing = hi <= max_size and peaks[hi] is not None
        # The curve is straight here if the previous line predicted the newest fitting size's peak.
        straight = model is not None and abs(model.predict(lo) - peaks[lo]) <= 1e-3 * peaks[lo]
        if bracketing:
            model = MemoryModel.through((lo, peaks[lo]), (hi, peaks[hi]))
        elif len(good) >= 2:
            model = MemoryModel.through((good[-2], peaks[good[-2]]), (lo, peaks[lo]))
        if model is not None:
            target = model.largest_fitting(budget)
            if target <= lo:
                break  # the line says no larger size fits
        else:
            # One point: if peak memory were proportional to size (no fixed part), this size would just
            # fit; with a fixed part it fits with room to spare. Double at least, to spread the points.
            target = max(math.floor(lo * budget / peaks[lo]), 2 * lo)
        if not bracketing and _MAX_JUMP * lo < target < math.inf:
            target = math.isqrt(lo * target)  # a stepping stone: the geometric mean of here and there
        elif not bracketing and model is not None and target < math.inf and not straight:
            # Stop a little short of an extrapolated prediction: memory curves bend upwards, so it tends
            # to overshoot, and a probe that fits tells more than one that runs out of memory.
            target = lo + math.floor(_SHORT_OF * (target - lo))
        if target >= hi <= max_size:
            # The estimate says a size that ran out of memory fits: it is wrong by an unknown amount, so
            # back off from that size (80% of the way after one miss, then bisect). A line through the OOM
            # point at exactly `capacity` meets the budget at an upper estimate (for an affine curve);
            # take it when it is lower.
            through_oom = MemoryModel.through((lo, peaks[lo]), (hi, max(capacity, peaks[lo] + 1)))
            step = _BACKOFF[min(misses, len(_BACKOFF)) - 1] if misses else 0.5
            target = min(lo + math.floor(step * (hi - lo)), through_oom.largest_fitting(budget))
        size = int(min(max(target, lo + 1), hi - 1, max_size))
    good = [s for s in peaks if fits(s)]
    if not good:  # max_probes ran out before anything fitted
        raise RuntimeError(
            f"no probed size fitted the budget of {budget} bytes within max_probes={max_probes} "
            f"(probes: {probes}); raise max_probes or free memory"
        )
    return SizingResult(size=max(good), budget=budget, probes=probes, model=model)
