"""Micro-batching core: splitting batches, OOM detection, the engine that runs them (plain torch,
except ``engine.py``, the one module that touches Lightning internals)."""

from lightning_memopt.batching.inject import InjectedOOM, OOMInjector
from lightning_memopt.batching.oom import is_out_of_memory
from lightning_memopt.batching.sizing import MemoryModel, SizingResult, find_micro_batch_size
from lightning_memopt.batching.split import batch_size, micro_batch_sizes, micro_batch_weights, split_batch

__all__ = [
    "InjectedOOM",
    "MemoryModel",
    "OOMInjector",
    "SizingResult",
    "batch_size",
    "find_micro_batch_size",
    "is_out_of_memory",
    "micro_batch_sizes",
    "micro_batch_weights",
    "split_batch",
]
