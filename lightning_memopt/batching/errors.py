"""What micro-batching raises, the out-of-memory errors it recognizes, and the advice it gives (plain torch)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_memopt.memory.tracker import tensor_bytes
from lightning_memopt.memory.units import format_bytes

__all__ = [
    "BATCHNORM_ADVICE",
    "MicroBatchOOMError",
    "SplitNotExactError",
    "SplitNotExactWarning",
    "checklist",
]

# Every option named here exists (tests/batching/test_errors.py checks them against the signatures).
_ADVICE = {
    "precision": 'precision="bf16-mixed" (or "16-mixed") on the Trainer: activations take half the bytes.',
    "checkpointing": "lightning_memopt.AutoCheckpoint(): recompute activations in backward instead of keeping them.",
    "batchnorm": (
        "lightning_memopt.BatchNormToGroupNorm(): small micro-batches make BatchNorm statistics noisy;\n"
        "     GroupNorm does not depend on the micro-batch size."
    ),
    "sharding": (
        "Shard parameters, gradients and optimizer state across devices with Lightning's\n"
        '     strategy="fsdp" or ModelParallelStrategy (FSDP2).'
    ),
    "offload": (
        'Offload saved activations to CPU memory: AutoCheckpoint(mode="offload"), or\n'
        "     AutoCheckpoint(allow_offload=True) to let its planner offload where that is cheapest."
    ),
    "smaller": "A smaller model or shorter sequences: one sample does not fit as it is.",
}


def checklist(done: frozenset[str] = frozenset()) -> str:
    """What to do against running out of memory, cheapest first, without what the fit already does
    (``done``: ``"precision"``, half precision; ``"checkpointing"``, ``AutoCheckpoint``; ``"batchnorm"``, no
    BatchNorm to swap; ``"sharding"``, FSDP or ModelParallel: the engine tells at fit start).

    Example::

        >>> print(checklist(frozenset({"precision", "checkpointing", "batchnorm", "sharding"})))
        What to do, cheapest first:
          1. Offload saved activations to CPU memory: AutoCheckpoint(mode="offload"), or
             AutoCheckpoint(allow_offload=True) to let its planner offload where that is cheapest.
          2. A smaller model or shorter sequences: one sample does not fit as it is.
    """
    items = [text for key, text in _ADVICE.items() if key not in done]
    return "What to do, cheapest first:\n" + "\n".join(f"  {i}. {text}" for i, text in enumerate(items, 1))


BATCHNORM_ADVICE = (
    "The model has BatchNorm layers in training mode, which need at least 2 samples per micro-batch "
    "(their statistics are computed over the micro-batch): add lightning_memopt.BatchNormToGroupNorm() "
    "to the callbacks (or lightning_memopt.norm.convert_batchnorm(model)) so that one sample can run."
)


class MicroBatchOOMError(RuntimeError):
    """Out of memory at the smallest micro-batch (one sample; two with BatchNorm in training mode): splitting
    further cannot help. The message holds the failed step's memory by category and a checklist of what to
    do. A ``RuntimeError`` subclass on purpose: :func:`~lightning_memopt.memory.device.is_out_of_memory` never takes it for an allocator
    error, so nothing retries it.
    """


class SplitNotExactWarning(UserWarning):
    """Micro-batching will not give this step the unsplit batch's gradient; the message names the cause and
    the fix. Warned once, on rank zero; ``exactness="raise"`` raises :class:`SplitNotExactError` instead.
    """


class SplitNotExactError(RuntimeError):
    """What :class:`SplitNotExactWarning` reports, raised instead (``exactness="raise"``)."""


def memory_report(module: torch.nn.Module, optimizers: Iterable[Any], size: int | None, memory: Any) -> str:
    """Bytes of the failed step by category, as far as they can be known without a tracker.

    Args:
        module: The model.
        optimizers: Its optimizers (their state counts).
        size: The micro-batch size that failed (None: the whole batch).
        memory: A :func:`~lightning_memopt.memory.device.device_memory` for the device peak, or None.
    """
    params = tensor_bytes(module.parameters())
    grads = tensor_bytes(p.grad for p in module.parameters())
    buffers = tensor_bytes(module.buffers())
    opt_state = tensor_bytes(v for o in optimizers for state in o.state.values() for v in state.values())
    lines = [
        f"Memory of the failed step (micro-batch size {size or 'whole batch'}):",
        f"  parameters       {format_bytes(params)}",
        f"  buffers          {format_bytes(buffers)}",
        f"  gradients        {format_bytes(grads)}",
        f"  optimizer state  {format_bytes(opt_state)}",
    ]
    if memory is not None:
        peak = memory.peak()
        rest = peak - params - buffers - grads - opt_state
        lines += [
            f"  activations and temporaries (peak minus the above)  {format_bytes(max(rest, 0))}",
            f"  device peak {format_bytes(peak)} of capacity {format_bytes(memory.capacity() or 0)}",
        ]
    return "\n".join(lines)
