"""The memory of a step that ran out of memory, by category, for error messages (plain torch)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_memopt.memory.device import device_memory
from lightning_memopt.memory.units import format_bytes

__all__ = ["memory_of", "memory_report"]


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the tensors among ``tensors`` (other items are skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


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


def memory_of(device: torch.device, tracker: Any = None) -> Any:
    """What measures ``device``: its allocator (CUDA), else ``tracker`` (a MemoryTracker), else None."""
    if device.type == "cuda":
        return device_memory(device)
    return None if tracker is None else device_memory(device, tracker=tracker)
