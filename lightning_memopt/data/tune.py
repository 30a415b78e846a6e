"""Measure the training DataLoader alone at a few ``num_workers`` values and pick the fastest.

Each candidate is a fresh DataLoader over the *same* dataset, sampler (or batch sampler) and collate
function, iterated for the first ``batches`` batches under :func:`~lightning_memopt.data.preserved_rng.preserved_rng`,
so every candidate, and the training that follows, sees the same samples in the same order as without
tuning. An ``IterableDataset`` may be a one-shot stream, so it is not tuned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from lightning_memopt._checks import check_positive_int
from lightning_memopt.data.diagnosis import cores_per_rank
from lightning_memopt.data.preserved_rng import preserved_rng

__all__ = ["TuneRow", "TuneResult", "tune_num_workers", "worker_candidates"]

_CLOSE = 0.05  # a candidate within 5% of the fastest counts as equally fast


@dataclass(frozen=True)
class TuneRow:
    """Seconds one candidate took."""

    num_workers: int
    first_batch: float
    """From ``iter()`` to the first batch (includes starting the workers)."""
    total: float
    """From ``iter()`` to the last timed batch."""
    batches: int

    @property
    def per_batch(self) -> float:
        """Mean seconds per batch after the first."""
        return (self.total - self.first_batch) / max(self.batches - 1, 1)

    def epoch(self, batches: int) -> float:
        """Estimated seconds for an epoch of ``batches`` batches: the start once, then the steady pace."""
        return self.first_batch + self.per_batch * (batches - 1)


@dataclass(frozen=True)
class TuneResult:
    """The measured table and the pick."""

    rows: tuple[TuneRow, ...]
    epoch_batches: int
    """Batches in one epoch of the loader (the timed batches where it has no length)."""
    best: int
    """The ``num_workers`` with the shortest estimated epoch. Among those within 5% of it, workers win over
    ``0`` (timed alone, the loader cannot show that only workers load while the model computes), and
    then the fewest workers."""

    def table(self) -> str:
        """The table as text, one row per candidate."""
        lines = [
            f"num_workers | first batch (s) | per batch (ms) | epoch of {self.epoch_batches} batches (s, est.)"
        ]
        for row in self.rows:
            mark = "  <- fastest" if row.num_workers == self.best else ""
            lines.append(
                f"{row.num_workers:>11} | {row.first_batch:>15.3f} | {row.per_batch * 1e3:>14.1f} | "
                f"{row.epoch(self.epoch_batches):>9.3f}{mark}"
            )
        return "\n".join(lines)


def worker_candidates(current: int, cores: int) -> list[int]:
    """0, 1, 2, 4, ... up to ``cores``, and ``current``."""
    values = {0, current, cores}
    k = 1
    while k < cores:
        values.add(k)
        k *= 2
    return sorted(values)


def tune_num_workers(
    loader: DataLoader,
    *,
    candidates: Iterable[int] | None = None,
    batches: int = 16,
    clock: Callable[[], float] = time.perf_counter,
) -> TuneResult:
    """Time the first ``batches`` batches of ``loader`` at each ``num_workers`` candidate.

    Args:
        loader: The DataLoader to measure; it is not changed (apply ``result.best`` yourself).
        candidates: ``num_workers`` values to try; default :func:`worker_candidates` for this machine.
        batches: Batches timed per candidate (fewer if the loader is shorter).
        clock: Seconds source (a fake one in tests).

    Returns:
        The table and the value with the shortest estimated epoch: the first batch (start-up) plus the
        steady time per batch for every further batch of an epoch.

    Raises:
        ValueError: If ``batches`` is not a positive int, a candidate is negative, or the dataset is an
            ``IterableDataset`` (iterating it may consume the stream).

    Example::

        result = tune_num_workers(loader, batches=32)
        print(result.table())
        loader = DataLoader(dataset, batch_size=64, num_workers=result.best)
    """
    check_positive_int("batches", batches)
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            "tune_num_workers cannot tune a DataLoader over an IterableDataset: iterating it may consume "
            "the stream; set num_workers by hand"
        )
    values = (
        worker_candidates(loader.num_workers, cores_per_rank()) if candidates is None else list(candidates)
    )
    if not values or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in values):
        raise ValueError(f"candidates must be non-negative ints, got {values!r}")
    rows = []
    for workers in values:
        with preserved_rng(loader):  # each candidate, and the training after, sees the same order
            rows.append(_time_one(_with_workers(loader, workers), batches, clock))
    # Start-up is paid once per epoch (or once, with persistent workers), the pace on every batch: judge
    # the candidates on a whole epoch, not on the few timed batches where start-up dominates.
    epoch = len(loader) if hasattr(loader.batch_sampler or loader.sampler, "__len__") else batches
    fastest = min(row.epoch(epoch) for row in rows)
    close = [row.num_workers for row in rows if row.epoch(epoch) <= fastest * (1 + _CLOSE)]
    best = min(close, key=lambda k: (k == 0, k))
    return TuneResult(tuple(rows), epoch, best)


def _with_workers(loader: DataLoader, workers: int) -> DataLoader:
    """A DataLoader like ``loader`` (same sampling objects) with ``workers`` workers, not persistent."""
    sampling: dict[str, Any] = (
        {"batch_sampler": loader.batch_sampler}
        if loader.batch_sampler is not None
        else {"sampler": loader.sampler, "batch_size": None}
    )
    return DataLoader(
        loader.dataset,
        **sampling,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers > 0 else None,
        generator=loader.generator,
        prefetch_factor=(loader.prefetch_factor or 2) if workers > 0 else None,
        persistent_workers=False,
    )


def _time_one(loader: DataLoader, batches: int, clock: Callable[[], float]) -> TuneRow:
    start = clock()
    first = None
    seen = 0
    iterator = iter(loader)
    try:
        for _ in range(batches):
            next(iterator)
            seen += 1
            if first is None:
                first = clock() - start
    except StopIteration:
        pass
    finally:
        del iterator  # shuts the workers down
    total = clock() - start
    return TuneRow(loader.num_workers, first if first is not None else total, total, seen)
