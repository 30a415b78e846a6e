"""MemoryMonitor: peak memory of every training step by phase and category, logged and reported."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memopt._checks import check_bool, check_positive_int
from lightning_memopt.callbacks._hooks import forget_module
from lightning_memopt.callbacks.dataloader_monitor import DataLoaderMonitor
from lightning_memopt.memory.device import DeviceMemory, TrackedMemory, device_memory
from lightning_memopt.memory.report import (
    PHASES,
    MemoryHistory,
    empty_record,
    fold_peak,
    merge_records,
    peak_phase,
    report_dir_problem,
    summary,
    write_report,
)
from lightning_memopt.memory.tracker import CATEGORIES, MemoryTracker

__all__ = ["MemoryMonitor"]

_GIB = 2**30
_BREAKDOWN_MODES = ("auto", "always", "never")


class MemoryMonitor(Callback):
    r"""Record the peak memory of every training step by phase and category, log it, and write a report.

    Each training step is cut into three phases at public Lightning hooks:

    ``forward``
        ``on_train_batch_start`` → ``on_before_backward``: ``training_step`` (and ``zero_grad``, which
        Lightning runs after it). Under this package's micro-batching engine (``AutoAccumulation``) every
        micro-batch's forward *and backward* run inside ``training_step``, so this phase contains all of
        them and ``backward`` only the hooks around the already computed gradients.
    ``backward``
        ``on_before_backward`` → ``on_before_optimizer_step`` (or the end of the batch when gradients are
        being accumulated): ``loss.backward()`` and the hooks after it.
    ``optimizer``
        ``on_before_optimizer_step`` → ``on_train_batch_end``: gradient clipping and ``optimizer.step()``.
        0 for batches that only accumulate gradients. In manual optimization the phases follow the same
        hooks, so anything ``training_step`` does after ``optimizer.step()`` is counted here.

    For each phase it keeps the peak bytes and, with a breakdown, the bytes of each category of
    :class:`~lightning_memopt.memory.MemoryTracker` (``parameters``, ``gradients``, ``optimizer_state``,
    ``activations``, ``other``) at that peak. Validation batches are measured separately.

    **How it measures.** On CPU (and any non-CUDA device) a :class:`MemoryTracker` is entered for each
    training and validation batch and exited at its end (also on exceptions and at teardown): peaks are
    exact live tensor bytes. Cost: the tracker intercepts every tensor op in Python (a few microseconds
    each); a fit of a 2-layer width-128 transformer on CPU took about 2.7x as long with the monitor as
    without (``benchmarks/memory_monitor.py``), less for models whose ops are bigger. The numbers do not
    depend on it. The
    tracker holds only weak references, so it keeps no tensor alive. On CUDA peaks come from the caching
    allocator (``max_memory_allocated``, reset at each phase boundary with ``reset_peak_memory_stats``, so
    other readers of the allocator's peak see these windows too), which costs nothing; the
    allocator has no categories, so the breakdown is measured only with ``breakdown="always"``, by
    running the tracker as well (at the CPU cost above). It then sums to the tracker's peak, which can be
    below the allocator's by non-tensor allocations (cuBLAS workspaces, NCCL buffers).

    **Logged keys** (with ``log=True``, through every logger of the Trainer, at
    ``step=trainer.global_step``; each value is the largest of the logging window, i.e. of the steps since
    the last log, not of the run so far; under a distributed strategy it is the largest over ranks, with
    one ``all_gather`` per log). They follow the package's ``<area>/<quantity>`` vocabulary, area
    ``memory/``, unit in the name:

    ===================================  ===  =================================================================
    key                                  unit meaning
    ===================================  ===  =================================================================
    ``memory/forward_peak_gib``          GiB  peak of the forward phase
    ``memory/backward_peak_gib``         GiB  peak of the backward phase
    ``memory/optimizer_peak_gib``        GiB  peak of the optimizer phase
    ``memory/peak_gib``                  GiB  peak of the whole step (the largest of the three)
    ``memory/peak_<category>_gib``       GiB  bytes of ``<category>`` at that peak (with a breakdown; the
                                              five values sum to ``memory/peak_gib``)
    ``memory/val_peak_gib``              GiB  peak over the batches of one validation run (logged at its end)
    ===================================  ===  =================================================================

    GiB means ``bytes / 2**30``. At the end of fit, rank zero writes ``memory_report.md`` (a table per
    phase with the breakdown in MiB) and, when matplotlib is installed, ``memory_report.png`` (peak per
    step by phase; stacked breakdown at each phase's peak) into ``trainer.log_dir`` (or ``dirpath``),
    and prints a short summary. The numbers stay readable in :attr:`history` and :attr:`val_history`.
    After ``fit``, finished or failed, the callback holds no reference to the model, its tensors or the
    Trainer, and no tracker stays entered.

    Args:
        log: Log the keys above (default True). False: nothing is logged (and no ``all_gather`` runs for
            it); :attr:`history` and, with ``report=True``, the report are still written.
        log_every_n_steps: Log every this many training batches (the window the peaks cover). Default
            None: the Trainer's ``log_every_n_steps``. Only with ``log=True``.
        breakdown: ``"auto"`` (default): bytes by category wherever the tracker runs anyway (not on
            CUDA); ``"always"``: also on CUDA, by running the tracker there too; ``"never"``: only peaks.
        report: Write the report files and print the summary at the end of fit (default True).
        dirpath: Directory for the report (created if missing; only with ``report=True``); default None:
            ``trainer.log_dir``. Checked in ``setup``: a location where no file can be created fails the fit
            before its first step, not after its last.
        max_history: How many per-step records to keep; past it neighbours are merged pairwise, each
            keeping the larger peak (default 2048: a few MiB at most).

    Raises:
        ValueError: If ``log_every_n_steps`` or ``max_history`` is not a positive int, ``breakdown``
            is not one of ``"auto"``, ``"always"``, ``"never"``, or an option is given that the others
            switch off (``log_every_n_steps`` with ``log=False``, ``dirpath`` with ``report=False``).
        TypeError: If ``log`` or ``report`` is not a bool, or ``dirpath`` not a path.
        MisconfigurationException: In ``setup``, if no file can be created in the report's directory.

    Example::

        from lightning.pytorch import Trainer
        from lightning.pytorch.demos.boring_classes import BoringModel
        from lightning.pytorch.loggers import CSVLogger
        from lightning_memopt import MemoryMonitor

        monitor = MemoryMonitor(log_every_n_steps=1)
        trainer = Trainer(max_steps=4, callbacks=[monitor], logger=CSVLogger("logs"))
        trainer.fit(BoringModel())  # logs/lightning_logs/version_0/memory_report.{md,png}
        print(monitor.history[-1]["backward"])  # peak bytes of the last step's backward
    """

    def __init__(
        self,
        *,
        log: bool = True,
        log_every_n_steps: int | None = None,
        breakdown: Literal["auto", "always", "never"] = "auto",
        report: bool = True,
        dirpath: str | os.PathLike | None = None,
        max_history: int = 2048,
    ) -> None:
        check_bool("log", log)
        check_bool("report", report)
        if log_every_n_steps is not None:
            try:
                check_positive_int("log_every_n_steps", log_every_n_steps)
            except ValueError as err:
                raise ValueError(
                    f"{err}; pass e.g. 1 to log every step, or None to follow the Trainer's log_every_n_steps"
                ) from None
            if not log:
                raise ValueError(
                    f"log_every_n_steps={log_every_n_steps} only applies with log=True; drop it or pass log=True"
                )
        if breakdown not in _BREAKDOWN_MODES:
            raise ValueError(f"breakdown must be one of {_BREAKDOWN_MODES}, got {breakdown!r}")
        if isinstance(max_history, bool) or not isinstance(max_history, int) or max_history < 2:
            raise ValueError(f"max_history must be an int >= 2, got {max_history!r}")
        if dirpath is not None:
            if not isinstance(dirpath, (str, os.PathLike)):
                raise TypeError(
                    f"dirpath must be a directory path (str or os.PathLike) or None, got {dirpath!r} "
                    f"({type(dirpath).__name__}); pass e.g. dirpath='logs/memory'"
                )
            if not report:
                raise ValueError(
                    f"dirpath={str(dirpath)!r} only applies with report=True; drop it or pass report=True"
                )
        # Not `self.log`: Lightning binds the module's `log` method onto every callback under that name.
        self.log_enabled = log
        self.log_every_n_steps = log_every_n_steps
        self.breakdown = breakdown
        self.report = report
        self.dirpath = dirpath
        self.max_history = max_history

        self.history = MemoryHistory(max_history)
        """Per-step training records of this rank (see :mod:`lightning_memopt.memory.report`)."""
        self.val_history = MemoryHistory(max_history)
        """One record per validation run, with a ``validation`` phase, of this rank."""
        self.report_paths: list[Path] = []
        """The files written at the end of fit."""

        self._tracker: MemoryTracker | None = None
        self._memory: DeviceMemory | None = None
        self._with_breakdown = False
        self._inside = False  # whether the tracker is entered
        self._record: dict[str, int] | None = None  # the step being measured
        self._phase: str | None = None  # the phase being measured
        self._window: dict[str, int] | None = None  # merged records since the last log
        self._val_record: dict[str, int] | None = None
        self._batches = 0

    # ------------------------------------------------------------------ set-up and tear-down
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.report:
            # Rank zero writes the report: it checks, and every rank raises together (no rank left waiting).
            # trainer.log_dir is itself a collective: every rank asks for it.
            directory = self._report_dir(trainer)
            problem = report_dir_problem(directory) if trainer.is_global_zero else None
            problem = trainer.strategy.broadcast(problem, src=0)
            if problem is not None:
                raise MisconfigurationException(
                    f"MemoryMonitor cannot write its report into {str(directory)!r}: {problem}. "
                    "Pass dirpath= a writable directory, or report=False"
                )
        if self.log_enabled and not trainer.loggers:
            rank_zero_warn(
                "MemoryMonitor: the Trainer has no logger, so the memory/* keys are not logged; the history"
                " and the report are still recorded. Pass a logger (e.g. Trainer(logger=CSVLogger('logs')))"
                " to log them, or MemoryMonitor(log=False) to measure without logging."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After configure_model and strategy.setup: every layer and the optimizers exist now.
        self._start(pl_module.device, pl_module, trainer.optimizers)

    def _start(self, device: torch.device, module: torch.nn.Module, optimizers: list) -> None:
        cuda = torch.device(device).type == "cuda"
        self._with_breakdown = self.breakdown == "always" or (self.breakdown == "auto" and not cuda)
        needs_tracker = not cuda or self._with_breakdown
        self._tracker = MemoryTracker(module, optimizers) if needs_tracker else None
        self._memory = device_memory(device, tracker=self._tracker)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._stop()  # Lightning does not call callbacks' teardown after an exception

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        self._exit()
        # Drop the references to the model and optimizers; the history stays.
        self._tracker = self._memory = None
        self._record = self._val_record = self._window = None
        self._phase = None
        forget_module(self)

    # ------------------------------------------------------------------ training phases
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._memory is None:
            return
        self._exit()  # a batch that ended without on_train_batch_end (on_train_batch_start returned -1)
        self._enter()
        self._record = empty_record(self._batches, PHASES, breakdown=self._with_breakdown)
        self._phase = None
        self._boundary("forward")

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._record is not None:
            self._boundary("backward")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._record is not None:
            self._boundary("optimizer")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._record is None:
            return
        self._boundary(None)
        self._exit()
        record, self._record = self._record, None
        self.history.append(record)
        self._window = record if self._window is None else merge_records([self._window, record])
        self._batches += 1
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if self.log_enabled and self._batches % every == 0:
            window = self._over_ranks(trainer, pl_module, [self._window])[0]
            self._window = None
            self._log(trainer, _train_metrics(window))

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._exit()  # in case the last batch was skipped before on_train_batch_end
        self._record = None

    # ------------------------------------------------------------------ validation
    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._memory is not None and not trainer.sanity_checking:
            self._val_record = empty_record(self._batches, ("validation",), breakdown=self._with_breakdown)

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._val_record is not None:
            self._enter()
            self._reset_peak()

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._val_record is not None:
            self._fold(self._val_record, "validation")
            self._exit()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_record is None:
            return
        self._exit()
        record, self._val_record = self._val_record, None
        self.val_history.append(record)
        if self.log_enabled:
            record = self._over_ranks(trainer, pl_module, [record])[0]
            self._log(trainer, {"memory/val_peak_gib": record["validation"] / _GIB})

    # ------------------------------------------------------------------ report
    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.report or not len(self.history):
            return
        history = self._over_ranks(trainer, pl_module, list(self.history))
        val_history = (
            self._over_ranks(trainer, pl_module, list(self.val_history)) if len(self.val_history) else []
        )
        directory = self._report_dir(trainer)
        if not trainer.is_global_zero:
            return
        device = "CUDA allocator" if not isinstance(self._memory, TrackedMemory) else "live tensor bytes"
        ranks = f", largest over {trainer.world_size} ranks" if trainer.world_size > 1 else ""
        note = f"Measured by MemoryMonitor on {pl_module.device} ({device}{ranks})."
        self.report_paths = write_report(history, directory, val_history=val_history, note=note)
        data = "".join(
            f"\n  {c.summary_line()}" for c in trainer.callbacks if isinstance(c, DataLoaderMonitor)
        )
        rank_zero_info(
            summary(history, val_history) + f"\n  report: {', '.join(map(str, self.report_paths))}" + data
        )

    def _report_dir(self, trainer: pl.Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath is not None else Path(trainer.log_dir or ".")

    # ------------------------------------------------------------------ resuming
    @override
    def state_dict(self) -> dict[str, Any]:
        # Plain ints, so a resumed run continues the step count, the logging windows and the report.
        return {
            "batches": self._batches,
            "history": list(self.history),
            "val_history": list(self.val_history),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._batches = int(state_dict["batches"])
        self.history.records = [dict(r) for r in state_dict["history"]]
        self.val_history.records = [dict(r) for r in state_dict["val_history"]]

    # ------------------------------------------------------------------ internals
    def _enter(self) -> None:
        if self._tracker is not None and not self._inside:
            self._tracker.__enter__()
            self._inside = True

    def _exit(self) -> None:
        if self._tracker is not None and self._inside:
            self._inside = False
            self._tracker.__exit__(None, None, None)

    def _reset_peak(self) -> None:
        self._memory.reset_peak()
        if self._tracker is not None and not isinstance(self._memory, TrackedMemory):
            self._tracker.reset_peak()  # the allocator gives the peaks; the tracker only the breakdown

    def _fold(self, record: dict[str, int], phase: str) -> None:
        breakdown = self._tracker.peak_breakdown if self._with_breakdown else None
        fold_peak(record, phase, self._memory.peak(), breakdown)

    def _boundary(self, next_phase: str | None) -> None:
        """Close the current phase (keep its peak) and start a new peak window for ``next_phase``."""
        if self._phase is not None:
            self._fold(self._record, self._phase)
        self._reset_peak()
        self._phase = next_phase

    def _over_ranks(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, records: list[dict[str, int]]
    ) -> list[dict[str, int]]:
        """Each record merged with the same record of every other rank: one ``all_gather``."""
        if trainer.world_size == 1:
            return records
        keys = list(records[0])
        rows = torch.tensor(
            [[r[k] for k in keys] for r in records], dtype=torch.int64, device=pl_module.device
        )
        gathered = trainer.strategy.all_gather(rows).tolist()  # (world, len(records), len(keys))
        return [
            merge_records([dict(zip(keys, rank[i])) for rank in gathered], same_step=True)
            for i in range(len(records))
        ]

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def _train_metrics(record: dict[str, int]) -> dict[str, float]:
    metrics = {f"memory/{phase}_peak_gib": record[phase] / _GIB for phase in PHASES}
    top = peak_phase(record)
    metrics["memory/peak_gib"] = record[top] / _GIB
    if f"{top}_{CATEGORIES[0]}" in record:
        for category in CATEGORIES:
            metrics[f"memory/peak_{category}_gib"] = record[f"{top}_{category}"] / _GIB
    return metrics
