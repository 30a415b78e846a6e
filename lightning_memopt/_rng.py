"""The one snapshot of the random number generators the package saves and restores.

A retried step must draw the same dropout masks as the step that failed; reading a DataLoader to
diagnose it must not change the order training will see. Both save the global torch (and CUDA), Python
and NumPy generators, plus any ``torch.Generator`` they are given, and put them back.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import torch

from lightning_memopt._compat import untracked
from lightning_memopt.memory.device import cuda_rng_states, set_cuda_rng_states

__all__ = ["RngState"]


class RngState:
    """The state of the global generators (and of ``generators``) at :meth:`capture`.

    Example::

        >>> state = RngState.capture()
        >>> a = torch.rand(2)
        >>> state.restore()
        >>> torch.equal(a, torch.rand(2))
        True
    """

    def __init__(self) -> None:
        with untracked():  # host memory: not the device's, not even on a simulated one
            self.torch: torch.Tensor = torch.get_rng_state()
            self.cuda = cuda_rng_states()
        self.python: Any = random.getstate()
        self.numpy: Any = None
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []

    @classmethod
    def capture(cls, generators: Iterable[torch.Generator] = ()) -> RngState:
        state = cls()
        try:
            import numpy
        except ImportError:  # numpy is optional
            pass
        else:
            state.numpy = numpy.random.get_state()
        with untracked():
            state.generators = [(g, g.get_state()) for g in generators]
        return state

    def restore(self) -> None:
        """Put every generator back (the saved states stay valid for another restore)."""
        torch.set_rng_state(self.torch)
        self.restore_host()
        if self.cuda is not None:
            set_cuda_rng_states(self.cuda)
        for generator, saved in self.generators:
            generator.set_state(saved)

    def restore_host(self) -> None:
        """Put only Python's and NumPy's generators back (torch's stay where they are)."""
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy

            numpy.random.set_state(self.numpy)

    def same_host(self, other: RngState) -> bool:
        """Whether Python's and NumPy's generators are where they were in ``other``."""
        if self.python != other.python or (self.numpy is None) != (other.numpy is None):
            return False
        if self.numpy is None:
            return True
        import numpy

        (kind, keys, *rest), (other_kind, other_keys, *other_rest) = self.numpy, other.numpy
        return kind == other_kind and numpy.array_equal(keys, other_keys) and rest == other_rest

    def same(self, other: RngState) -> bool:
        """Whether the torch generators (CPU and CUDA) are where they were in ``other``: no random number
        was drawn from them in between."""
        with untracked():  # comparing host copies uses no device memory
            if not torch.equal(self.torch, other.torch) or (self.cuda is None) != (other.cuda is None):
                return False
            return self.cuda is None or all(torch.equal(a, b) for a, b in zip(self.cuda, other.cuda))
