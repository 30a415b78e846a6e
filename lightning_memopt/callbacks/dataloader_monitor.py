"""DataLoaderMonitor: is the accelerator waiting for data? Measure the input stalls and name the fix."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_memopt._checks import check_bool, check_positive_int
from lightning_memopt.callbacks._hooks import ReleasingCallback, wrap_instance_hook
from lightning_memopt.callbacks._output import info
from lightning_memopt.callbacks._train_loaders import (
    dataloaders,
    expected_epochs,
    on_train_loaders,
    set_workers,
)
from lightning_memopt.data import (
    Diagnosis,
    LoaderSettings,
    StallMeter,
    StepTimes,
    TuneResult,
    batch_cost,
    check_picklable,
    cores_per_rank,
    diagnose,
    step_clock,
    tune_num_workers,
)

__all__ = ["DataLoaderMonitor"]


class DataLoaderMonitor(ReleasingCallback):
    r"""Measure how long each training step waits for its batch, and say which DataLoader setting fixes it.

    A loop whose data loading is slower than its forward-backward is *data-bound*: a faster accelerator,
    a larger micro-batch or less recompute changes nothing while the step waits for input. Per training
    step the monitor measures (see :mod:`lightning_memopt.data.stall`):

    - **wait**: from the end of one step (``on_train_batch_end``) to the start of the next
      (``on_train_batch_start``), less the transfer: fetching the next batch from the DataLoader;
    - **transfer**: the LightningModule's ``transfer_batch_to_device`` (not separated when a
      LightningDataModule overrides that hook: then it counts as wait);
    - **compute**: ``on_train_batch_start`` → ``on_train_batch_end``.

    On CUDA the marks are CUDA events, read (one synchronization) only at logging points and window ends,
    so the loop never waits for the monitor; elsewhere they are host times. Not counted: the first step
    of a fit (its batch comes with the workers' start-up) and the gap over validation. Hooks of callbacks
    listed after this one run inside the wait (list it last for the cleanest numbers).

    When the wait fraction of a ``window`` of steps exceeds ``threshold``, rank zero warns once: how
    data-bound the loop is and the changes computed from the DataLoader and the machine
    (:mod:`lightning_memopt.data.diagnosis`; one batch is loaded once in the main process to measure its
    cost: waits the DataLoader does not explain are not called data-bound). Before any worker starts, a DataLoader whose workers start by pickling
    (``spawn``/``forkserver``) is checked; an object that will not pickle is named by its path
    (``dataset.transform is a lambda ...``) in a ``pickle.PicklingError``. With ``MemoryMonitor``, its
    end-of-fit summary gets one line: data-bound or not.

    **Logged keys** (through every logger, at ``step=trainer.global_step``; means per step over the timed
    steps since the last log; measured on every rank, written by the loggers of rank zero):

    ========================  ====  ============================================================
    key                       unit  meaning
    ========================  ====  ============================================================
    ``data/wait_ms``          ms    waiting for the next batch
    ``data/transfer_ms``      ms    moving the batch to the device
    ``data/compute_ms``       ms    the training step
    ``data/wait_fraction``    1     (wait + transfer) / (wait + transfer + compute), in [0, 1]
    ========================  ====  ============================================================

    Args:
        threshold: Wait fraction above which a window counts as data-bound (default 0.1), in (0, 1).
        window: Steps judged together (default 20).
        tune: Before training (default False), time the first ``tune_batches`` batches of the training
            DataLoader alone at a few ``num_workers`` values (:func:`~lightning_memopt.data.tune_num_workers`),
            set the fastest on it and print the table. Which samples are seen, and their order, stay.
        tune_batches: Batches timed per candidate when tuning (default 16).
        log_every_n_steps: Log every this many training batches; default None: the Trainer's.
        log: Log the ``data/*`` keys (default True); False still measures, warns and summarizes.

    Raises:
        ValueError: If ``threshold`` is not in (0, 1), ``window``, ``tune_batches`` or
            ``log_every_n_steps`` is not a positive int.
        TypeError: If ``tune`` or ``log`` is not a bool.
        pickle.PicklingError: At fit start, when the training DataLoader's workers cannot be started.

    Example::

        from lightning.pytorch import Trainer
        from lightning.pytorch.demos.boring_classes import BoringModel
        from lightning_memopt import DataLoaderMonitor

        monitor = DataLoaderMonitor()
        Trainer(max_steps=50, callbacks=[monitor]).fit(BoringModel())
        print(monitor.summary_line())  # "data: not data-bound, wait fraction 0.29 over 49 steps (...)"
    """

    def __init__(
        self,
        *,
        threshold: float = 0.1,
        window: int = 20,
        tune: bool = False,
        tune_batches: int = 16,
        log_every_n_steps: int | None = None,
        log: bool = True,
    ) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < 1:
            raise ValueError(
                f"threshold must be a fraction in (0, 1), got {threshold!r}; e.g. 0.1 flags a loop that spends "
                "more than 10% of its time waiting for data"
            )
        check_positive_int("window", window)
        check_positive_int("tune_batches", tune_batches)
        if log_every_n_steps is not None:
            check_positive_int("log_every_n_steps", log_every_n_steps)
        check_bool("tune", tune)
        check_bool("log", log)
        self.log_metrics = log  # not `self.log`: Lightning binds the module's log method onto callbacks
        self.threshold = float(threshold)
        self.window = window
        self.tune = tune
        self.tune_batches = tune_batches
        self.log_every_n_steps = log_every_n_steps

        self.times = StepTimes()
        """All timed steps of the fit (this rank)."""
        self.diagnosis: Diagnosis | None = None
        """The diagnosis of the last judged window."""
        self.tune_results: list[TuneResult] = []
        """The tables measured with ``tune=True``, one per training DataLoader."""

        self._meter: StallMeter | None = None
        self._loader: DataLoader | None = None  # the training DataLoader, during fit
        self._batch_cost: float | None = None  # seconds to load one batch in one process, once measured
        self._settings = LoaderSettings()
        self._machine: dict[str, Any] = {"cores": 1}  # diagnose()'s cores, device_type, epochs
        self._log_window = StepTimes()
        self._judge_window = StepTimes()
        self._batches = 0  # training batches seen in this fit
        self._warned = False
        self._removers: list[Callable[[], None]] = []  # undo what was wrapped, at teardown

    # ------------------------------------------------------------------ before any worker starts
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        remove = on_train_loaders(trainer, self._prepare)
        if remove is None:
            rank_zero_warn("DataLoaderMonitor: no DataLoader source found; no pickling check or tune")
        self._removers.append(remove or (lambda: None))

    def _prepare(self, loaders: Any) -> None:
        # Called again when Lightning reloads the DataLoaders: check again, tune only the first time.
        tuned = bool(self.tune_results)
        for i, loader in enumerate(dataloaders(loaders)):
            check_picklable(loader)
            if self.tune and not tuned:
                self._tune(loader)
            if i < len(self.tune_results):
                set_workers(loader, self.tune_results[i].best)

    def _tune(self, loader: DataLoader) -> None:
        try:
            result = tune_num_workers(loader, batches=self.tune_batches)
        except ValueError as error:
            rank_zero_warn(f"DataLoaderMonitor: not tuned: {error}")
            return
        self.tune_results.append(result)
        info(f"DataLoaderMonitor: num_workers={result.best} (measured):\n{result.table()}")

    # ------------------------------------------------------------------ set-up and tear-down
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        meter = self._meter = StallMeter(step_clock(pl_module.device))
        cores = cores_per_rank(trainer.num_devices if trainer.world_size > 1 else 1)
        self._machine = {"cores": cores, "device_type": pl_module.device.type}
        self._batches = 0
        self._removers.append(
            wrap_instance_hook(
                pl_module,
                "transfer_batch_to_device",
                before=lambda *args, **kwargs: meter.transfer_start(),
                after=meter.transfer_end,
            )
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = dataloaders(trainer.train_dataloader)
        self._loader = loaders[0] if loaders else None
        self._settings = LoaderSettings.of(self._loader)
        self._machine["epochs"] = expected_epochs(trainer)

    @override
    def _release(self) -> None:
        while self._removers:
            self._removers.pop()()
        self._meter = self._loader = None

    # ------------------------------------------------------------------ the marks
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # From the second epoch on, the wait includes the DataLoader's iter() (workers restarting).
        if self._meter is not None and self._batches > 0:
            self._meter.wait_from_now(epoch_start=True)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._meter is not None:
            self._meter.step_start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._meter is None:
            return
        self._meter.step_end()
        self._batches += 1
        log_now = self._batches % (self.log_every_n_steps or trainer.log_every_n_steps) == 0
        if log_now or self._judge_window.steps + self._meter.pending >= self.window:
            self._read()
        if log_now and self._log_window.steps and self.log_metrics:
            metrics = {f"data/{key}": value for key, value in self._log_window.as_metrics().items()}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            self._log_window = StepTimes()
        if self._judge_window.steps >= self.window:
            self._judge(self._judge_window)
            self._judge_window = StepTimes()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._meter is not None:
            self._meter.stop_waiting()  # validation is not waiting for training data

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._meter is not None and self._batches > 0 and not trainer.sanity_checking:
            self._meter.wait_from_now()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._meter is not None:
            self._read()  # the steps after the last window, for the fit's summary

    # ------------------------------------------------------------------ judging
    def _read(self) -> None:
        times = self._meter.read()
        for window in (self._log_window, self._judge_window, self.times):
            window.add(times)

    def _diagnose(self, times: StepTimes) -> Diagnosis:
        return diagnose(
            times, self._settings, threshold=self.threshold, batch_cost=self._batch_cost, **self._machine
        )

    def _judge(self, times: StepTimes) -> None:
        self.diagnosis = self._diagnose(times)
        if self.diagnosis.data_bound and self._loader is not None and self._batch_cost is None:
            # Once: one batch loaded here, as a worker would: is the DataLoader why, and how many workers?
            self._batch_cost = batch_cost(self._loader)
            self._meter.wait_from_now()  # that loading is not the loop's wait
            self.diagnosis = self._diagnose(times)
        if self.diagnosis.data_bound and not self._warned:
            self._warned = True
            rank_zero_warn(f"DataLoaderMonitor: {self.diagnosis.message()}")

    def summary_line(self) -> str:
        """One line on the whole fit so far: data-bound or not, and the fix (for end-of-fit summaries)."""
        if not self.times.steps:
            return "data: not measured (no timed training steps)"
        return self._diagnose(self.times).summary_line()

    # ------------------------------------------------------------------ resuming
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"warned": self._warned, "times": asdict(self.times)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._warned = bool(state_dict["warned"])
        self.times = StepTimes(**state_dict["times"])
