"""What AutoAccumulation and OOMBackoff share: driving the one micro-batch engine of a Trainer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_memopt._checks import check_bool
from lightning_memopt.batching.engine import MicroBatchEngine
from lightning_memopt.callbacks._hooks import ReleasingCallback

# The options both callbacks take, with the call each must accept (for error messages).
_SHARED = {
    "count_fn": "count_fn(micro_batch) -> number of items the loss averages over",
    "split_fn": "split_fn(batch, sizes) -> list of micro-batches",
    "length_fn": "length_fn(batch) -> tokens per sample",
}


class MicroBatchingCallback(ReleasingCallback):
    """Base of the callbacks that split batches: installs the Trainer's shared engine in ``setup`` and
    removes it in ``teardown``, or in ``on_exception`` when the fit raised (Lightning then skips the
    callbacks' ``teardown``); subclasses configure it in :meth:`_configure`.

    ``count_fn``, ``split_fn`` and ``length_fn`` are options of the one engine both callbacks drive: either callback may
    take them; given to both, they must be the same object.
    """

    splits_batches = True  # read (duck-typed) by BatchNormToGroupNorm

    def __init__(
        self,
        *,
        log: bool,
        count_fn: Callable[[Any], float] | None = None,
        split_fn: Callable[[Any, list[int]], list[Any]] | None = None,
        length_fn: Callable[[Any], int] | None = None,
    ) -> None:
        check_bool("log", log)
        for name, fn in (("count_fn", count_fn), ("split_fn", split_fn), ("length_fn", length_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a callable, {_SHARED[name]}, or None; got {fn!r}")
        self.log_metrics = log  # not `self.log`: Lightning binds the module's log method to every callback
        self.count_fn = count_fn
        self.split_fn = split_fn
        self.length_fn = length_fn
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
        for name in _SHARED:
            setattr(engine, name, _shared_option(trainer, name))
        self._configure(engine)
        engine.log_metrics = engine.log_metrics or self.log_metrics
        engine.install(trainer)
        self._engine = engine
        self._holds_install = True
        self._installed()

    @override
    def _release(self) -> None:
        """Undo this callback's install once, whichever of ``teardown`` / ``on_exception`` comes first."""
        if self._engine is not None and self._holds_install:
            self._holds_install = False
            self._engine.uninstall()


def _shared_option(trainer: pl.Trainer, name: str) -> Any:
    """The one value of ``name`` given to the Trainer's micro-batching callbacks (None if none was)."""
    given = [
        (type(cb).__name__, getattr(cb, name))
        for cb in trainer.callbacks
        if isinstance(cb, MicroBatchingCallback)
    ]
    given = [(owner, value) for owner, value in given if value is not None]
    if len({id(value) for _, value in given}) > 1:
        listed = ", ".join(f"{owner}({name}={value!r})" for owner, value in given)
        raise MisconfigurationException(
            f"{listed}: the micro-batching callbacks share one engine and one {name}; pass it to one of them "
            "(or the same function to both)"
        )
    return given[0][1] if given else None
