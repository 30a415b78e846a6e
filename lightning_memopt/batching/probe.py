"""Probe micro-steps that measure their peak memory and leave every state as they were."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_memopt._compat import is_dtensor
from lightning_memopt.batching.outputs import LogRecorder, loss_of
from lightning_memopt.batching.regime import no_sync
from lightning_memopt.batching.size_search import smallest_micro_batch
from lightning_memopt.batching.split import split_batch, tensors_of
from lightning_memopt.batching.state import StepState
from lightning_memopt.data.clock import Clock, step_clock
from lightning_memopt.memory.device import is_out_of_memory, memory_of
from lightning_memopt.memory.tracker import MemoryTracker, optimizer_state_to_come, state_bytes, tensor_bytes

__all__ = ["BatchProbes", "measure_peak"]


def measure_peak(
    strategy: Any,
    step: Callable[[], Any],
    *,
    memory: Any,
    state: StepState,
    tracker: Any = None,
    evaluation: bool = False,
    clock: Clock | None = None,
) -> tuple[int | None, float | None]:
    """Run ``step`` (one training micro-step and its backward, or an evaluation step under ``no_grad``) and
    return its peak bytes and seconds (None for both if it ran out of memory; seconds None without a
    ``clock``); then put gradients, buffers, torchmetrics states, RNGs and the module's train/eval mode
    back as they were.

    A training probe runs as a micro-batch after the first of an accumulated step does, with a gradient
    held for every parameter that trains (zeros where there was none), which its backward adds to. The
    first micro-batch of a step creates the gradients as its backward goes; every later one holds them
    all from its start, so its peak is the larger (by up to the gradients' bytes: 4 GiB for a
    1B-parameter model in float32), and it is the one that must fit where a batch runs split. The whole
    batch's probe is measured so too: one curve of peaks (a whole batch that fits only while no gradient
    is held runs split, the safe side).

    Args:
        strategy: The Trainer's strategy (its model's gradients are set aside; ``no_sync`` under DDP).
        step: Runs the micro-step and returns its output.
        memory: A :func:`~lightning_memopt.memory.device.device_memory` to measure with.
        state: The start state, captured before.
        tracker: A :class:`~lightning_memopt.memory.MemoryTracker` to measure inside (None: the allocator).
        evaluation: ``step`` is an evaluation step: no backward.
        clock: Times ``step`` and its backward (:func:`~lightning_memopt.data.clock.step_clock`); under a
            ``tracker`` the seconds include its dispatch mode's overhead on every op.
    """
    module = strategy.lightning_module
    grads = [(p, p.grad) for p in strategy.model.parameters()]
    for p, _ in grads:
        p.grad = None
    was_training = module.training
    peak: int | None = None
    seconds: float | None = None
    with contextlib.ExitStack() as stack:
        if tracker is not None:
            stack.enter_context(tracker)
        failed = False
        try:
            if not evaluation:
                for p, _ in grads:
                    if p.requires_grad and not is_dtensor(p):  # FSDP2's sharded gradients: as they come
                        p.grad = torch.zeros_like(p)
            memory.reset_peak()
            start = clock.mark() if clock is not None else None
            with LogRecorder(module), no_sync(strategy):
                if evaluation:
                    module.eval()
                    with torch.no_grad():
                        step()
                else:
                    loss_of(step()).backward()
            if clock is not None:
                end = clock.mark()
                clock.settle(end)
                seconds = clock.seconds(start, end)
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
    return peak, seconds


class BatchProbes:
    """Probes of one batch through the engine's strategy: the :class:`~.sizes.Probes` that
    :class:`~.sizes.MicroBatchSizes` measures with."""

    def __init__(self, engine: Any, batch: Any) -> None:
        self.engine, self.batch = engine, batch
        module = engine.trainer.lightning_module
        self.device = engine.trainer.strategy.root_device
        self.floor = smallest_micro_batch(module)
        self.evaluates = is_overridden("validation_step", module)
        self.seconds: float | None = None
        """The last probe's forward and backward (or evaluation step), in seconds on the device's clock; None
        if it ran out of memory, or ran under a tracker (on a CPU), whose cost on every op would count as a
        micro-step's fixed cost: seconds the search could rule ways out on by noise."""

    def peak(self, samples: int, evaluation: bool = False) -> int | None:
        """Peak bytes of one training (``evaluation``: validation) micro-step of ``samples`` samples of the
        batch, None if it ran out of memory, every state left as it was (:func:`measure_peak`); its seconds
        in :attr:`seconds`."""
        strategy, optimizers = self.engine.trainer.strategy, self.engine.trainer.optimizers
        tracker = None if self.device.type == "cuda" else MemoryTracker(strategy.model, optimizers)
        if tracker is not None:  # what the device holds meanwhile, which an allocator would count too
            for tensor in self._held_tensors():
                tracker.mark(tensor, "other")
        peak = self._run(samples, evaluation, memory_of(self.device, tracker), tracker)
        # Every training step after the first holds the state the first optimizer step creates (AdamW's).
        return peak if peak is None or evaluation else peak + self._states()[1]

    def _run(self, samples: int, evaluation: bool, memory: Any, tracker: Any) -> int | None:
        engine, batch = self.engine, self.batch
        trainer, module = engine.trainer, engine.trainer.lightning_module
        total = engine.batch_size(batch)
        part = batch
        if samples < total:
            part = split_batch(batch, [samples, total - samples], split_fn=engine.split_fn(module))[0]
        step = functools.partial(
            engine.original("validation_step" if evaluation else "training_step"), part, 0
        )
        state = engine.capture(module)
        peak, self.seconds = measure_peak(
            trainer.strategy,
            step,
            memory=memory,
            state=state,
            tracker=tracker,
            evaluation=evaluation,
            clock=step_clock(self.device) if tracker is None else None,
        )
        return peak

    def held(self) -> int:
        """The bytes alive when a micro-step of the batch starts, besides what it allocates: the allocator's
        count on CUDA; elsewhere parameters, buffers, optimizer state, the gradients the backward will
        create, the batch and the step's snapshot for a retry."""
        memory = memory_of(self.device)
        held, to_come = self._states()
        if memory is not None:
            return memory.allocated() + to_come
        return held + to_come + tensor_bytes(self._held_tensors())

    def _states(self) -> tuple[int, int]:
        """The parameters, gradients and optimizer state held (:func:`state_bytes`), and the optimizer state
        the first optimizer step will create (0 once it exists): measured again only when the optimizers'
        state changes."""
        engine, optimizers = self.engine, self.engine.trainer.optimizers
        entries = sum(len(o.state) for o in optimizers)
        if engine.held_at is None or engine.held_at[0] != entries:
            model = engine.trainer.strategy.model
            engine.held_at = (entries, state_bytes(model, optimizers), optimizer_state_to_come(optimizers))
        return engine.held_at[1], engine.held_at[2]

    def _held_tensors(self) -> list[torch.Tensor]:
        snapshot = self.engine.state.tensors() if self.engine.state is not None else []
        return [t for _, t in tensors_of(self.batch, strict=False)] + snapshot
