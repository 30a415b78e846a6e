"""What AutoAccumulation and OOMBackoff share: driving the one micro-batch engine of a Trainer."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_memopt.batching.engine import MicroBatchEngine


class MicroBatchingCallback(Callback):
    """Base of the callbacks that split batches: installs the Trainer's shared engine in ``setup`` and
    removes it in ``teardown``, or in ``on_exception`` when the fit raised (Lightning then skips the
    callbacks' ``teardown``); subclasses configure it in :meth:`_configure`."""

    splits_batches = True  # read (duck-typed) by BatchNormToGroupNorm

    def __init__(self, *, log: bool) -> None:
        self.log_metrics = log  # not `self.log`: Lightning binds the module's log method to every callback
        self._engine: MicroBatchEngine | None = None
        self._holds_install = False  # this callback's install is not undone yet

    @property
    def engine(self) -> MicroBatchEngine | None:
        """The engine this callback drives (set in ``setup``)."""
        return self._engine

    def _configure(self, engine: MicroBatchEngine) -> None:
        """Set this callback's options on the engine, before it is installed."""

    def _installed(self) -> None:
        """Called once the engine is installed (restore sizes from a checkpoint, ...)."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        engine = MicroBatchEngine.for_trainer(trainer)
        if stage == "fit":
            engine.check(trainer, pl_module)
        self._configure(engine)
        engine.log_metrics = engine.log_metrics or self.log_metrics
        engine.install(trainer)
        self._engine = engine
        self._holds_install = True
        self._installed()

    def _release(self) -> None:
        """Undo this callback's install once, whichever of ``teardown`` / ``on_exception`` comes first."""
        if self._engine is not None and self._holds_install:
            self._holds_install = False
            self._engine.uninstall()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning calls on_exception, not teardown, when fit raises: the strategy must not stay wrapped.
        self._release()
