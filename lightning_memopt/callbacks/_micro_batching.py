"""The one owner of a fit's micro-batch engine; AutoAccumulation and OOMBackoff are its two configurations.

The first micro-batching callback in ``trainer.callbacks`` owns the engine and the saved state; each adds
its options at ``setup`` (no registry: the callback list is where they find each other). The options both
take (``count_fn``, ``split_fn``, ``length_fn``, ``exactness``) must agree where both are given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_memopt._checks import check_bool
from lightning_memopt.batching.engine import Exactness, MicroBatchEngine
from lightning_memopt.batching.exactness import batchnorms, causes
from lightning_memopt.batching.sizes import MicroBatchSizes
from lightning_memopt.batching.surface import check_setup
from lightning_memopt.callbacks._hooks import ReleasingCallback
from lightning_memopt.checkpointing.auto import AutoCheckpointer

__all__ = ["MicroBatching", "engine_of"]

# The options every micro-batching callback takes, with the call each must accept (for error messages).
_SHARED = {
    "count_fn": "count_fn(micro_batch) -> number of items the loss averages over, or 'sum'",
    "split_fn": "split_fn(batch, sizes) -> list of micro-batches",
    "length_fn": "length_fn(batch) -> tokens per sample",
}
_EXACTNESS = get_args(Exactness)


class MicroBatching(ReleasingCallback):
    """Base of the callbacks that split batches (see the module docstring)."""

    splits_batches = True  # read (duck-typed) by BatchNormToGroupNorm
    splits_from_the_start = False  # AutoAccumulation: every batch may be split, not only after an OOM

    def __init__(
        self,
        *,
        log: bool,
        count_fn: Callable[[Any], float] | Literal["sum"] | None = None,
        split_fn: Callable[[Any, list[int]], list[Any]] | None = None,
        length_fn: Callable[[Any], int] | None = None,
        exactness: Exactness = "warn",
    ) -> None:
        check_bool("log", log)
        for name, fn in (("count_fn", count_fn), ("split_fn", split_fn), ("length_fn", length_fn)):
            if fn is not None and not callable(fn) and not (name == "count_fn" and fn == "sum"):
                raise TypeError(f"{name} must be a callable, {_SHARED[name]}, or None; got {fn!r}")
        if exactness not in _EXACTNESS:
            raise ValueError(
                f"exactness must be one of {_EXACTNESS} (check once that a split step gives the unsplit gradient "
                f"and warn / raise when it does not, or do not check), got {exactness!r}"
            )
        self.log_metrics = log  # not `self.log`: Lightning binds the module's log method to every callback
        self.count_fn, self.split_fn, self.length_fn = count_fn, split_fn, length_fn
        self.exactness = exactness
        self._engine: MicroBatchEngine | None = None  # the group's one engine (kept readable after the fit)
        self._owner: MicroBatching | None = None  # during a run: the callback that owns the engine
        self._loaded: list[dict[str, Any]] = []  # states restored before the engine existed

    def _options(self, trainer: pl.Trainer) -> tuple[dict[str, Any], dict[str, Any]]:
        """This configuration's options of :class:`~lightning_memopt.batching.sizes.MicroBatchSizes` and of
        :class:`~lightning_memopt.batching.engine.MicroBatchEngine`."""
        return {}, {}

    @property
    def engine(self) -> MicroBatchEngine | None:
        """The engine that splits this fit's batches (the owner's), once set up."""
        return self._engine

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per training micro-batch now; None runs the whole batch."""
        return None if self._engine is None else self._engine.sizes.micro_batch_size

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        group = [cb for cb in trainer.callbacks if isinstance(cb, MicroBatching)]
        if stage == "fit":
            check_setup(trainer, pl_module)
            _refuse_schedulers(trainer)
        owner = self._owner = group[0]
        if self is owner:
            if self._engine is None:
                self._engine = self._build(trainer, group)
            for cb in group:  # states restored before the engine existed
                for state in cb._loaded:
                    self._load(state)
                cb._loaded = []
            if stage != "fit":
                self._engine.install(trainer)
        else:
            self._engine = owner._engine  # the owner is set up first: it comes first in trainer.callbacks

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # At fit start, not in setup: Lightning runs a BatchSizeFinder's trial steps in its on_fit_start,
        # before ours (tuner callbacks come first), and they must see their out-of-memory errors.
        if self._owner is not self or self._engine is None or self._engine.installed:
            return
        self._engine.install(trainer)
        # BatchNorm is known before the first step (BatchNormToGroupNorm has swapped it by now): said now
        # where batches will be split, every rank alike.
        batchnorm = batchnorms(pl_module)
        self._engine.sizes.done = _in_place(trainer, batchnorm=bool(batchnorm))
        splits = any(cb.splits_from_the_start for cb in trainer.callbacks if isinstance(cb, MicroBatching))
        if batchnorm and splits and self._engine.exactness != "off":
            self._engine.report_inexact(causes(batchnorm=batchnorm, written=[], unexplained=False))

    def _build(self, trainer: pl.Trainer, group: list[MicroBatching]) -> MicroBatchEngine:
        sizes: dict[str, Any] = {}
        options: dict[str, Any] = {"log_metrics": any(cb.log_metrics for cb in group)}
        for cb in group:
            cb_sizes, cb_options = cb._options(trainer)
            sizes.update(cb_sizes)
            options.update(cb_options)
        for name in (*_SHARED, "exactness"):
            options[name] = _agreed(group, name)
        return MicroBatchEngine(MicroBatchSizes(**sizes), **options)

    @override
    def _release(self) -> None:
        if self._owner is self and self._engine is not None:
            self._engine.uninstall()
        self._owner = None

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        if self._engine is None or self._owner not in (None, self):
            return {}  # the owner saves the group's one state
        sizes = self._engine.sizes
        return {
            "micro_batch_size": sizes.samples("tokens"),  # in samples of the last batch (for reading)
            "tokens_per_sample": sizes.probed_width,  # of the probed batch
            "sizes": sizes.state(),
            "checked": sorted(self._engine.checked_keys),  # a resumed fit does not check them again
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        owner = self._owner or self
        if owner._engine is None:
            self._loaded.append(state_dict)
        else:
            owner._load(state_dict)

    def _load(self, state: dict[str, Any]) -> None:
        sizes = self._engine.sizes
        if "sizes" in state:  # the owner's (another callback of the group saves {})
            sizes.load(state["sizes"])
            self._engine.checked_keys.update(state["checked"])


def _agreed(group: list[MicroBatching], name: str) -> Any:
    """The one value of the shared option ``name`` given to the callbacks (its default if none was)."""
    default = "warn" if name == "exactness" else None
    given = [(type(cb).__name__, getattr(cb, name)) for cb in group]
    given = [(owner, value) for owner, value in given if value != default]
    if len({id(value) if callable(value) else value for _, value in given}) > 1:
        listed = ", ".join(f"{owner}({name}={value!r})" for owner, value in given)
        raise MisconfigurationException(
            f"{listed}: the micro-batching callbacks share one engine and one {name}; pass it to one of them "
            "(or the same value to both)"
        )
    return given[0][1] if given else default


def _refuse_schedulers(trainer: pl.Trainer) -> None:
    """Refuse at setup an accumulation schedule, which would otherwise fail only when it is reached."""
    for cb in trainer.callbacks:
        if isinstance(cb, GradientAccumulationScheduler):
            raise MisconfigurationException(
                f"GradientAccumulationScheduler(scheduling={cb.scheduling}) with micro-batching: the engine "
                "accumulates within each batch and Lightning's accumulation must stay 1. Make the DataLoader "
                "batch the optimizer batch for each phase instead (micro-batching splits it to fit memory)"
            )


def engine_of(trainer: pl.Trainer) -> MicroBatchEngine | None:
    """The engine splitting ``trainer``'s training batches, if a micro-batching callback installed one."""
    for cb in trainer.callbacks:
        if isinstance(cb, MicroBatching):
            engine = cb.engine
            return engine if engine is not None and engine.installed else None
    return None


def _in_place(trainer: pl.Trainer, *, batchnorm: bool) -> frozenset[str]:
    """What the fit already does of the out-of-memory advice (:func:`~lightning_memopt.batching.errors.checklist`):
    half precision, ``AutoCheckpoint``, no BatchNorm to swap, sharding; its errors leave these out."""
    done = {
        "precision": trainer.precision not in ("32-true", "64-true"),
        "checkpointing": any(isinstance(cb, AutoCheckpointer) for cb in trainer.callbacks),
        "batchnorm": not batchnorm,
        "sharding": isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)),
    }
    return frozenset(key for key, value in done.items() if value)
