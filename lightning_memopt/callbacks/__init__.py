"""Lightning callbacks: thin adapters over the plain-torch cores."""

from lightning_memopt.callbacks.batchnorm_swap import BatchNormToGroupNorm

__all__: list[str] = ["BatchNormToGroupNorm"]
