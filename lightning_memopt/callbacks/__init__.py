"""Lightning callbacks: thin adapters over the plain-torch cores."""

from lightning_memopt.callbacks.batchnorm_swap import BatchNormToGroupNorm
from lightning_memopt.callbacks.memory_monitor import MemoryMonitor

__all__: list[str] = ["BatchNormToGroupNorm", "MemoryMonitor"]
