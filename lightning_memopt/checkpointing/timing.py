"""Time a block's treatments on its device: the seconds that plans are priced in.

FLOPs miss what a treatment costs beyond arithmetic: selective checkpointing's per-op dispatch, the
Python of a block replayed in backward, memory-bound pointwise ops, copies to the host. So the profile
also *times* each treatment it considers (:func:`time_treatments`): the block's forward and backward on
its captured inputs, under each treatment in turn, ``repeats`` rounds of one pass per treatment
(alternated, so that a slow moment of a shared machine does not fall on one treatment only). A
treatment's price is the median, over rounds, of its pass's seconds minus ``keep``'s in the same round
(paired: what slows a whole round down cancels). The clock is the device's (:func:`~lightning_memopt.data.clock.step_clock`:
CUDA events on CUDA, ``perf_counter`` elsewhere); tests pass a fake one.

Cost, paid once per profile (the first batch, and a batch of a new shape under a limit): 2 or 3 passes
(forward and backward) of the block per treatment, for each *distinct* block (blocks with the same class,
configuration and input shapes are profiled and timed once). Two rounds end it where every treatment's
extras in them lie within a tenth of keep's pass of each other; else a third round runs and each price is
the median of three, which one round that a busy moment of a shared machine slowed does not move. (With
more ``repeats``, rounds go on until another round's extra lies within that tenth of the median.) With
the four treatments ``AutoCheckpoint`` weighs on CPU (keep, selective, full, pointwise; five with offload
on CUDA): 8 to 12 (10 to 15) block passes, about one training step of a 12-block model whose blocks are
all alike; fewer where a treatment holds no less than keep (``profile.py`` does not time it: pointwise in
every block of a ResNet).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_memopt.data.clock import Clock

__all__ = ["TIMING_REPEATS", "Timing", "time_treatments"]

TIMING_REPEATS = 3
"""Timed passes per treatment and distinct block at most (each after the profile's untimed pass, its
warm-up)."""
_LEAST = 2  # rounds at least
_STEADY = 0.1  # of keep's median pass: how close another round must be to a treatment's median to stop


@dataclass(frozen=True)
class Timing:
    """One treatment's seconds: the median pass, and the median and range of its extra over ``keep``'s
    pass in the same round."""

    median: float
    """Median seconds of a pass."""
    extra: float
    """Median over rounds of (this treatment's pass - keep's pass): what the treatment adds."""
    low: float
    """Smallest extra of a round."""
    high: float
    """Largest extra of a round."""


def time_treatments(
    prepare: Callable[[str], Callable[[], object]],
    choices: Sequence[str],
    clock: Clock,
    repeats: int = TIMING_REPEATS,
) -> dict[str, Timing]:
    """Each treatment's :class:`Timing` over up to ``repeats`` rounds, every round timing one pass of each;
    from the second on, the rounds stop where every treatment's median extra over keep is confirmed by
    another round within a tenth of keep's median pass (the module docstring).

    Args:
        prepare: ``prepare(choice)`` sets the block to ``choice`` and returns the pass to time (what it
            does first, such as cloning inputs, is not timed).
        choices: The treatments, timed in this order within a round; ``keep`` among them (the extra of
            each is taken over it; without it, extras are the passes' own seconds).
        clock: Marks on the device's timeline (:class:`~lightning_memopt.data.clock.Clock`).
        repeats: Rounds at most; at least 1.

    Raises:
        ValueError: If ``repeats`` is below 1.

    Example::

        >>> from tests.data.helpers import FakeClock  # doctest: +SKIP
        >>> clock = FakeClock()  # doctest: +SKIP
        >>> time_treatments(lambda c: lambda: clock.advance(2.0 if c == "full" else 1.0), ["keep", "full"], clock)["full"]  # doctest: +SKIP
        Timing(median=2.0, extra=1.0, low=1.0, high=1.0)
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    samples: dict[str, list[float]] = {c: [] for c in choices}
    for rounds in range(1, repeats + 1):
        for choice in choices:
            run = prepare(choice)
            start = clock.mark()
            run()
            end = clock.mark()
            clock.settle(end)
            samples[choice].append(clock.seconds(start, end))
        if rounds >= _LEAST and _steady(samples):
            break
    timings = {}
    for choice, extra in _extras(samples).items():
        seconds = samples[choice]
        timings[choice] = Timing(statistics.median(seconds), statistics.median(extra), min(extra), max(extra))
    return timings


def _extras(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each treatment's seconds beyond keep's, round by round (without keep, its own seconds)."""
    keep = samples.get("keep")
    return {c: [s - k for s, k in zip(v, keep)] if keep is not None else list(v) for c, v in samples.items()}


def _steady(samples: dict[str, list[float]]) -> bool:
    """Whether every treatment's median extra is confirmed: over the rounds so far, the extras next to it
    in order (for an odd count, the nearer of the middle one's two neighbours; for an even count, the two
    middle ones) lie within :data:`_STEADY` of keep's median pass (without keep, of its own median pass).
    """
    for choice, extra in _extras(samples).items():
        scale = statistics.median(samples.get("keep", samples[choice]))
        ordered, mid = sorted(extra), len(extra) // 2
        if len(extra) % 2:
            gap = min(ordered[mid] - ordered[mid - 1], ordered[mid + 1] - ordered[mid])
        else:
            gap = ordered[mid] - ordered[mid - 1]
        if gap > _STEADY * scale:
            return False
    return True
