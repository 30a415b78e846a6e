"""lightning_memopt: make large models fit in accelerator memory, as Lightning callbacks."""

__version__ = "0.1.0"

from lightning_memopt.callbacks.auto_checkpoint import AutoCheckpoint  # noqa: E402

__all__: list[str] = ["AutoCheckpoint"]
