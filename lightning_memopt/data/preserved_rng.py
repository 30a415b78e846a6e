"""Reading a DataLoader without changing what training will see: every RNG that can decide the sample
order or an item's random augmentation is saved and restored around the reading."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from lightning_memopt._rng import RngState

__all__ = ["preserved_rng"]


@contextlib.contextmanager
def preserved_rng(loader: Any) -> Iterator[None]:
    """Restore, on exit, the global torch, Python and NumPy RNGs and the loader's and sampler's generators.

    A shuffling sampler draws its permutation from its generator (or the global torch RNG), starting
    workers draws their base seed, and ``__getitem__`` may draw augmentations: none of that leaks out.
    """
    owners = (
        loader,
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    )
    generators = [
        g for g in (getattr(o, "generator", None) for o in owners) if isinstance(g, torch.Generator)
    ]
    state = RngState.capture(generators)
    try:
        yield
    finally:
        state.restore()
