"""A seeded family of simulated memory curves (peak bytes vs micro-batch size) for the sizing search.

Shared by ``tests/batching/test_size_search.py`` and ``benchmarks/batching.py`` (plain Python, no torch).
Each curve is described at a target size ``T`` (1 with probability 4%, else log-uniform in [2, 5000]):
its peak there (1e5 to 1e10 bytes), the fixed part's share of it (log-uniform in 2-90%) and the quadratic
part over the per-sample part (0 for affine; 2-50% convex; 0.5-5 times strongly convex). Kinked curves
add a small-batch phase, as when small batches peak in the optimizer step and large ones in backward: a
line 1.5-6 times less steep that meets the steep part at a kink log-uniform in 1-150% of ``T`` (the
capacity is scale-free relative to where the phases cross); "kinked convex" has a quadratic part of up to
3 times the per-sample one on the steep phase. The headroom is 0 or 0.1, the capacity the peak at ``T``
over ``1 - headroom``, and ``max_size`` the true maximum, a random size up to 8 times it, or 8192.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

KINDS = ("affine", "convex", "strongly convex", "kinked", "kinked convex")


@dataclass(frozen=True)
class Curve:
    """One simulated device and memory curve."""

    kind: str
    peak: Callable[[int], int]
    """Peak bytes of a micro-step on ``size`` samples (non-decreasing)."""
    capacity: int
    """The simulated device: a probe whose peak exceeds it runs out of memory."""
    headroom: float
    max_size: int
    true: int
    """The largest size in ``[1, max_size]`` whose peak fits ``floor(capacity * (1 - headroom))``."""
    kink: float | None = None
    """Where a kinked curve turns steeper (None for the others)."""

    def probe(self, size: int) -> int | None:
        peak = self.peak(size)
        return peak if peak <= self.capacity else None


def _largest(fits: Callable[[int], bool], high: int) -> int:
    lo, hi = 0, high + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def random_curve(rng: random.Random, kind: str) -> Curve:
    """One curve of ``kind`` (see :data:`KINDS`) whose true maximum is between 1 and 5000."""
    target = 1 if rng.random() < 0.04 else round(math.exp(rng.uniform(math.log(2), math.log(5000))))
    scale = 10 ** rng.uniform(5, 10)  # the peak at the target, in bytes
    fixed = scale * math.exp(rng.uniform(math.log(0.02), math.log(0.9)))  # share of the peak
    # the quadratic part at the target over the per-sample (linear) part
    bend = {"affine": 0.0, "convex": rng.uniform(0.02, 0.5), "kinked": 0.0}.get(kind, rng.uniform(0.5, 5.0))
    if kind == "kinked convex":
        bend = rng.uniform(0.0, 3.0)
    linear = (scale - fixed) / (1 + bend) / target  # bytes per sample
    curve = bend * linear / target  # bytes per sample squared

    def steep(s: float) -> float:
        return fixed + linear * s + curve * s * s

    kink = None
    if kind.startswith("kinked"):
        # small batches: a line with `ratio` times less slope, meeting the steep part at `kink`
        ratio, kink = rng.uniform(1.5, 6.0), target * math.exp(rng.uniform(math.log(0.01), math.log(1.5)))
        slope = (linear + 2 * curve * kink) / ratio
        base = steep(kink) - slope * kink

        def exact(s: float) -> float:
            return max(steep(s), base + slope * s)
    else:
        exact = steep

    def peak(size: int) -> int:
        return max(1, int(exact(size)))

    headroom = rng.choice([0.0, 0.1])
    capacity = math.ceil(peak(target) / (1 - headroom))
    budget = math.floor(capacity * (1 - headroom))
    true = _largest(lambda s: peak(s) <= budget, 8192)
    max_size = rng.choice([true, rng.randint(true, 8 * true + 8), 8192])
    return Curve(kind, peak, capacity, headroom, max_size, true, kink if kind.startswith("kinked") else None)


def random_curves(n: int, seed: int = 0) -> list[Curve]:
    """``n`` curves, the kinds in turn, from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [random_curve(rng, KINDS[i % len(KINDS)]) for i in range(n)]
