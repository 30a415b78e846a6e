"""Lightning's private names this package reads outside the micro-batching engine, in one list.

Lightning has no public hook for some of what the callbacks need; each name they read anyway is listed in
:data:`LIGHTNING_NAMES`, with why, and ``tests/test_lightning.py`` checks that the installed Lightning
still has every one, so an upgrade that renames one fails a test rather than a user's fit. The engine's
own names are in :data:`lightning_memopt.batching.engine.LIGHTNING_SURFACE`.
"""

from __future__ import annotations

import dataclasses
import inspect

from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource

__all__ = ["LIGHTNING_NAMES", "has_name"]

#: (object, attribute) pairs read outside the engine. Checked by a test.
LIGHTNING_NAMES = (
    # DataLoaderMonitor (callbacks/_train_loaders.py): Lightning requests the training DataLoaders and
    # starts their workers in one step of the fit loop, with no hook between; the loop's data source (the
    # loaders given to fit, or the LightningModule/DataModule whose train_dataloader it will call) is
    # the only place to check they pickle, or tune num_workers, before any worker starts.
    (_FitLoop, "_data_source"),
    (_DataLoaderSource, "instance"),
)


def has_name(owner: type, name: str) -> bool:
    """Whether instances of ``owner`` have attribute ``name``: a class attribute, a dataclass field, or
    an attribute its ``__init__`` assigns (``self.<name> =``)."""
    if hasattr(owner, name):
        return True
    if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
        return True
    return f"self.{name} =" in inspect.getsource(owner.__init__)
