"""Lightning callbacks: thin adapters over the plain-torch cores."""

from lightning_memopt.callbacks.auto_accumulation import AutoAccumulation
from lightning_memopt.callbacks.auto_checkpoint import AutoCheckpoint
from lightning_memopt.callbacks.batchnorm_swap import BatchNormToGroupNorm
from lightning_memopt.callbacks.dataloader_monitor import DataLoaderMonitor
from lightning_memopt.callbacks.memory_monitor import MemoryMonitor
from lightning_memopt.callbacks.oom_backoff import OOMBackoff

__all__: list[str] = [
    "AutoAccumulation",
    "AutoCheckpoint",
    "BatchNormToGroupNorm",
    "DataLoaderMonitor",
    "MemoryMonitor",
    "OOMBackoff",
]
