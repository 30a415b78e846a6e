"""Micro-batching core: splitting batches, OOM detection, the engine that runs them.

Plain torch, except the engine and the modules it drives with Lightning objects (``engine.py``,
``surface.py``, whose ``LIGHTNING_SURFACE`` lists every Lightning name they use, ``regime.py``,
``splitter.py``, ``probe.py``). Private torch APIs go through :mod:`lightning_memopt._compat`."""

import warnings
from typing import Any

from lightning_memopt.batching.oom import is_out_of_memory
from lightning_memopt.batching.sizing import MemoryModel, SizingResult, find_micro_batch_size
from lightning_memopt.batching.split import batch_size, micro_batch_sizes, micro_batch_weights, split_batch

__all__ = [
    "MemoryModel",
    "SizingResult",
    "batch_size",
    "find_micro_batch_size",
    "is_out_of_memory",
    "micro_batch_sizes",
    "micro_batch_weights",
    "split_batch",
]

# Moved to lightning_memopt.testing (public test tooling); the old names resolve, with a warning, for one release.
_MOVED_TO_TESTING = ("InjectedOOM", "OOMInjector")


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_TESTING:
        warnings.warn(
            f"lightning_memopt.batching.{name} is deprecated and will be removed in the next release; "
            f"import it from lightning_memopt.testing instead",
            DeprecationWarning,
            stacklevel=2,
        )
        import lightning_memopt.testing

        return getattr(lightning_memopt.testing, name)
    raise AttributeError(f"module 'lightning_memopt.batching' has no attribute {name!r}")
