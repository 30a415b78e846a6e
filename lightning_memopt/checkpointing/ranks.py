"""What the processes of a distributed run agree on before planning, so that every process runs the same plan.

Each process profiles the blocks on its own batch, and with variable-length data the batches differ
(each padded to its own longest sequence): planned apart, the processes would choose apart. A checkpointed
block recomputes its forward in backward, and under FSDP2 a ``fully_shard`` module inside a checkpointed
block all-gathers its parameters again for that recompute; a process that keeps the block does not. So
every process must run the same plan on every step, and that plan must fit every process's batch.

The rule: after a profile, the processes exchange what they measured (one ``all_gather_object``: the
batch's shapes, the block profiles, the bytes of parameters, gradients and optimizer state, the activations
outside the blocks) and every process plans on the same figures, :func:`agree`: each figure's largest over
processes. The plan then bounds the blocks on every process's batch (a plan's bytes grow with each figure),
every process computes the same plan (planning is deterministic), and a limit too small fails on every
process at once. The plan is kept under every process's shapes
(:meth:`~lightning_memopt.checkpointing.shape_plans.ShapePlans.add`); at each later step one all-reduce (a flag
per plan made: does it not cover my batch?) picks the cheapest plan that covers every process's batch.

AutoCheckpoint's collectives (none in one process; tested exactly in
``tests/callbacks/test_auto_checkpoint_ranks.py``): one ``all_gather_object`` per profile (torch runs it as
two all-gathers, sizes then data), which is the first step without a limit, and under a limit also every
step after a batch new on some process; under a limit, one all-reduce of a flag per plan made at every
step after the first. Profiling ``fully_shard`` blocks adds one all-gather of each block's parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memopt.checkpointing.costs import BlockProfile, OptionCost
from lightning_memopt.checkpointing.shape_plans import Signature

__all__ = ["AgreedMeasures", "Measured", "agree", "gather_over_ranks", "largest_profiles", "most_over_ranks"]

# Booleans that lower a plan's bytes when true (an input already held elsewhere costs the block nothing):
# true only where true on every process. The other booleans (what a treatment saves) are true where any is.
_SHARED = frozenset({"chained", "input_held"})


@dataclass
class Measured:
    """What one process measured on a batch it profiled."""

    signature: Signature
    """The batch's shapes (:func:`~lightning_memopt.checkpointing.shape_plans.shape_signature`)."""
    profiles: list[BlockProfile]
    """One profile per block, in forward order."""
    states: int
    """Bytes of parameters, gradients and optimizer state (a shard's, under FSDP)."""
    outside: int
    """Activations held at the end of the forward outside the blocks."""
    transient: int = 0
    """Bytes backward's first ops hold beside the activations (:attr:`~lightning_memopt.checkpointing.Plan.transient`)."""


@dataclass
class AgreedMeasures:
    """What every process plans on: :func:`agree` of every process's :class:`Measured`."""

    signatures: list[Signature]
    """Each process's batch shapes, in rank order."""
    profiles: list[BlockProfile]
    states: int
    outside: int
    transient: int = 0


def _largest(name: str, values: Sequence[Any]) -> Any:
    first = values[0]
    if name == "note":  # a block that can only keep on one process keeps on all
        return next((v for v in values if v is not None), None)
    if isinstance(first, bool):
        return all(values) if name in _SHARED else any(values)
    if isinstance(first, (int, float)):  # bytes, FLOPs, seconds (timed on every process, or on none)
        return max(values)
    if isinstance(first, OptionCost):
        return _merged(values)
    if isinstance(first, dict):  # options: those every process profiled
        return {
            key: _largest(key, [v[key] for v in values]) for key in first if all(key in v for v in values)
        }
    return first  # a name: the same on every process


def _merged(items: Sequence[Any]) -> Any:
    fields = {
        f.name: _largest(f.name, [getattr(i, f.name) for i in items]) for f in dataclasses.fields(items[0])
    }
    return dataclasses.replace(items[0], **fields)


def largest_profiles(per_rank: Sequence[Sequence[BlockProfile]]) -> list[BlockProfile]:
    """Per block, every byte and FLOP figure's largest over processes (what a treatment saves: where any
    process saves it; an input held elsewhere: where every process holds it).

    Example::

        >>> a = BlockProfile("h.0", 10, 64, 64, False, {"keep": OptionCost(256, True, False)})
        >>> b = BlockProfile("h.0", 30, 32, 32, False, {"keep": OptionCost(512, True, False)})
        >>> merged = largest_profiles([[a], [b]])[0]
        >>> merged.forward_flops, merged.input_bytes, merged.options["keep"].internal_bytes
        (30, 64, 512)
    """
    return [_merged(block) for block in zip(*per_rank)]


def agree(measured: Sequence[Measured]) -> AgreedMeasures:
    """The figures every process plans on: each one's largest over ``measured`` (one per process)."""
    return AgreedMeasures(
        [m.signature for m in measured],
        largest_profiles([m.profiles for m in measured]),
        max(m.states for m in measured),
        max(m.outside for m in measured),
        max(m.transient for m in measured),
    )


def gather_over_ranks(strategy: Any, value: Any) -> list[Any]:
    """``value`` of every process, in rank order (``[value]`` in one process, with no collective).

    One ``torch.distributed.all_gather_object``: any picklable value, of any size per process.
    """
    if getattr(strategy, "world_size", 1) == 1:
        return [value]
    gathered: list[Any] = [None] * strategy.world_size
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def most_over_ranks(strategy: Any, values: Sequence[int]) -> list[int]:
    """Each value's largest over processes: one all-reduce (none in one process, and no device sync).

    ``torch.distributed.all_reduce`` itself, not the strategy's ``reduce``, which runs a barrier first.
    """
    if getattr(strategy, "world_size", 1) == 1:
        return [int(v) for v in values]
    ours = torch.tensor([int(v) for v in values], dtype=torch.int64, device=strategy.root_device)
    torch.distributed.all_reduce(ours, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in ours.tolist()]
