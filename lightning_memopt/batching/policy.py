"""How the micro-batch size moves: halve on out-of-memory, grow back after clean steps (plain Python).

The rules, in one place:

- A step that ran out of memory at ``size`` retries at ``ceil(size / 2)``, never below the floor (1
  sample; 2 for a model with BatchNorm layers in training mode, whose statistics need two). At the
  floor, :class:`~lightning_memopt.batching.errors.MicroBatchOOMError` says what to do instead.
- After ``grow_after`` clean steps in a row (no retry) at a reduced size, the size doubles, capped by
  the size the fit started at and by one less than the smallest size that ever failed.
- Sizes are kept in padded tokens (samples x tokens per sample, :mod:`~lightning_memopt.batching.shapes`)
  and read in samples of the batch of the moment: a failure at 8 samples of 32 tokens caps growth below
  256 tokens at every length, and a batch of 8-token samples runs 4 times the samples of a 32-token one.
  Where every batch has the same shape, this is the size in samples as the rules above say.
- With a :class:`~lightning_memopt.batching.shapes.ShapeModel` (``AutoAccumulation`` under a memory
  limit fits one), each batch's size is what the model predicts for its shape instead: an
  out-of-memory error at ``size`` raises the model's prediction for that shape and retries the step at
  ``ceil(size / 2)`` (the floor as above); there is nothing to grow back.
- A step that trained while the CUDA allocator thrashed (:meth:`SizePolicy.near_miss`) halves the size
  for the next steps the same way (with a model: lowers its prediction for that shape as a miss does),
  floor and record of the failed size included, without a retry and without an error at the floor.
- ``stable_steps`` counts steps that succeeded at the current size (after their retries); a new size,
  smaller or larger, starts again from 0. The engine reads it to decide when sizes have settled.
"""

from __future__ import annotations

import math

from lightning_memopt.batching.errors import BATCHNORM_ADVICE, CHECKLIST, MicroBatchOOMError
from lightning_memopt.batching.shapes import ShapeModel, TokenBudget

__all__ = ["SizePolicy"]


# The sizes SizePolicy keeps in padded tokens: the name in samples -> the name on its TokenBudget.
SIZES = {"micro_batch_size": "budget", "max_micro_batch_size": "largest", "smallest_failed_size": "failed"}


def _in_samples(name: str, doc: str) -> property:
    """A size kept in padded tokens on :attr:`SizePolicy.tokens`, read and written in samples."""
    key = SIZES[name]
    return property(lambda self: self.tokens.get(key), lambda self, v: self.tokens.set(key, v), doc=doc)


