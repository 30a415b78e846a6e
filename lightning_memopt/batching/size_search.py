"""Find the largest micro-batch that fits in memory, in a handful of probes.

Probe, fit a model of peak bytes vs size, probe the largest size it predicts under the usable bytes, refit.
Peak memory is convex in the size, which bounds the answer (why, and the measured accuracy:
``docs/micro_batching.md``, "Sizing"; ``docs/benchmarks.md``, from ``benchmarks/batching.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

from lightning_memopt._checks import check_positive_int
from lightning_memopt._compat import BatchNormBase
from lightning_memopt.batching.split import largest_micro_batch
from lightning_memopt.memory.device import is_out_of_memory
from lightning_memopt.memory.limit import check_headroom, usable_bytes
from lightning_memopt.memory.units import parse_bytes

__all__ = ["MemoryModel", "NoSizeFits", "SizingResult", "find_micro_batch_size", "smallest_micro_batch"]

# Peaks are whole bytes: a line through two measured peaks predicts a third within a few bytes of rounding.
_ROUNDING = 2
# A prediction more than _JUMP times the largest size that fitted rests on small batches, often in a
# slower-growing phase (the optimizer step) or on a slope blurred by rounding: probe a stepping stone
# towards it: their geometric mean, but at least 1/_STONE of the prediction (a later phase is rarely more
# than _STONE times steeper).
_JUMP, _STONE = 3, 6


class NoSizeFits(RuntimeError):
    """No probed micro-batch size fitted the usable bytes (a ``RuntimeError`` subclass, so callers can tell it
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

    @classmethod
    def through_largest(cls, probes: Iterable[tuple[int, int | None]], usable: int) -> MemoryModel | None:
        """The line through the two largest sizes whose peak fitted ``usable`` (None if fewer did).

        Beyond them a convex curve stays above it: no size past its :meth:`largest_fitting` fits.
        """
        fits = sorted((s, p) for s, p in dict(probes).items() if p is not None and p <= usable)
        return cls.through(fits[-2], fits[-1]) if len(fits) >= 2 else None

    def predict(self, size: int) -> float:
        """Predicted peak bytes at ``size``."""
        return self.fixed + self.per_sample * size + self.curvature * size * size

    def largest_fitting(self, usable: float) -> float:
        """The largest size whose predicted peak is at most ``usable``, on the rising side of the model
        (``inf`` when peaks do not grow, ``-inf`` when no size fits)."""
        if self.curvature <= 0:
            if self.per_sample <= 0:
                return math.inf
            return math.floor((usable - self.fixed) / self.per_sample)
        # the larger root of curvature * s**2 + per_sample * s + fixed - usable = 0
        discriminant = self.per_sample**2 + 4 * self.curvature * (usable - self.fixed)
        if discriminant < 0:
            return -math.inf
        root = math.sqrt(discriminant)
        if self.per_sample > 0:  # the same root, without cancelling two large numbers
            return math.floor(2 * (usable - self.fixed) / (self.per_sample + root))
        return math.floor((root - self.per_sample) / (2 * self.curvature))


@dataclass
class SizingResult:
    """What :func:`find_micro_batch_size` found."""

    size: int
    """The largest micro-batch size that was probed and fitted the usable bytes."""
    usable: int
    """``capacity * (1 - headroom)`` in bytes: a probe fits when its peak is at most this."""
    probes: list[tuple[int, int | None]] = field(default_factory=list)
    """Every probe in order, as ``(size, peak bytes)``; the peak is None when the probe ran out of memory."""
    model: MemoryModel | None = None
    """The line through the two largest sizes that fitted (:meth:`MemoryModel.through_largest`; None if
    fewer than two fitted)."""

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
    fixed: float | None = None,
    split: bool = False,
) -> SizingResult:
    """Find the largest micro-batch size whose peak memory fits ``capacity * (1 - headroom)``.

    Probe, fit, predict, verify (the module docstring says why): each probe's size is the one the
    probes so far predict to be the largest that fits. Sizes are any integers in ``[min_size, max_size]``
    (``split``: only the sizes of an even split of ``max_size``); no size is probed twice, and the
    returned size is the largest one that was probed and fitted.

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
        fixed: Peak bytes that do not grow with the size, where an earlier search measured them (its
            line's intercept: parameters, gradients, optimizer state, the batch). While one size alone
            has fitted, the next probe is where the line through ``(0, fixed)`` and that size's peak
            crosses the usable bytes; without it, peaks are taken as proportional to the size (and the
            next probe at least doubles it). Default None.
        split: Probe only the sizes at which a batch of ``max_size`` samples split evenly runs in fewer
            micro-batches than at any smaller size: ``ceil(max_size / n)`` for ``n`` micro-batches (48: 48,
            24, 16, 12, 10, 8, 7, 6, 5, 4, 3, 2, 1). Where 38 samples fit a batch of 48, it runs as 2 of
            24 all the same: the search probes 24 and stops, where it would go on to 38 and 39. Default
            False.

    Returns:
        A :class:`SizingResult`; ``result.size`` was probed and its peak fitted the usable bytes.

    Raises:
        ValueError: If an argument is out of range, or ``probe`` returns something other than a
            positive int or None.
        NoSizeFits: If even ``min_size`` does not fit the usable bytes, or ``max_probes`` ran out before
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
    usable = usable_bytes(capacity, headroom, None, name="capacity")  # the package's one rule
    peaks: dict[int, int | None] = {}  # by size, in probe order
    size: int | None = max(largest_micro_batch(max_size, start), min_size) if split else start
    while size is not None and len(peaks) < max_probes:
        peaks[size] = _run(probe, size)
        if any(p is not None and p <= usable for p in peaks.values()):
            size = _next_size(peaks, usable, max_size, fixed, split)
        elif min_size not in peaks:
            size = min_size  # the first probe was too large: start again from the bottom
        else:
            peak = peaks[min_size]
            raise NoSizeFits(
                f"even min_size={min_size} does not fit: its probe "
                + ("ran out of memory" if peak is None else f"peaked at {peak} bytes")
                + f", over the usable {usable} bytes (capacity {capacity}, headroom {headroom}); "
                "free memory (activation checkpointing, a smaller model) or raise capacity"
            )
    probes = list(peaks.items())
    fits = [s for s, p in probes if p is not None and p <= usable]
    if not fits:  # max_probes ran out before anything fitted
        raise NoSizeFits(
            f"no probed size fitted the usable {usable} bytes within max_probes={max_probes} "
            f"(probes: {probes}); raise max_probes or free memory"
        )
    model = MemoryModel.through_largest(probes, usable)
    return SizingResult(size=max(fits), usable=usable, probes=probes, model=model)


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


def _run(probe: Callable[[int], int | None], size: int) -> int | None:
    """``probe(size)``, an out-of-memory error counted as None, the result checked."""
    try:
        peak = probe(size)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        peak = None
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, int) or peak <= 0):
        raise ValueError(f"probe({size}) must return peak bytes as a positive int or None, got {peak!r}")
    return peak


def _below(line: MemoryModel | None, points: list[int], size: int, usable: int) -> bool:
    """Whether the line through the two largest sizes that fitted (``points``, in order; None: no line)
    leaves ``size`` within the usable bytes, allowing for each peak's rounding as the line carries it past
    its two points: an even split's size may lie a sample past the crossing that :data:`_ROUNDING` alone
    allows (2,545 of 2,545 where the line's points are 849 and 1,273)."""
    if line is None:
        return True
    s1, s2 = points[-2:]
    return line.predict(size) <= usable + _ROUNDING * (1 + 2 * max(size - s2, 0) / (s2 - s1))


def _next_size(
    peaks: dict[int, int | None], usable: int, max_size: int, fixed: float | None, split: bool = False
) -> int | None:
    """The size the probes so far predict to be the largest that fits; None when none is left to try
    (``fixed`` and ``split``: :func:`find_micro_batch_size`'s)."""
    fits = sorted(s for s, p in peaks.items() if p is not None and p <= usable)
    lo = fits[-1]  # the largest size known to fit
    hi = min((s for s in peaks if s not in fits), default=max_size + 1)  # the smallest known not to
    points = {s: (s, p) for s, p in peaks.items()}
    upper = hi - 1
    line = MemoryModel.through_largest(peaks.items(), usable)
    if line is not None:  # nothing past the line's crossing fits (with slack for the rounding of peaks)
        upper = min(upper, line.largest_fitting(usable + _ROUNDING))
    reach: list[int] = []
    if split:
        reach = [
            n
            for n in range(lo + 1, hi)
            if largest_micro_batch(max_size, n) == n and _below(line, fits, n, usable)
        ]
        if not reach:
            return None
    if upper <= lo:
        return reach[0] if reach else None
    borrowed = False  # the guess rests on bytes another search measured (``fixed``)
    if hi <= max_size and peaks[hi] is not None:  # a peak over the usable: the chord's crossing fits
        guess = MemoryModel.through(points[lo], points[hi]).largest_fitting(usable)
    else:
        # The model: with one point, the line from the fixed bytes an earlier search measured, else peak
        # proportional to size (at least double, to spread the points); with two, the line; with three
        # that bend upwards, the parabola through them.
        peak = peaks[lo] or 1
        if line is not None:
            guess = upper
        elif fixed is not None and 0 <= fixed < peak:
            guess = MemoryModel.through((0, round(fixed)), (lo, peak)).largest_fitting(usable)
            borrowed = True
        else:
            guess = max(lo * usable // peak, 2 * lo)
        if len(fits) >= 3:
            parabola = MemoryModel.through3(*(points[s] for s in fits[-3:]))
            if parabola.curvature > 0:
                guess, borrowed = parabola.largest_fitting(usable), False
        if hi <= max_size and guess >= hi - 1:  # it ran out of memory where the model says it fits
            guess, borrowed = (lo + hi) // 2, False
        elif hi > max_size and _JUMP * lo < guess < math.inf and (fixed is None or line is not None):
            stone = max(math.isqrt(lo * guess), guess // _STONE)  # a stepping stone
            if split:  # the even split's next size at or past it (the stone is a step, not a bound)
                return next((n for n in reach if n >= stone), reach[-1])
            guess = stone
    size = int(min(max(guess, lo + 1), upper))
    if not split:
        return size
    # The largest of the even split's sizes that the guess reaches (a sample past it where the guess rests
    # on another search's bytes: 47.9 from the fixed bytes of the model's own head, where 48 fits
    # recomputed), else the smallest (a guess between two of them is no reason to stop short of one that
    # the bounds allow).
    below = [n for n in reach if n <= size + borrowed]
    return below[-1] if below else reach[0]
