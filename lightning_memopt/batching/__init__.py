"""Micro-batching core: splitting batches, OOM detection, the engine that runs them (plain torch,
except ``engine.py``, the one module that touches Lightning internals)."""

from lightning_memopt.batching.inject import InjectedOOM, OOMInjector
from lightning_memopt.batching.oom import is_out_of_memory
from lightning_memopt.batching.split import batch_size, micro_batch_sizes, micro_batch_weights, split_batch

__all__ = [
    "InjectedOOM",
    "OOMInjector",
    "batch_size",
    "is_out_of_memory",
    "micro_batch_sizes",
    "micro_batch_weights",
    "split_batch",
]
