"""lightning_memopt: make large models fit in accelerator memory, as Lightning callbacks."""

from lightning_memopt.callbacks.auto_accumulation import AutoAccumulation
from lightning_memopt.callbacks.oom_backoff import OOMBackoff

__version__ = "0.1.0"

__all__ = ["AutoAccumulation", "OOMBackoff"]
