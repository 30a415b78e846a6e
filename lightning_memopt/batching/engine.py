"""The micro-batch engine: one optimizer batch run as k micro-batches, with OOM retry on every rank.

The one module that patches Lightning's strategy (the names it relies on: :mod:`~.surface`). A training
batch is a :class:`~.step.TrainingStep`; every phase that can run out of memory goes through the one
retry loop, :meth:`MicroBatchEngine.run_with_retry`.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from time import perf_counter
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_memopt._patch import patch
from lightning_memopt.batching.errors import (
    MicroBatchOOMError,
    SplitNotExactError,
    SplitNotExactWarning,
    memory_report,
)
from lightning_memopt.batching.loss import Weigher
from lightning_memopt.batching.outputs import ChangedOrEvery
from lightning_memopt.batching.probe import BatchProbes
from lightning_memopt.batching.regime import (
    PeerOutOfMemory,
    Phase,
    Regime,
    Sharding,
    choose_regime,
    find_sharding,
    is_distributed,
)
from lightning_memopt.batching.shape_model import tokens_per_sample
from lightning_memopt.batching.size_search import smallest_micro_batch
from lightning_memopt.batching.sizes import MicroBatchSizes
from lightning_memopt.batching.split import batch_size, micro_batch_sizes
from lightning_memopt.batching.state import StepState, local_tensor
from lightning_memopt.batching.step import Attempt, EvalStep, OptimizerStep, TrainingStep
from lightning_memopt.batching.thrash import ThrashWatch, thrashing_at_the_floor, watch_allocator
from lightning_memopt.memory.device import is_out_of_memory, memory_of

__all__ = ["Exactness", "MicroBatchEngine", "MicroBatchOOMError"]

Exactness = Literal["warn", "raise", "off"]
_STEPS = ("training_step", "backward", "optimizer_step", "validation_step", "test_step", "predict_step")
_UNKNOWN = object()  # the model's FSDP2 modules, before the first step looked


class MicroBatchEngine:
    """Runs each optimizer batch as micro-batches (see the module docstring).

    Args:
        sizes: The one place that decides the micro-batch size.
        retry_on_oom: Catch out-of-memory errors, restore the step and retry it smaller.
        overlap_after: Under DDP/FSDP2 with retry, stop agreeing before the gradient sync after this many
            clean steps at one size (:mod:`~lightning_memopt.batching.regime`). None: never.
        count_fn: ``count_fn(micro_batch) -> items`` the loss averages over, or ``"sum"``; None: learned.
        split_fn: ``split_fn(batch, sizes) -> micro-batches`` for batches the built-in splitter cannot cut.
        length_fn: ``length_fn(batch) -> tokens per sample`` (None: :func:`~.shapes.tokens_per_sample`).
        log_metrics: Log the ``batching/*`` keys.
        exactness: On the first split step of each batch structure, check that the split gives the unsplit
            gradient; ``"warn"`` / ``"raise"`` say why when it does not; ``"off"`` does not check.
    """

    def __init__(
        self,
        sizes: MicroBatchSizes,
        *,
        retry_on_oom: bool = False,
        overlap_after: int | None = None,
        count_fn: Callable[[Any], Any] | str | None = None,
        split_fn: Callable[[Any, list[int]], list[Any]] | None = None,
        length_fn: Callable[[Any], int] | None = None,
        log_metrics: bool = False,
        exactness: Exactness = "warn",
    ) -> None:
        self.sizes = sizes
        self.retry_on_oom, self.overlap_after, self.log_metrics = retry_on_oom, overlap_after, log_metrics
        self.exactness = exactness
        self._split_fn, self._length_fn = split_fn, length_fn
        self.weights = Weigher(count_fn)
        self.thrash_watch = ThrashWatch()
        # what happened (read by the callbacks and tests)
        self.num_micro_batches = 1
        self.ran_size: int | None = None  # samples of the largest micro-batch of the last pass
        self.last_failure: str | None = None
        self.last_regime: str | None = None
        self.warned: set[str] = set()  # messages said once
        self.checked_keys: set[str] = set()  # batch structures whose split was checked (saved: not again)
        self.written: set[str] = set()  # parameters and buffers training_step was seen to write in place
        self._trainer_ref: weakref.ref | None = None
        self._undo: list[Callable[[], None]] = []
        self._originals: dict[str, Callable[..., Any]] = {}
        self._sharding: Any = _UNKNOWN
        self._batch_idx = 0  # of the step running (for optimizer_zero_grad)
        self._skip_zero_grad = False
        self._pending_backward = False
        self.state: StepState | None = None  # the step's start, for a retry (None between steps)
        self._metrics = ChangedOrEvery()
        self._step_end: float | None = None  # when the last training step's backward ended (wall clock)
        self._timed = (0.0, 0)  # seconds and steps between step ends since the last log
        # optimizer state entries; state_bytes and the state the first optimizer step will create, then
        self.held_at: tuple[int, int, int] | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def trainer(self) -> Any:
        """The Trainer served, held weakly (a fit's end must not depend on the engine letting go)."""
        return None if self._trainer_ref is None else self._trainer_ref()

    @property
    def installed(self) -> bool:
        return bool(self._undo)

    def install(self, trainer: Any) -> None:
        """Patch the strategy's step methods and the module's ``optimizer_zero_grad`` for this fit."""
        if self._undo:
            raise RuntimeError("this MicroBatchEngine is installed already; uninstall it first")
        self._trainer_ref = weakref.ref(trainer)
        strategy = trainer.strategy
        for name in _STEPS:
            if name in vars(strategy):
                raise RuntimeError(
                    f"strategy.{name} is already replaced on the instance; cannot wrap it twice"
                )
            self._originals[name] = getattr(strategy, name)
        wrappers = {"training_step": self._training_step, "backward": self._backward}
        wrappers["optimizer_step"] = self._optimizer_step
        wrappers |= {name: functools.partial(self._eval_step, name) for name in _STEPS[3:]}
        self._undo = [patch(strategy, name, wrapper) for name, wrapper in wrappers.items()]
        self._undo.append(patch(trainer.lightning_module, "optimizer_zero_grad", self._zero_grad_hook))

    def uninstall(self) -> None:
        """Take every patch off and drop what the fit left behind (safe to call twice)."""
        for undo in reversed(self._undo):
            undo()
        self._undo, self._originals = [], {}
        self.state, self._sharding, self.held_at = None, _UNKNOWN, None

    # ------------------------------------------------------------------ the retry loop
    def run_with_retry(self, attempt: Attempt) -> tuple[Regime, int]:
        """Run ``attempt`` until it succeeds on every rank; the one retry loop of the engine.

        Each round: ``attempt.choose()`` the regime, ``attempt.run(regime)``, catch an out-of-memory error
        (only with ``retry_on_oom``; every other error propagates) or another rank's, learned at a sync
        point; let the regime agree whether any rank failed; if one did, ``attempt.recover(failure)``.

        Returns:
            The successful attempt's regime, and how many attempts failed before it.
        """
        retries = 0
        while True:
            regime = attempt.choose()
            failure: str | None = None
            peer = False
            try:
                attempt.run(regime)
            except PeerOutOfMemory:
                peer = True  # learned at a sync point, which was this attempt's agreement
            except BaseException as error:
                if not (self.retry_on_oom and is_out_of_memory(error)):
                    raise
                failure = f"{type(error).__name__}: {error}"
            # Outside the except block: the traceback, and the attempt's tensors its frames hold, are gone.
            if failure is not None:
                self.last_failure = failure + "\n" + self._memory_report(attempt.size)
            if not regime.failed(self.last_failure if failure is not None else None, peer):
                failure = self._settle(attempt, regime)
                if failure is None:
                    return regime, retries
            attempt.recover(failure)
            retries += 1

    def _settle(self, attempt: Attempt, regime: Regime) -> str | None:
        """``attempt.settle`` once every rank's run succeeded; its out-of-memory error (with ``retry_on_oom``)
        as a failure to recover from, else None. Not agreed: under DDP or FSDP2 the other ranks are inside
        the same collectives then, as they were when the check ran inside the attempt."""
        try:
            attempt.settle(regime)
        except BaseException as error:
            if not (self.retry_on_oom and is_out_of_memory(error)):
                raise
            failure = f"{type(error).__name__}: {error}"
        else:
            return None
        self.last_failure = failure + "\n" + self._memory_report(attempt.size)
        return failure

    def choose(self, phase: Phase, micro_batches: int = 1, size: int = 0) -> Regime:
        """The regime of one attempt of ``phase`` (:func:`~.regime.choose_regime`)."""
        return choose_regime(
            phase,
            self.trainer.strategy,
            retry=self.retry_on_oom,
            sharding=self.sharded(),
            micro_batches=micro_batches,
            stable_steps=self.sizes.stable_steps,
            overlap_after=self.overlap_after,
            size=size,
            done=self.sizes.done,
        )

    def sharded(self) -> Sharding | None:
        """The model's FSDP2 modules, found once per fit (on the first step: the strategy shards in setup)."""
        if self._sharding is _UNKNOWN:
            self._sharding = find_sharding(self.trainer.strategy.model)
        return self._sharding

    # ------------------------------------------------------------------ training
    def _training_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        module = self.trainer.lightning_module
        own_state = self.retry_on_oom and self.state is None  # not inside our optimizer_step wrapper
        if own_state:
            self.state = self.capture(module)
        self._batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        before = self._allocator_retries()
        step = TrainingStep(self, args[0], args[1:], kwargs)
        regime, retries = self.run_with_retry(step)
        regime.succeeded()
        if own_state:
            self.state = None
        model = self.sizes.model
        key = self.sizes.tokens if model is None else model.revision  # what the thrash watch keys on
        self.sizes.succeeded(retried=retries > 0, total=step.total, size=step.size, seconds=step.seconds)
        if before is not None:  # the allocator's retries during the step (thrash.py)
            retried = self._allocator_retries() - before
            floor = watch_allocator(self.thrash_watch, self.sizes, retried, step, key, failed=retries > 0)
            if floor and "thrashing" not in self.warned:
                self.warned.add("thrashing")
                rank_zero_warn(thrashing_at_the_floor(step.size, self.sizes.done))
        if step.loss is None:  # training_step returned None: Lightning skips the step
            return step.output
        step.result.recorder.flush(step.result.losses, step.loss)
        now = perf_counter()
        if self._step_end is not None:
            self._timed = (self._timed[0] + now - self._step_end, self._timed[1] + 1)
        self._step_end = now
        if self.log_metrics:
            values = {"micro_batch_size": step.size, "num_micro_batches": len(step.sizes)}
            values["oom_retries"] = self.sizes.oom_retries
            if self.sizes.step_seconds is not None:  # timed by the trial or its probes (sizes.py: decide)
                values["step_seconds_predicted"] = self.sizes.step_seconds
            if before is not None:  # thrashing is watched
                values["near_misses"] = self.sizes.near_misses
            self._metrics.log(type(module).log.__get__(module), self.trainer, values, self._step_seconds)
        self._pending_backward = True
        loss = step.loss.detach().requires_grad_(True)  # a fresh leaf: Lightning's backward only fires hooks
        return loss if step.output is None else {**step.output, "loss": loss}

    def _step_seconds(self) -> dict[str, float]:
        """The mean wall-clock seconds of the optimizer steps since the last log (from one training step's
        end to the next: the optimizer, the next batch's loading, its forward and backward), then reset."""
        seconds, steps = self._timed
        self._timed = (0.0, 0)
        return {"step_seconds": seconds / steps} if steps else {}

    def zero_grad(self) -> None:
        """Zero the gradients now, through the module's own hook, and skip the call Lightning makes after
        ``training_step`` (automatic optimization zeroes after the step, not before)."""
        trainer = self.trainer
        module = trainer.lightning_module
        self._skip_zero_grad = False
        for optimizer in trainer.optimizers:
            module.optimizer_zero_grad(trainer.current_epoch, self._batch_idx, optimizer)
        self._skip_zero_grad = True

    def _zero_grad_hook(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._skip_zero_grad:
            self._skip_zero_grad = False
            return None
        return original(*args, **kwargs)

    def original(self, name: str) -> Callable[..., Any]:
        """The strategy's own method ``name`` (one of the patched step methods)."""
        return self._originals[name]

    def _backward(
        self, original: Callable[..., Any], closure_loss: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        if not self._pending_backward:
            return original(closure_loss, *args, **kwargs)
        self._pending_backward = False
        # The gradients are already there; fire on_before_backward/on_after_backward once, as Lightning would.
        strategy = self.trainer.strategy
        module = strategy.lightning_module
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, module)
        return strategy.precision_plugin.post_backward(closure_loss, module)

    # ------------------------------------------------------------------ what a step uses
    def batch_size(self, batch: Any) -> int:
        """Samples in ``batch``; ``len(batch)`` for batches only the user's ``split_fn`` can cut."""
        try:
            return batch_size(batch)
        except (TypeError, ValueError):
            if self.split_fn(self.trainer.lightning_module) is None:
                raise
            return len(batch)

    def length(self, batch: Any) -> int:
        """Tokens (or other units) per sample of ``batch``, which its memory grows with.

        Raises:
            ValueError: If ``length_fn`` returns something other than a positive int.
        """
        if self._length_fn is None:
            return tokens_per_sample(batch)
        length = self._length_fn(batch)
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(
                f"length_fn(batch) must return a positive int (tokens per sample), got {length!r}"
            )
        return length

    def split_fn(self, module: Any) -> Callable | None:
        """The user's splitter: ``split_fn``, else the module's ``split_batch`` hook, else None (built-in)."""
        hook = getattr(module, "split_batch", None)
        return self._split_fn or (hook if callable(hook) else None)

    def check_due(self, key: str) -> bool:
        """Whether the split of a batch of structure ``key`` (:func:`~.loss.batch_key`) is still to be checked."""
        return self.exactness != "off" and key not in self.checked_keys

    def report_inexact(self, cause: str, *, local: bool = False) -> None:
        """Say, once per cause, that micro-batching changes this step (``exactness="raise"``: raise).

        ``local``: found by this rank alone, which the others may not reach at this step; warned (from
        every rank that found it), never raised, so that no rank waits for one that stopped."""
        message = f"Micro-batching does not give this step the unsplit batch's gradient: {cause}."
        if self.exactness == "raise" and not local:
            raise SplitNotExactError(message)
        if message not in self.warned:
            self.warned.add(message)
            if local:
                warnings.warn(message, SplitNotExactWarning, stacklevel=2)
            else:
                rank_zero_warn(message, category=SplitNotExactWarning)

    def capture(self, module: Any) -> StepState:
        """The state a step may change besides weights and optimizer state (RNGs, buffers, metrics, and
        the parameters a step was seen to write in place, so that a retry starts from them too)."""
        scaler = getattr(self.trainer.strategy.precision_plugin, "scaler", None)
        written = [p for name, p in module.named_parameters() if name in self.written]
        return StepState.capture([module], scaler, written)

    def restore(self) -> None:
        """Put the step's start back (after a failed attempt) and free the allocator's cache."""
        if self.state is not None:
            self.state.restore()
        if (memory := self._device_memory()) is not None:
            memory.empty_cache()

    def put_gradients(self, grads: list[torch.Tensor | None]) -> None:
        """Set every parameter's gradient to the copies in ``grads`` (:func:`~.exactness.gradients`)."""
        for p, g in zip(self.trainer.lightning_module.parameters(), grads):
            if g is None:
                p.grad = None
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a DTensor for a sharded parameter
            local_tensor(p.grad).copy_(g)

    # ------------------------------------------------------------------ the optimizer step
    def _optimizer_step(
        self,
        original: Callable[..., Any],
        optimizer: Any,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        """The optimizer step with OOM retry (:class:`~.step.OptimizerStep`)."""
        if not self.retry_on_oom:
            return original(optimizer, closure, model, **kwargs)
        self.state = self.capture(self.trainer.lightning_module)
        try:
            return OptimizerStep(self, original, optimizer, closure, model, kwargs).run_all()
        finally:
            self.state = None

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, hook: str, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._step_end = None  # an evaluation between two training steps is not a step's time
        if self.sizes.eval_size is None and not self.retry_on_oom:
            return original(*args, **kwargs)
        attempt = EvalStep(self, hook, original, args, kwargs)
        self.run_with_retry(attempt)
        return attempt.result

    # ------------------------------------------------------------------ probing
    def probes(self, batch: Any) -> BatchProbes:
        """What the sizes need to measure ``batch`` (:class:`~.probe.BatchProbes`)."""
        return BatchProbes(self, batch)

    def peek(self, batch: Any) -> int:
        """Samples of the largest micro-batch ``batch`` will run as, from what is known now (no probe, no
        collective, nothing changed). The step may then run smaller ones (a retry, the ranks' agreed
        count) or, after a probe of a new length, larger."""
        module = self.trainer.lightning_module
        total = self.batch_size(batch)
        size = self.sizes.peek(total=total, width=self.length(batch), held=self.probes(batch).held())
        return max(micro_batch_sizes(total, size, smallest=smallest_micro_batch(module)))

    # ------------------------------------------------------------------ helpers
    def _allocator_retries(self) -> int | None:
        """The CUDA allocator's cumulative retries, where thrashing is watched: with OOM retry on, on CUDA,
        in one process or with a memory model over shapes (whose per-step agreement on the count lets each
        rank lower its own sizes); None elsewhere."""
        if not self.retry_on_oom or (is_distributed() and self.sizes.model is None):
            return None
        memory = self._device_memory()
        return None if memory is None else memory.alloc_retries()

    def _device_memory(self, tracker: Any = None) -> Any:
        return memory_of(self.trainer.strategy.root_device, tracker)

    def _memory_report(self, size: int | None) -> str:
        """What the failed try at ``size`` samples per micro-batch held, by category."""
        module, optimizers = self.trainer.lightning_module, self.trainer.optimizers
        return memory_report(module, optimizers, size, self._device_memory())
