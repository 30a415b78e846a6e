"""One probe micro-step that measures its peak memory and leaves every state as it was."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from lightning_memopt.batching.errors import is_out_of_memory
from lightning_memopt.batching.outputs import LogRecorder, loss_of
from lightning_memopt.batching.regime import no_sync
from lightning_memopt.batching.state import StepState

__all__ = ["measure_peak"]


def measure_peak(
    strategy: Any,
    step: Callable[[], Any],
    *,
    memory: Any,
    state: StepState,
    tracker: Any = None,
    evaluation: bool = False,
) -> int | None:
    """Run ``step`` (one training micro-step and its backward, or an evaluation step under ``no_grad``) and
    return its peak bytes, or None if it ran out of memory; then put gradients, buffers, torchmetrics
    states, RNGs and the module's train/eval mode back as they were.

    Args:
        strategy: The Trainer's strategy (its model's gradients are set aside; ``no_sync`` under DDP).
        step: Runs the micro-step and returns its output.
        memory: A :func:`~lightning_memopt.memory.device.device_memory` to measure with.
        state: The start state, captured before.
        tracker: A :class:`~lightning_memopt.memory.MemoryTracker` to measure inside (None: the allocator).
        evaluation: ``step`` is an evaluation step: no backward.
    """
    module = strategy.lightning_module
    grads = [(p, p.grad) for p in strategy.model.parameters()]
    for p, _ in grads:
        p.grad = None
    was_training = module.training
    peak: int | None = None
    with contextlib.ExitStack() as stack:
        if tracker is not None:
            stack.enter_context(tracker)
        memory.reset_peak()
        failed = False
        try:
            with LogRecorder(module), no_sync(strategy):
                if evaluation:
                    module.eval()
                    with torch.no_grad():
                        step()
                else:
                    loss_of(step()).backward()
        except BaseException as error:
            if not is_out_of_memory(error):
                raise
            failed = True
        if not failed:
            peak = memory.peak()
    module.train(was_training)
    for p, grad in grads:  # gradients as they were (None at fit start)
        p.grad = grad
    state.restore()
    memory.empty_cache()
    return peak
