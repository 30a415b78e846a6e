"""From measured stalls and a DataLoader's settings to the settings that remove the stalls.

The rules, each computed from numbers the caller measured (see :class:`~lightning_memopt.data.stall.StepTimes`):

Measured waits are everything between two steps. Where one batch's loading cost is measured and, in
the main process, is at most ``threshold`` of the step, the waits are not the DataLoader's and the loop
is not called data-bound (other callbacks' hooks, loggers and the progress bar run between steps too).

``num_workers``
    A loop with ``c`` seconds of compute per step needs its loader to deliver one batch every ``c``
    seconds. If one process needs ``b`` seconds to load a batch, ``ceil(b / c)`` workers keep up; the
    advice is that many, capped at the CPU cores available to this rank (workers beyond the cores
    compete for them). ``b`` is measured (:func:`batch_cost`: one batch through ``__getitem__`` and the
    collate function in this process) where the caller can; otherwise it is inferred from the waits:
    ``b = w`` in the main process (``num_workers=0``), and ``b = k (c + w)`` for ``k`` workers that do
    not keep up (the loop then runs at their pace, one batch per ``c + w``).
``pin_memory``
    On CUDA only: page-locked host memory makes the host-to-device copy faster and lets it overlap
    compute.
``persistent_workers``
    With workers and more than one epoch: without it the workers are started again at every epoch
    (seconds under the ``spawn`` and ``forkserver`` start methods, which import everything anew).
``prefetch_factor``
    With workers whose waits come in bursts (the longest wait more than 3x the mean, epoch starts
    aside): a deeper queue absorbs slow items; the advice doubles it. Bursts say nothing about the
    workers' average pace, so then ``num_workers`` is not inferred from the waits.

The first batch of every epoch waits for the workers' queue to fill (torch's workers fetch for an epoch
only once it begins, persistent or not); when that is a large share of the input time the diagnosis
says so: fewer, longer epochs amortize it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset

from lightning_memopt.data.pickling import worker_start_method
from lightning_memopt.data.preserved_rng import preserved_rng
from lightning_memopt.data.stall import StepTimes

__all__ = ["LoaderSettings", "Fix", "Diagnosis", "diagnose", "batch_cost", "cores_per_rank"]

_BURSTY = 3.0  # longest wait over mean wait (epoch starts aside) above which waits count as bursts


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
    outside_loader: bool = False
    """The waits are long but the DataLoader is not why: loading a batch, measured, is a small part of
    them (other callbacks' hooks, loggers, the progress bar run between steps too)."""

    @property
    def wait_fraction(self) -> float:
        return self.times.wait_fraction

    @property
    def data_bound(self) -> bool:
        return self.times.steps > 0 and self.wait_fraction > self.threshold and not self.outside_loader

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
        if self.outside_loader:
            line += " (spent outside the DataLoader)"
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
    batch_cost: float | None = None,
) -> Diagnosis:
    """Diagnose measured step times against the loader's settings.

    Args:
        times: Step times of the window to judge.
        settings: The training DataLoader's settings.
        threshold: Wait fraction above which the loop counts as data-bound.
        cores: CPU cores available to this rank (:func:`cores_per_rank`).
        device_type: Where the model computes (``pin_memory`` matters only on ``"cuda"``).
        epochs: Epochs the run will make (None or -1: unknown, taken as more than one).
        batch_cost: Seconds one process needs to load a batch (:func:`batch_cost`); None: inferred.

    Returns:
        The diagnosis; its fixes are empty when the loop is not data-bound.
    """
    if not (times.steps > 0 and times.wait_fraction > threshold):
        return Diagnosis(times, threshold, ())
    step = times.per_step()
    k = settings.num_workers
    steady = times.steps - times.epoch_starts
    steady_wait = (times.wait - times.epoch_start_wait) / steady if steady else 0.0
    bursty = k > 0 and steady_wait > 0 and times.max_wait > _BURSTY * steady_wait
    total = step.wait + step.transfer + step.compute
    if batch_cost is not None and k == 0 and batch_cost <= threshold * total:
        note = (
            f"Loading a batch takes only {batch_cost * 1e3:.2f} ms of the {step.wait * 1e3:.1f} ms wait per step "
            f"(measured): the rest is spent between steps outside the DataLoader (other callbacks' hooks, "
            "loggers, the progress bar), which no DataLoader setting changes."
        )
        return Diagnosis(times, threshold, (), note, outside_loader=True)
    if batch_cost is None and not bursty:
        batch_cost = step.wait if k == 0 else k * (step.compute + step.wait)
    fixes: list[Fix] = []
    workers, note = _workers_fix(batch_cost, step.compute, k, cores) if batch_cost is not None else (None, "")
    if workers is not None:
        fixes.append(workers)
    if device_type == "cuda" and not settings.pin_memory:
        why = f"page-locked batches copy to the GPU faster and overlap compute; the copy took {step.transfer * 1e3:.1f} ms"
        fixes.append(Fix("pin_memory", False, True, why + " per step"))
    final = workers.suggested if workers is not None else k
    if final > 0 and not settings.persistent_workers and (epochs is None or epochs < 0 or epochs > 1):
        why = "otherwise the workers start again at every epoch"
        if settings.start_method != "fork":
            why += f", each importing everything anew under the {settings.start_method!r} start method"
        fixes.append(Fix("persistent_workers", False, True, why))
    if bursty:
        current = settings.prefetch_factor or 2
        why = (
            f"the waits come in bursts (longest {times.max_wait * 1e3:.1f} ms, mean {steady_wait * 1e3:.1f} ms "
            "outside epoch starts); a deeper queue absorbs them"
        )
        fixes.append(Fix("prefetch_factor", current, 2 * current, why))
    return Diagnosis(times, threshold, tuple(fixes), " ".join(filter(None, [note, _epoch_note(times, k)])))


def _epoch_note(times: StepTimes, workers: int) -> str:
    """What the epochs' first batches cost, when they are a large share (a quarter) of the input time."""
    feeding = times.wait + times.transfer
    if not times.epoch_starts or times.epoch_start_wait < feeding / 4:
        return ""
    each = times.epoch_start_wait / times.epoch_starts
    return (
        f"{times.epoch_start_wait / feeding:.0%} of the input time is the first batch of each epoch "
        f"({each * 1e3:.1f} ms each): {'workers fill their queue' if workers else 'loading starts'} only when "
        "an epoch begins, so fewer, longer epochs amortize it."
    )


def batch_cost(loader: Any, *, clock: Callable[[], float] = time.perf_counter) -> float | None:
    """Seconds this process needs to load one batch of ``loader``, as a worker does: its first batch of
    indices through ``dataset[i]`` and the collate function, with every RNG restored after.

    Returns None for an ``IterableDataset`` or anything that is not a map-style DataLoader.
    """
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    with preserved_rng(loader):
        if loader.batch_sampler is not None:  # automatic batching: a list of indices per batch
            indices = next(iter(loader.batch_sampler))
            start = clock()
            loader.collate_fn([dataset[i] for i in indices])
        else:
            index = next(iter(loader.sampler))
            start = clock()
            loader.collate_fn(dataset[index])
        return clock() - start


def _workers_fix(batch: float, compute: float, workers: int, cores: int) -> tuple[Fix | None, str]:
    """The ``num_workers`` advice (or None) for ``batch`` seconds of loading per batch in one process,
    and a note on what more workers cannot fix."""
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