class SizePolicy:
    """The training micro-batch size and the counters that move it.

    The sizes are kept in padded tokens (:mod:`~lightning_memopt.batching.shapes`) and read in samples of
    the batch of the moment, so a batch of longer sequences runs in more micro-batches than a short one.

    Example::

        >>> policy = SizePolicy(grow_after=2)
        >>> policy.back_off(10, total=10, floor=1, failure="OOM")  # the whole batch failed
        >>> policy.micro_batch_size
        5
        >>> policy.succeeded(retried=True, total=10)  # the step that backed off
        >>> policy.succeeded(retried=False, total=10); policy.succeeded(retried=False, total=10)
        >>> policy.micro_batch_size  # 10 failed: grows only up to 9
        9
    """

    micro_batch_size = _in_samples(
        "micro_batch_size", "Samples per training micro-batch; None runs the whole batch at once."
    )
    max_micro_batch_size = _in_samples(
        "max_micro_batch_size",
        "The cap when growing back: the size the fit started at (set at the first back-off if not given).",
    )
    smallest_failed_size = _in_samples(
        "smallest_failed_size", "The smallest size that ever ran out of memory: growth stays below it."
    )

    def __init__(
        self,
        *,
        micro_batch_size: int | None = None,
        grow_after: int | None = None,
        max_micro_batch_size: int | None = None,
        smallest_failed_size: int | None = None,
    ) -> None:
        self.tokens = TokenBudget()
        self.micro_batch_size = micro_batch_size
        self.max_micro_batch_size = max_micro_batch_size
        self.smallest_failed_size = smallest_failed_size
        self.grow_after = grow_after
        """Clean steps in a row after which a reduced size doubles; None: never grow."""
        self.oom_retries = 0
        """Out-of-memory retries of training steps since the fit started."""
        self.clean_steps = 0
        """Steps in a row without a retry (towards ``grow_after``)."""
        self.stable_steps = 0
        """Steps in a row that succeeded at the current size (towards ``overlap_after``)."""
        self.last_total: int | None = None
        """Samples of the last batch that trained."""
        self.model: ShapeModel | None = None
        """Peak memory by batch shape; when set, it sizes every batch (see the module docstring)."""
        self._retry: int | None = None  # with a model: the halved size of the step being retried

    def set_size(self, name: str, samples: int | None, width: int | None) -> None:
        """Set the size ``name`` (a key of ``SIZES``) to ``samples`` samples of ``width`` tokens (None: of the
        batch of the moment), as saved in a checkpoint or probed."""
        self.tokens.set(SIZES[name], samples, width)

    def size_for(self, total: int, width: int | None = None) -> int:
        """The micro-batch size of a batch of ``total`` samples of ``width`` tokens (None: as the last batch)."""
        if width is not None:
            self.tokens.see(width)
        if self.model is not None:
            # what readers of the size expect: the samples per micro-batch of this batch
            predicted = min(self.model.samples_for(self.tokens.width or 1), total)
            self.micro_batch_size = min(predicted, self._retry or predicted)
        return min(self.micro_batch_size or total, total)

    def back_off(self, size: int, *, total: int, floor: int, failure: str | None) -> None:
        """Record an out-of-memory error at ``size`` and pick half of it (at least ``floor``).

        Args:
            size: The micro-batch size that ran out of memory.
            total: Samples of the batch.
            floor: The smallest size the model can train on (2 with BatchNorm in training mode, else 1).
            failure: What failed and the memory of the failed step, for the error message.

        Raises:
            MicroBatchOOMError: If ``size`` is already at the floor.
        """
        self.oom_retries += 1
        self.clean_steps = self.stable_steps = 0
        failed = size * (self.tokens.width or 1)  # in tokens: a shorter batch may run more samples
        self.tokens.failed = min(self.tokens.failed or failed, failed)
        if size <= 1:
            raise MicroBatchOOMError(
                "out of memory with one sample per micro-batch; splitting the batch further cannot help.\n"
                f"{failure}\n{CHECKLIST}"
            )
        if size <= floor:
            raise MicroBatchOOMError(
                f"out of memory with {size} samples per micro-batch, the fewest a model with BatchNorm layers in "
                f"training mode can run. {BATCHNORM_ADVICE}\n{failure}\n{CHECKLIST}"
            )
        if self.model is not None:
            self.model.missed(width=self.tokens.width or 1, samples=size)
            self._retry = max(math.ceil(size / 2), floor)
            return
        if self.max_micro_batch_size is None:
            self.max_micro_batch_size = self.micro_batch_size or total
        self.micro_batch_size = max(math.ceil(size / 2), floor)

    def near_miss(self, size: int, *, total: int, floor: int) -> bool:
        """Record a step at ``size`` that trained but came close to running out of memory (the CUDA allocator
        thrashed, :mod:`~lightning_memopt.batching.thrash`), and pick half of it as :meth:`back_off` would.

        The same halving, floor and record of a failure at ``size`` (growth stays below it), but not an
        out-of-memory error: nothing is retried (``oom_retries`` is unchanged) and nothing is raised.

        Args:
            size: The micro-batch size the step ran at.
            total: Samples of the batch.
            floor: The smallest size the model can train on (2 with BatchNorm in training mode, else 1).

        Returns:
            True if the size was lowered; False at the floor, where it stays as it is.
        """
        failed = size * (self.tokens.width or 1)  # in tokens, as back_off records it
        self.tokens.failed = min(self.tokens.failed or failed, failed)
        if size <= floor:
            return False
        if self.model is not None:  # this shape's prediction drops below size, as after a miss
            self.model.missed(width=self.tokens.width or 1, samples=size)
            return True
        if self.max_micro_batch_size is None:
            self.max_micro_batch_size = self.micro_batch_size or total
        self.micro_batch_size = max(math.ceil(size / 2), floor)
        self.clean_steps = self.stable_steps = 0  # a new size is unsettled
        return True

    def succeeded(self, *, retried: bool, total: int) -> None:
        """Record a step that trained (``retried``: after backing off), and grow when it is time."""
        self.last_total = total
        self.stable_steps += 1
        self._retry = None
        if retried or self.model is not None:
            return
        self.clean_steps += 1
        if self.grow_after is None or self.clean_steps < self.grow_after or self.micro_batch_size is None:
            return
        cap = min(self.max_micro_batch_size or total, total)
        if self.tokens.failed is not None:
            cap = min(cap, self.tokens.below_failed())  # smaller than the smallest failure, at this length
        grown = min(self.micro_batch_size * 2, cap)
        if grown > self.micro_batch_size:
            self.micro_batch_size = grown
            self.stable_steps = 0  # a new size is unsettled again
        self.clean_steps = 0


def halve_eval(size: int, *, hook: str, failure: str | None) -> int:
    """The evaluation micro-batch after an out-of-memory error at ``size`` (no floor: running statistics).

    Raises:
        MicroBatchOOMError: If ``size`` is one sample.
    """
    if size <= 1:
        raise MicroBatchOOMError(
            f"out of memory in {hook} with one sample per micro-batch.\n{failure or 'on another rank'}\n{CHECKLIST}"
        )
    return math.ceil(size / 2)
