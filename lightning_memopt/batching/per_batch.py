"""Per-batch sizing from a :class:`~lightning_memopt.batching.shapes.ShapeModel` (plain torch.distributed).

Before each training batch runs, the engine asks :func:`size_batch` for its micro-batch size. With a
model (``AutoAccumulation`` fitted one to its probes), the size is what the model predicts for the batch's
length; a batch whose length the model does not know yet (:meth:`~.shapes.ShapeModel.knows`) is probed
first, at the size the model predicts (:func:`measure_length`). Under a distributed strategy every rank has its own batch, so
its own length and size, but every rank must run the same number of micro-batches (FSDP2 gathers and
reduces parameters in each micro-batch's forward and backward; the regime of the attempt depends on the
count too). The collectives, in order, identical on every rank:

- every step: one all-reduce (max) of two integers: whether any rank's length is new, and the most
  micro-batches any rank needs. Every rank then runs that many (:func:`~.split.micro_batch_sizes`).
- only when a length was new somewhere: every rank probes its own batch, and the ranks agree whether any
  probe ran out of memory (one 8-byte all-reduce per probe round, at most 3 rounds: a failed probe
  raises that rank's prediction and every rank probes again), then on the count once more.

Without a model (``OOMBackoff`` alone, or ``AutoAccumulation`` with a fixed size), sizes are kept in
padded tokens in one process and in samples under a distributed strategy, and nothing is agreed per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_memopt.batching.distributed import (
    any_rank,
    is_distributed,
    max_over_ranks,
    max_over_ranks_each,
)
from lightning_memopt.batching.policy import SizePolicy

__all__ = ["measure_length", "size_batch"]

_ROUNDS = 3  # probe rounds at most for one new length


def size_batch(
    policy: SizePolicy,
    *,
    width: int,
    total: int,
    device: torch.device,
    held: Callable[[], int],
    probe: Callable[[int], int | None],
    record: list | None = None,
) -> tuple[int, int | None]:
    """The micro-batch size of a batch of ``total`` samples of ``width`` tokens, and the number of
    micro-batches every rank runs (None: not agreed; without a model).

    Args:
        policy: The sizes and, if fitted, the :class:`~.shapes.ShapeModel`.
        width: Tokens per sample of this rank's batch.
        total: Samples of this rank's batch.
        device: Where the collectives run.
        held: Returns the bytes alive while this step's micro-batches run, besides what they allocate
            (parameters, gradients, optimizer state, the batch, the step's snapshot for a retry).
        probe: ``probe(samples)`` runs one training micro-step of this batch and returns the bytes its
            peak rose above its start, or None if it ran out of memory.
        record: Where each probe is appended as ``(width, samples, bytes or None)``.
    """
    model = policy.model
    if model is None:
        return policy.size_for(total, None if is_distributed() else width), None
    model.held = held()
    size = policy.size_for(total, width)
    new, count = max_over_ranks_each([not model.knows(width), -(-total // size)], device)
    if new:
        measure_length(policy, width=width, total=total, device=device, probe=probe, record=record)
        size = policy.size_for(total, width)
        count = max_over_ranks(-(-total // size), device)
    return size, count


def measure_length(
    policy: SizePolicy,
    *,
    width: int,
    total: int,
    device: torch.device,
    probe: Callable[[int], int | None],
    record: list | None = None,
) -> None:
    """Probe this batch at the size the model predicts for ``width`` and add what it measured; a probe that
    runs out of memory raises the prediction and the ranks probe again (every rank takes part in every
    round, so FSDP2's collectives inside the probes match)."""
    model = policy.model
    assert model is not None
    for _ in range(_ROUNDS):
        size = min(model.samples_for(width), total)
        increment = probe(size)
        if record is not None:
            record.append((width, size, increment))
        if increment is None:
            model.missed(width=width, samples=size)
        else:
            model.measured(width=width, samples=size, increment=increment)
        if not any_rank(increment is None, device):
            return
