"""Per-batch sizing: the micro-batch budget in padded tokens, so each batch's split follows its shape.

A batch of variable-length sequences is padded to its longest sample, so the memory of a step grows
with ``samples x tokens per sample``, not with samples alone. The training micro-batch is therefore
budgeted in that unit, the *padded element count* of a micro-batch: its samples times the batch's
:func:`tokens_per_sample` (1 for batches without a sequence dimension, where the budget is in samples
as before). For each batch, micro-batch samples = ``max(1, budget // tokens_per_sample)``: a short
batch runs whole or in few pieces, a long one in more.

What the budget learns (the rules that move it live in :class:`~lightning_memopt.batching.policy.SizePolicy`):

- ``budget``: the largest micro-batch known to fit, from ``AutoAccumulation``'s probes (given in
  samples of the probed batch, which is the first one) or ``OOMBackoff``'s back-offs and growth.
- ``failed``: the smallest micro-batch that ran out of memory. Growth stays strictly below it, at every
  length, so no later batch runs a micro-batch of that padded size again.

Where every batch has the same shape, every size equals the size in samples that the fit had before
per-batch sizing. Single-process only for now: under DDP/FSDP2 each rank's batch has its own length, so
the ranks could run different numbers of micro-batches (FSDP2 needs the same number on every rank),
and agreeing on it would take one more collective per step; there the engine keeps sizes in samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TokenBudget", "tokens_per_sample"]


def tokens_per_sample(batch: Any) -> int:
    """The longest dim-1 length among the 2-D+ integer and floating-point tensors of ``batch``; 1 if none.

    Example::

        >>> tokens_per_sample({"input_ids": torch.zeros(4, 37, dtype=torch.long), "y": torch.zeros(4)})
        37
    """
    if isinstance(batch, torch.Tensor):
        counted = batch.is_floating_point() or not (batch.is_complex() or batch.dtype == torch.bool)
        return batch.shape[1] if batch.dim() >= 2 and counted else 1
    if isinstance(batch, Mapping):
        items: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return 1
    return max((tokens_per_sample(item) for item in items), default=1)


@dataclass
class TokenBudget:
    """Micro-batch sizes in padded tokens, read and written in samples of the batch of the moment.

    Sizes written before the first batch is seen (``width`` None) are samples of that first batch.

    Example::

        >>> budget = TokenBudget()
        >>> budget.set("budget", 4)  # 4 samples of the first batch
        >>> budget.see(100)  # the first batch: 100 tokens per sample
        >>> budget.budget, budget.get("budget")
        (400, 4)
        >>> budget.see(25); budget.get("budget")  # a batch 4x shorter: 4x the samples
        16
    """

    budget: int | None = None
    """Tokens per micro-batch known to fit; None runs whole batches."""
    largest: int | None = None
    """The cap when growing back: the budget the fit started at."""
    failed: int | None = None
    """The smallest micro-batch, in tokens, that ran out of memory."""
    width: int | None = None
    """Tokens per sample of the batch of the moment; None before the first batch."""

    def see(self, width: int) -> None:
        """A batch of ``width`` tokens per sample is next; sizes given before the first batch were its samples."""
        if self.width is None:
            for name in ("budget", "largest", "failed"):
                value = getattr(self, name)
                setattr(self, name, None if value is None else value * width)
        self.width = width

    def get(self, name: str) -> int | None:
        """The size ``name`` (``budget``, ``largest``, ``failed``) in samples of the batch of the moment."""
        tokens = getattr(self, name)
        return None if tokens is None else max(1, tokens // (self.width or 1))

    def set(self, name: str, samples: int | None, width: int | None = None) -> None:
        """Set the size ``name`` to ``samples`` samples of ``width`` tokens (None: of the batch of the moment)."""
        if width is not None and self.width is None:
            self.see(width)  # a size saved with its batch's length (a checkpoint, a probe): the unit is known
        setattr(self, name, None if samples is None else samples * (width or self.width or 1))

    def below_failed(self) -> int | None:
        """The most samples of the batch of the moment whose micro-batch is smaller than ``failed``."""
        return None if self.failed is None else (self.failed - 1) // (self.width or 1)
