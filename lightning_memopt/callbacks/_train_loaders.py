"""Where the training DataLoaders come from, and acting on them before Lightning starts their workers.

Lightning 2.x requests the training DataLoaders and iterates them in one step of its fit loop;
:func:`on_train_loaders` reaches them earlier through the fit loop's ``_data_source`` (listed in
:data:`lightning_memopt._lightning.LIGHTNING_NAMES`, checked by a test).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from lightning_memopt._patch import patch

__all__ = ["on_train_loaders", "dataloaders", "expected_epochs", "set_workers"]


def on_train_loaders(trainer: pl.Trainer, inspect: Callable[[Any], None]) -> Callable[[], None] | None:
    """Call ``inspect`` with the training DataLoaders before any worker starts (call at ``setup``).

    Returns the function that undoes the hook wrapping (call it at teardown), or None if the source
    cannot be found (a Lightning version without ``fit_loop._data_source``).
    """
    # Both names are in LIGHTNING_NAMES; getattr with a default so that, if one is gone, the monitor warns
    # and skips the check instead of failing the fit.
    source = getattr(getattr(trainer.fit_loop, "_data_source", None), "instance", None)
    if isinstance(source, (pl.LightningModule, pl.LightningDataModule)):
        return _on_result(source, "train_dataloader", inspect)
    if source is None:
        return None
    inspect(source)
    return lambda: None


def dataloaders(loaders: Any) -> list[DataLoader]:
    """The DataLoaders inside what a ``train_dataloader`` hook may return (a loader or a collection)."""
    if isinstance(loaders, CombinedLoader):
        loaders = loaders.flattened
    if isinstance(loaders, DataLoader):
        return [loaders]
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        return [found for item in loaders for found in dataloaders(item)]
    return []


def expected_epochs(trainer: pl.Trainer) -> int | None:
    """Epochs the fit will run (None if unknown): workers restart per epoch only when there are several."""
    epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else None
    batches = trainer.num_training_batches
    if trainer.max_steps > 0 and batches not in (0, float("inf")):
        by_steps = math.ceil(trainer.max_steps * trainer.accumulate_grad_batches / batches)
        epochs = by_steps if epochs is None else min(epochs, by_steps)
    return epochs


def set_workers(loader: DataLoader, workers: int) -> None:
    loader.num_workers = workers  # DataLoader allows this one to change before it is iterated
    if workers > 0 and loader.prefetch_factor is None:
        loader.prefetch_factor = 2  # what DataLoader(num_workers>0) would have set


def _on_result(obj: Any, name: str, inspect: Callable[[Any], None]) -> Callable[[], None]:
    """Make ``obj.name(...)`` pass its result to ``inspect`` before returning it; returns the undo."""

    def wrapper(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        inspect(result)
        return result

    return patch(obj, name, wrapper)
