"""Reading a DataLoader without changing what training will see: every RNG that can decide the sample
order or an item's random augmentation is saved and restored around the reading."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["preserved_rng"]


@contextlib.contextmanager
def preserved_rng(loader: Any) -> Iterator[None]:
    """Restore, on exit, the global torch, Python and NumPy RNGs and the loader's and sampler's generators.

    A shuffling sampler draws its permutation from its generator (or the global torch RNG), starting
    workers draws their base seed, and ``__getitem__`` may draw augmentations: none of that leaks out.
    """
    generators = [
        g
        for g in (
            getattr(loader, "generator", None),
            getattr(getattr(loader, "sampler", None), "generator", None),
            getattr(getattr(getattr(loader, "batch_sampler", None), "sampler", None), "generator", None),
        )
        if isinstance(g, torch.Generator)
    ]
    saved: list[tuple[Any, Any]] = [(g, g.get_state()) for g in generators]
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    try:
        import numpy
    except ImportError:
        numpy = None
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        for generator, state in saved:
            generator.set_state(state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
