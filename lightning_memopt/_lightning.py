"""Every Lightning name this package relies on beyond the Callback API, in one list.

Lightning has no public hook for some of what the package needs; each name it reads or replaces anyway
is in :data:`LIGHTNING_NAMES`, with why, and ``tests/test_lightning.py`` checks that the installed
Lightning still has every one, so an upgrade that renames one fails a test rather than a user's fit.
The micro-batch engine's names, and why it needs each, are in
:data:`lightning_memopt.batching.surface.LIGHTNING_SURFACE`; the rest are below.
"""

from __future__ import annotations

import dataclasses
import inspect

from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource

from lightning_memopt.batching.surface import LIGHTNING_SURFACE

__all__ = ["LIGHTNING_NAMES", "has_name"]

#: Every (object, attribute) pair the package relies on: the engine's, then the callbacks'. Tested.
LIGHTNING_NAMES = LIGHTNING_SURFACE + (
    # DataLoaderMonitor (callbacks/_train_loaders.py): Lightning requests the training DataLoaders and
    # starts their workers in one step of the fit loop, with no hook between; the loop's data source (the
    # loaders given to fit, or the LightningModule/DataModule whose train_dataloader it will call) is
    # the only place to check they pickle, or tune num_workers, before any worker starts.
    (_FitLoop, "_data_source"),
    (_DataLoaderSource, "instance"),
    # AutoCheckpoint (callbacks/auto_checkpoint.py): steps aside when FSDPStrategy already checkpoints
    # activations (its activation_checkpointing_policy), so no block is checkpointed twice.
    (FSDPStrategy, "_activation_checkpointing_kwargs"),
)


def has_name(owner: type, name: str) -> bool:
    """Whether instances of ``owner`` have attribute ``name``: a class attribute, a dataclass field, or
    an attribute its ``__init__`` assigns (``self.<name> =``)."""
    if hasattr(owner, name):
        return True
    if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
        return True
    return f"self.{name} =" in inspect.getsource(owner.__init__)
