"""Lightning callbacks: thin adapters over the plain-torch cores."""

from lightning_memopt.callbacks.auto_accumulation import AutoAccumulation
from lightning_memopt.callbacks.oom_backoff import OOMBackoff

__all__ = ["AutoAccumulation", "OOMBackoff"]
