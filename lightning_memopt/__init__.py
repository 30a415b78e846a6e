"""lightning_memopt: make large models fit in accelerator memory, as Lightning callbacks.

The callbacks are imported on first use, so that ``import lightning_memopt.memory`` (or any other
plain-torch core) does not import Lightning, except where Lightning is already imported: see the end.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from lightning_memopt import _compat  # noqa: F401 - plain torch; installs torch's device guard (its docstring)

__version__ = "0.1.0"

# public name -> module that defines it
_PUBLIC = {
    "AutoAccumulation": "lightning_memopt.callbacks.auto_accumulation",
    "AutoCheckpoint": "lightning_memopt.callbacks.auto_checkpoint",
    "BatchNormToGroupNorm": "lightning_memopt.callbacks.batchnorm_swap",
    "DataLoaderMonitor": "lightning_memopt.callbacks.dataloader_monitor",
    "MemoryMonitor": "lightning_memopt.callbacks.memory_monitor",
    "OOMBackoff": "lightning_memopt.callbacks.oom_backoff",
    "MicroBatchOOMError": "lightning_memopt.batching.errors",
    "SplitNotExactError": "lightning_memopt.batching.errors",
    "SplitNotExactWarning": "lightning_memopt.batching.errors",
}

__all__ = [
    "AutoAccumulation",
    "AutoCheckpoint",
    "BatchNormToGroupNorm",
    "DataLoaderMonitor",
    "MemoryMonitor",
    "MicroBatchOOMError",
    "OOMBackoff",
    "SplitNotExactError",
    "SplitNotExactWarning",
]

if TYPE_CHECKING:
    from lightning_memopt.batching.errors import MicroBatchOOMError, SplitNotExactError, SplitNotExactWarning
    from lightning_memopt.callbacks import (
        AutoAccumulation,
        AutoCheckpoint,
        BatchNormToGroupNorm,
        DataLoaderMonitor,
        MemoryMonitor,
        OOMBackoff,
    )


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'lightning_memopt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


# LightningCLI (jsonargparse) resolves a short ``class_path: AutoCheckpoint`` among the subclasses of
# ``Callback`` imported so far, so the callbacks must be imported before the config is parsed. A script
# that imports Lightning first (``from lightning.pytorch.cli import LightningCLI``, which isort puts before
# ``import lightning_memopt``) gets them here: ``import lightning_memopt`` is all it needs. Without Lightning
# imported they stay lazy (``import lightning_memopt.callbacks`` registers them at any time).
if "lightning.pytorch" in sys.modules:
    importlib.import_module("lightning_memopt.callbacks")
