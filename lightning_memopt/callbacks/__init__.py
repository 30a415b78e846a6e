"""Lightning callbacks: thin adapters over the plain-torch cores."""

from lightning_memopt.callbacks.auto_checkpoint import AutoCheckpoint

__all__: list[str] = ["AutoCheckpoint"]
