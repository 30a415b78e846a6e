"""From measured stalls and a DataLoader's settings to the settings that remove the stalls.

The rules, each computed from numbers the caller measured (see :class:`~lightning_memopt.data.stall.StepTimes`):

``num_workers``
    A loop with ``w`` seconds of wait and ``c`` of compute per step needs its loader to deliver one batch
    every ``c`` seconds. In the main process (``num_workers=0``) one batch costs ``b = w`` seconds; with
    ``k`` workers that cannot keep up, the loop runs at their pace, one batch per ``c + w``, so one
    worker's batch costs ``b = k (c + w)``. ``ceil(b / c)`` workers keep up; the advice is that many,
    capped at the CPU cores available to this rank (workers beyond the cores compete for them).
``pin_memory``
    On CUDA only: page-locked host memory makes the host-to-device copy faster and lets it overlap
    compute.
``persistent_workers``
    With workers and more than one epoch: without it the workers are started again at every epoch
    (seconds under the ``spawn`` and ``forkserver`` start methods, which import everything anew).
``prefetch_factor``
    With workers whose waits come in bursts (the longest wait more than 3x the mean): a deeper queue
    absorbs slow items; the advice doubles it. Bursts say nothing about the workers' average pace, so
    then ``num_workers`` is not estimated.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from lightning_memopt.data.pickling import worker_start_method
from lightning_memopt.data.stall import StepTimes

__all__ = ["LoaderSettings", "Fix", "Diagnosis", "diagnose", "cores_per_rank"]

_BURSTY = 3.0  # longest wait over mean wait above which waits count as bursts


@dataclass(frozen=True)
class LoaderSettings:
    """The DataLoader settings the diagnosis reads."""

    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    start_method: str = "fork"
    """How workers are started: ``"fork"``, ``"spawn"`` or ``"forkserver"``."""

    @classmethod
    def of(cls, loader: Any) -> LoaderSettings:
        """Read the settings of a ``torch.utils.data.DataLoader`` (defaults for any other iterable)."""
        return cls(
            num_workers=int(getattr(loader, "num_workers", 0) or 0),
            pin_memory=bool(getattr(loader, "pin_memory", False)),
            persistent_workers=bool(getattr(loader, "persistent_workers", False)),
            prefetch_factor=getattr(loader, "prefetch_factor", None),
            start_method=worker_start_method(loader),
        )


@dataclass(frozen=True)
class Fix:
    """One setting to change, and why (with the numbers behind it)."""

    setting: str
    current: Any
    suggested: Any
    why: str

    def __str__(self) -> str:
        return f"{self.setting}={self.current!r} -> {self.suggested!r} ({self.why})"


@dataclass(frozen=True)
class Diagnosis:
    """Whether a loop is data-bound, by how much, and what to change."""

    times: StepTimes
    threshold: float
    fixes: tuple[Fix, ...]
    note: str = ""
    """What no setting fixes (e.g. items costlier than the cores can deliver)."""

    @property
    def wait_fraction(self) -> float:
        return self.times.wait_fraction

    @property
    def data_bound(self) -> bool:
        return self.times.steps > 0 and self.wait_fraction > self.threshold

    def message(self) -> str:
        """The warning: how data-bound the loop is and the concrete changes."""
        step = self.times.per_step()
        head = (
            f"the training loop is data-bound: {self.wait_fraction:.0%} of its time goes to feeding input "
            f"(per step over {self.times.steps} steps: waiting for the next batch {step.wait * 1e3:.1f} ms, "
            f"host-to-device transfer {step.transfer * 1e3:.1f} ms, compute {step.compute * 1e3:.1f} ms)."
        )
        if self.fixes:
            head += " Change the training DataLoader: " + "; ".join(map(str, self.fixes)) + "."
        return head + (f" {self.note}" if self.note else "")

    def summary_line(self) -> str:
        """One line for an end-of-fit summary."""
        verdict = "data-bound" if self.data_bound else "not data-bound"
        line = f"data: {verdict}, wait fraction {self.wait_fraction:.2f} over {self.times.steps} steps"
        if self.data_bound and self.fixes:
            line += "; fix: " + ", ".join(f"{f.setting}={f.suggested!r}" for f in self.fixes)
        return line


def cores_per_rank(ranks_per_node: int = 1) -> int:
    """CPU cores this process may run on, shared evenly by the ranks of one node (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))  # honours taskset / container CPU sets
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(cores // max(ranks_per_node, 1), 1)


def diagnose(
    times: StepTimes,
    settings: LoaderSettings,
    *,
    threshold: float,
    cores: int,
    device_type: str = "cpu",
    epochs: int | None = None,
) -> Diagnosis:
    """Diagnose measured step times against the loader's settings.

    Args:
        times: Step times of the window to judge.
        settings: The training DataLoader's settings.
        threshold: Wait fraction above which the loop counts as data-bound.
        cores: CPU cores available to this rank (:func:`cores_per_rank`).
        device_type: Where the model computes (``pin_memory`` matters only on ``"cuda"``).
        epochs: Epochs the run will make (None or -1: unknown, taken as more than one).

    Returns:
        The diagnosis; its fixes are empty when the loop is not data-bound.
    """
    if not (times.steps > 0 and times.wait_fraction > threshold):
        return Diagnosis(times, threshold, ())
    step = times.per_step()
    fixes: list[Fix] = []
    # Workers' pace follows from the waits only when the waits are steady: bursts (an epoch's first
    # batch, an occasional slow item) say nothing about how fast the workers produce on average.
    bursty = step.wait > 0 and times.max_wait > _BURSTY * step.wait
    if settings.num_workers > 0 and bursty:
        workers, note = None, ""
    else:
        workers, note = _workers_fix(step.wait, step.compute, settings.num_workers, cores)
    if workers is not None:
        fixes.append(workers)
    if device_type == "cuda" and not settings.pin_memory:
        fixes.append(
            Fix(
                "pin_memory",
                False,
                True,
                f"page-locked batches copy to the GPU faster and overlap compute; "
                f"the transfer took {step.transfer * 1e3:.1f} ms per step",
            )
        )
    final_workers = workers.suggested if workers is not None else settings.num_workers
    if final_workers > 0 and not settings.persistent_workers and (epochs is None or epochs < 0 or epochs > 1):
        fixes.append(
            Fix(
                "persistent_workers",
                False,
                True,
                "otherwise the workers start again at every epoch"
                + (
                    f", each importing everything anew under the {settings.start_method!r} start method"
                    if settings.start_method != "fork"
                    else ""
                ),
            )
        )
    if settings.num_workers > 0 and bursty:
        current = settings.prefetch_factor or 2
        fixes.append(
            Fix(
                "prefetch_factor",
                current,
                2 * current,
                f"the waits come in bursts (longest "
                f"{times.max_wait * 1e3:.1f} ms, mean {step.wait * 1e3:.1f} ms); a deeper queue absorbs them",
            )
        )
    return Diagnosis(times, threshold, tuple(fixes), note)


def _workers_fix(wait: float, compute: float, workers: int, cores: int) -> tuple[Fix | None, str]:
    """The ``num_workers`` advice (or None) and a note on what more workers cannot fix."""
    batch = (
        wait if workers == 0 else workers * (compute + wait)
    )  # seconds one loader process spends per batch
    needed = math.ceil(batch / compute) if compute > 0 else cores
    suggested = min(max(needed, 1), cores)
    note = ""
    if needed > cores:
        expected = 1.0 - compute / max(compute, batch / cores)
        note = (
            f"Loading one batch takes {batch * 1e3:.1f} ms of one process; keeping up with {compute * 1e3:.1f} ms "
            f"of compute needs {needed} workers but this rank has {cores} CPU cores, so expect a wait fraction "
            f"near {expected:.2f} at best: make __getitem__ or the collate function cheaper (decode once, cache)."
        )
    if suggested <= workers:
        return None, note
    expected = 1.0 - compute / max(compute, batch / suggested)
    why = (
        f"one batch costs {batch * 1e3:.1f} ms to load in one process against {compute * 1e3:.1f} ms of compute; "
        f"{suggested} workers on the {cores} CPU cores of this rank bring the wait fraction to about {expected:.2f}"
    )
    return Fix("num_workers", workers, suggested, why), note
