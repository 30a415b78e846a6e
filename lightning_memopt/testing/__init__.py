"""Test tooling for code that must survive running out of memory, without a full accelerator.

A real out-of-memory error needs a device that is full; a test needs one that happens at a chosen place,
for a chosen reason, every time. These tools are public so that users can check that their own training
setup recovers from an OOM (with :class:`~lightning_memopt.OOMBackoff`, or their own handling) before a
real one costs them a run:

- :class:`OOMInjector` raises a deterministic ``torch.OutOfMemoryError`` (with the message a CUDA
  allocator gives) in a module's forward, its backward, or the optimizer step, when the micro-batch is
  larger than a cap or the live bytes measured by a :class:`~lightning_memopt.memory.MemoryTracker`
  exceed one: a simulated device of that capacity.
- :class:`MemoryCap` simulates a device of a given capacity: the live tensor bytes are counted exactly
  while it is entered, and the first tensor op that grows them past the capacity raises, wherever it
  is (forward, backward, optimizer state creation), as an allocator would.
- :class:`InjectedOOM` records each error either raised.

Example::

    >>> import torch
    >>> from lightning_memopt.testing import OOMInjector
    >>> layer = torch.nn.Linear(4, 2)
    >>> with OOMInjector(layer, max_size=8) as injector:
    ...     _ = layer(torch.ones(8, 4))  # 8 samples fit
    ...     try:
    ...         _ = layer(torch.ones(16, 4))
    ...     except torch.OutOfMemoryError:
    ...         pass
    >>> injector.events[0].size
    16
"""

from lightning_memopt.testing.cap import MemoryCap
from lightning_memopt.testing.oom import InjectedOOM, OOMInjector

__all__ = ["InjectedOOM", "MemoryCap", "OOMInjector"]
