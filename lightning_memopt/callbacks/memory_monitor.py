"""MemoryMonitor: peak memory of every training step by phase and category, logged and reported."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memopt._checks import check_bool, check_positive_int
from lightning_memopt.callbacks._hooks import ReleasingCallback
from lightning_memopt.callbacks.dataloader_monitor import DataLoaderMonitor
from lightning_memopt.head.causal_lm import check_output_head, output_heads
from lightning_memopt.memory.phases import Breakdown, StepPeaks, merge_across_ranks, record_metrics
from lightning_memopt.memory.report import (
    MemoryHistory,
    check_dirpath,
    report_dir_problem,
    summary,
    write_report,
)
from lightning_memopt.memory.tracker import MemoryTracker

__all__ = ["MemoryMonitor"]


class MemoryMonitor(ReleasingCallback):
    r"""Record the peak memory of every training step by phase and category, log it, and write a report.

    Each training step is cut at public Lightning hooks into three phases: ``forward``
    (``on_train_batch_start`` → ``on_before_backward``: ``training_step`` and ``zero_grad``), ``backward``
    (→ ``on_before_optimizer_step``, or the end of an accumulating batch; with micro-batching by
    ``AutoAccumulation`` or ``OOMBackoff``, also each micro-batch's backward, which runs inside
    ``training_step``) and ``optimizer`` (→
    ``on_train_batch_end``: clipping and ``optimizer.step()``; 0 on accumulating batches). For each phase it
    keeps the peak bytes and, with a breakdown, the bytes of each category of
    :class:`~lightning_memopt.memory.MemoryTracker` at that peak; validation runs are measured apart.
    Off CUDA the peaks are exact live tensor bytes from a tracker entered for each batch (it slows a small
    CPU model's fit about 1.9x); on CUDA they come from the caching allocator, for free. The plain-torch
    core is :class:`~lightning_memopt.memory.phases.StepPeaks`; details: ``docs/callbacks/memory_monitor.md``.

    **Logged keys** (with ``log=True``, through every logger, at ``step=trainer.global_step``; each value
    is the largest of the steps since the last log (the seconds: their mean), and under a distributed
    strategy the largest of all ranks, with one ``all_gather`` per log):

    ===================================  ===  =================================================================
    key                                  unit meaning
    ===================================  ===  =================================================================
    ``memory/forward_peak_gib``          GiB  peak of the forward phase
    ``memory/backward_peak_gib``         GiB  peak of the backward phase
    ``memory/optimizer_peak_gib``        GiB  peak of the optimizer phase
    ``memory/peak_gib``                  GiB  peak of the whole step (the largest of the three)
    ``memory/peak_<category>_gib``       GiB  bytes of ``<category>`` at that peak (with a breakdown; the
                                              five values sum to ``memory/peak_gib``)
    ``memory/peak_head_gib``             GiB  of those, the bytes the output head created (with a breakdown
                                              and a head; a part of ``activations`` and ``other``)
    ``memory/val_peak_gib``              GiB  peak over the batches of one validation run (logged at its end)
    ``memory/step_seconds``              s    a training step's time, the mean over the steps since the last
                                              log (with a head; the longest of the ranks')
    ``memory/head_seconds``              s    of it, the output head's: its forward, the loss and their
                                              backward (with a head; mean, longest of the ranks')
    ===================================  ===  =================================================================

    GiB means ``bytes / 2**30``. At the end of fit rank zero writes ``memory_report.md`` (and, with
    matplotlib, ``.png``) into ``trainer.log_dir`` or ``dirpath`` and prints a summary. After ``fit``,
    finished or failed, the callback holds no reference to the model and no tracker stays entered.

    Args:
        log: Log the keys above (default True). False: nothing is logged (and no ``all_gather`` runs for
            it); :attr:`history` and, with ``report=True``, the report are still written.
        log_every_n_steps: Log every this many training batches (the window the peaks cover). Default
            None: the Trainer's ``log_every_n_steps``. Only with ``log=True``.
        breakdown: ``"auto"`` (default): bytes by category where the tracker runs anyway (not on CUDA);
            ``"always"``: on CUDA too, by running the tracker there; ``"never"``: only peaks.
        report: Write the report files and print the summary at the end of fit (default True).
        dirpath: Directory for the report (created if missing; only with ``report=True``); default None:
            ``trainer.log_dir``. Checked in ``setup``: if no file can be created there, the fit fails first.
        max_history: How many per-step records to keep; past it neighbours are merged pairwise, each
            keeping the larger peak (default 2048: a few MiB at most).
        head: The output head, counted on its own line (``<phase>_head`` in the records,
            ``memory/peak_head_gib``; what counts: :class:`~lightning_memopt.memory.MemoryTracker`).
            ``"auto"`` (default): each Hugging Face causal LM's output embeddings (``lm_head``), also
            when ``AutoCheckpoint`` computes its loss chunk by chunk; a submodule's name; None: none.
            With a head, each step and the head in it are also timed on the device's clock
            (:class:`~lightning_memopt.memory.head_time.HeadTimer`; read at each log, every 64 steps
            and at the end of fit, so on CUDA the loop never waits at a step's end; on a CPU the step
            runs tracked, which slows every op), logged and in the summary.

    Raises:
        ValueError: If ``log_every_n_steps`` or ``max_history`` is not a positive int, ``breakdown``
            is not one of ``"auto"``, ``"always"``, ``"never"``, or an option is given that the others
            switch off (``log_every_n_steps`` with ``log=False``, ``dirpath`` with ``report=False``).
        TypeError: If ``log`` or ``report`` is not a bool, ``dirpath`` not a path, or ``head`` not a str.
        MisconfigurationException: In ``setup``, if no file can be created in the report's directory; at
            fit start, if ``head`` names no submodule.

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
        breakdown: Breakdown = "auto",
        report: bool = True,
        dirpath: str | os.PathLike | None = None,
        max_history: int = 2048,
        head: str | None = "auto",
    ) -> None:
        check_bool("log", log)
        check_bool("report", report)
        self.head = check_output_head(head)
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
        self._peaks = StepPeaks(max_history, breakdown=breakdown)  # records; a recorder while fitting
        if dirpath is not None:
            check_dirpath(dirpath)
            if not report:
                raise ValueError(
                    f"dirpath={str(dirpath)!r} only applies with report=True; drop it or pass report=True"
                )
        # Not `self.log`: Lightning binds the module's `log` method onto every callback under that name.
        self.log_metrics = log
        self.log_every_n_steps = log_every_n_steps
        self.breakdown = breakdown
        self.report = report
        self.dirpath = dirpath
        self.max_history = max_history

        self.history: MemoryHistory = self._peaks.train
        """Per-step training records of this rank (see :mod:`lightning_memopt.memory.report`); their times
        (with a head) are filled in at each log, every 64 steps and at the end of fit."""
        self.val_history: MemoryHistory = self._peaks.validation
        """One record per validation run, with a ``validation`` phase, of this rank."""
        self.report_paths: list[Path] = []
        """The files written at the end of fit."""

    # ------------------------------------------------------------------ set-up and tear-down
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.report:
            directory = self._report_dir(trainer)  # trainer.log_dir is a collective: every rank asks
            # Rank zero writes the report, so it checks; every rank raises together (none left waiting).
            problem = report_dir_problem(directory) if trainer.is_global_zero else None
            problem = trainer.strategy.broadcast(problem, src=0)
            if problem is not None:
                raise MisconfigurationException(
                    f"MemoryMonitor cannot write its report into {str(directory)!r}: {problem}. "
                    "Pass dirpath= a writable directory, or report=False"
                )
        if self.log_metrics and not trainer.loggers:
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
        try:  # a name is looked up now that configure_model has built every layer
            self._peaks.begin(device, module, optimizers, output_heads(module, self.head))
        except ValueError as err:
            raise MisconfigurationException(f"MemoryMonitor: {err}") from None

    @property
    def _tracker(self) -> MemoryTracker | None:  # where one runs: not on CUDA without a breakdown
        return self._peaks.recorder.tracker if self._peaks.recorder is not None else None

    @override
    def _release(self) -> None:
        self._peaks.end()  # drops the references to the model and optimizers; the history stays

    # ------------------------------------------------------------------ training phases
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._peaks.step_start()

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self._peaks.phase("backward")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._peaks.phase("optimizer")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._peaks.step_end() or not self.log_metrics:
            return
        if self._peaks.steps % (self.log_every_n_steps or trainer.log_every_n_steps) == 0:
            self._log(trainer, pl_module, self._peaks.take_window())

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._peaks.drop_step()  # in case the last batch was skipped before on_train_batch_end

    # ------------------------------------------------------------------ validation
    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._peaks.validation_start()

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._peaks.validation_batch_start()

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
        self._peaks.validation_batch_end()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = self._peaks.validation_end()
        if record is not None and self.log_metrics:
            self._log(trainer, pl_module, record)

    # ------------------------------------------------------------------ report
    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._peaks.read_times()  # the last steps' times, into their records
        if not self.report or not len(self.history):
            return
        history = self._over_ranks(trainer, pl_module, list(self.history))
        val_history = self._over_ranks(trainer, pl_module, list(self.val_history))
        directory = self._report_dir(trainer)
        if not trainer.is_global_zero:
            return
        source = self._peaks.recorder.source if self._peaks.recorder is not None else "unknown source"
        ranks = f", largest over {trainer.world_size} ranks" if trainer.world_size > 1 else ""
        note = f"Measured by MemoryMonitor on {pl_module.device} ({source}{ranks})."
        self.report_paths = write_report(history, directory, val_history=val_history, note=note)
        lines = [summary(history, val_history), f"report: {', '.join(map(str, self.report_paths))}"]
        lines += [c.summary_line() for c in trainer.callbacks if isinstance(c, DataLoaderMonitor)]
        rank_zero_info("\n  ".join(lines))

    def _report_dir(self, trainer: pl.Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath is not None else Path(trainer.log_dir or ".")

    # ------------------------------------------------------------------ resuming
    @override
    def state_dict(self) -> dict[str, Any]:
        return self._peaks.state_dict()  # plain values: a resumed run continues steps, windows, report

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._peaks.load_state_dict(state_dict)

    def _over_ranks(self, trainer: pl.Trainer, pl_module: pl.LightningModule, records: list) -> list:
        if trainer.world_size == 1 or not records:
            return records
        return merge_across_ranks(records, trainer.strategy.all_gather, pl_module.device)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: dict[str, int]) -> None:
        """Log the record's keys, merged over ranks first (every rank calls this: an ``all_gather``)."""
        values = record_metrics(self._over_ranks(trainer, pl_module, [record])[0])
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)
