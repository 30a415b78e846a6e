"""lightning_memopt: make large models fit in accelerator memory, as Lightning callbacks."""

from lightning_memopt.callbacks import (
    AutoAccumulation,
    AutoCheckpoint,
    BatchNormToGroupNorm,
    MemoryMonitor,
    OOMBackoff,
)

__version__ = "0.1.0"

__all__: list[str] = [
    "AutoAccumulation",
    "AutoCheckpoint",
    "BatchNormToGroupNorm",
    "MemoryMonitor",
    "OOMBackoff",
]
