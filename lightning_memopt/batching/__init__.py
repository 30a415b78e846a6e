"""Micro-batching core: splitting batches, OOM detection, the engine that runs them.

Plain torch, except the engine and the modules it drives with Lightning objects (``engine.py``,
``surface.py``, whose ``LIGHTNING_SURFACE`` lists every Lightning name they use, ``step.py``,
``regime.py``, ``probe.py``, ``outputs.py``). Private torch APIs go through :mod:`lightning_memopt._compat`."""

from lightning_memopt.batching.size_search import MemoryModel, SizingResult, find_micro_batch_size
from lightning_memopt.batching.split import batch_size, micro_batch_sizes, micro_batch_weights, split_batch
from lightning_memopt.memory.device import is_out_of_memory

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
