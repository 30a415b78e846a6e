"""The micro-batch engine: one optimizer batch run as k micro-batches, with OOM retry on every rank.

This is the one module of the package that touches Lightning's internals. It relies on exactly the
names listed in :data:`LIGHTNING_SURFACE` (``tests/batching/test_engine.py`` checks them, so a Lightning
upgrade that changes them fails loudly instead of training wrongly):

- ``Strategy.training_step`` / ``backward`` / ``optimizer_step`` / ``validation_step`` / ``test_step`` /
  ``predict_step`` are called by the loops through ``getattr(trainer.strategy, name)``, so the engine
  installs instance attributes of the same names at fit start and deletes them at teardown.
- Automatic optimization calls ``training_step`` → ``optimizer_zero_grad`` (first batch of an
  accumulation window only) → ``backward`` → ``optimizer.step``, all inside the closure that
  ``optimizer.step(closure)`` runs. Zero-grad comes AFTER training_step, so the engine zeroes gradients
  itself before the micro-batches and turns the LightningModule's ``optimizer_zero_grad`` into a no-op
  for the call that follows.
- ``Precision.pre_backward`` / ``post_backward`` fire ``on_before_backward`` / ``on_after_backward``;
  the engine calls only those for its step, once, with the full gradient in place. The strategy's own
  ``pre_backward`` is skipped (DDP's reducer is not prepared a second time).
- ``ParallelStrategy.block_backward_sync`` gives DDP's ``no_sync``; ``precision_plugin.scaler`` is the
  GradScaler of ``16-mixed``.

What one training step does (``_training_step``), top to bottom:

1. Capture the step's start state (RNGs, buffers, torchmetrics, GradScaler) if OOM retry is on.
2. Zero gradients; split the batch into micro-batches of ``micro_batch_size`` samples.
3. For each micro-batch: the user's ``training_step`` (through the strategy, so DDP/FSDP forward and
   autocast apply), its loss times its share of the items the loss averages over (samples, or
   tokens that are not -100: :mod:`lightning_memopt.batching.counting`), scaled by the GradScaler,
   ``.backward()``. Logged values are recorded, not logged yet.
4. Under DDP with OOM retry, every micro-batch ran under ``no_sync``; the ranks agree whether any ran
   out of memory (one 8-byte all-reduce), then average gradients. Without retry, the last micro-batch
   synchronizes gradients as DDP normally does (communication overlaps backward).
5. On an out-of-memory error (anywhere in 3, on any rank): outside the ``except`` block, drop the
   attempt's gradients, restore the start state, halve the micro-batch and run the batch again. At one
   sample per micro-batch (two with BatchNorm in training mode), every rank raises
   :class:`MicroBatchOOMError` (after agreeing, so no rank waits).
6. Log each recorded value once, as the weighted mean over micro-batches (the full-batch value),
   and return the full-batch loss as a fresh leaf tensor; the wrapped ``backward`` then only fires the
   hooks.

Under a distributed strategy with OOM retry (``OOMBackoff``), an OOM on any rank makes every rank drop
the attempt and retry at the same size, and no rank waits in a collective that another will not reach.
The rule that guarantees it: after any point where a rank can run out of memory, the next collective of
every rank is a sync point (``any_rank``, an 8-byte all-reduce), which the failed rank answers "yes"
from its recovery path. Small collectives per training step (tested exactly in
``tests/callbacks/test_distributed.py``):

- **DDP**: one agreement per step attempt, after the micro-batches (which run under ``no_sync``) and
  before the gradients are averaged. With ``overlap_after`` once stable: one sync point before the last
  micro-batch, which then synchronizes inside its backward (an OOM in it ends the run).
- **FSDP2** (``ModelParallelStrategy``): FSDP all-gathers and reduce-scatters per sharded module inside
  forward and backward, so a rank that failed inside one module cannot reach a peer that is already in
  a later module's collective; one agreement per micro-batch is not enough. Sync points run, per
  micro-batch, before each sharded module's forward all-gather, on the loss before backward, before
  each sharded module's backward all-gather, before each reduce-scatter that FSDP runs in a module's
  post-backward function, and before FSDP's final callback (see :meth:`MicroBatchEngine._arm_sharded`):
  ``2 P + R + 2`` per micro-batch for ``P`` sharded modules with parameters of their own, ``R`` of them
  with inputs that require grad, plus the step's agreement (7 per micro-batch for two sharded layers).
  Modules without parameters of their own (a root wrapping only sharded children) get none. With
  ``overlap_after`` once stable: no sync point and no agreement (0 per step); an OOM then raises
  :class:`MicroBatchOOMError` on that rank and the others fail at their next collective.
- **Evaluation** (``validation_step`` etc., both): one agreement per attempt; under FSDP2 also the
  forward sync points (``P`` per micro-batch).
- **Optimizer step** (both): the first step at each micro-batch size — the fit's first, when optimizer
  state is created lazily, and the first after every back-off or growth — copies parameters and
  optimizer state to host memory, steps, and agrees once more; if any rank ran out of memory, every rank
  restores the copy and backs off. Later steps at that size neither copy nor agree: an OOM in them
  raises :class:`MicroBatchOOMError` on that rank, and the others fail at their next collective.

Not covered: an OOM inside FSDP's or DDP's own communication buffers (the peer is already in that
collective), and collectives inside the optimizer step itself (e.g. gradient-norm clipping under
FSDP2) after a rank's OOM in the step's pre-work.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy, ParallelStrategy, Strategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_memopt.batching.counting import causal_shift, choose_count
from lightning_memopt.batching.distributed import all_reduce_gradients, any_rank, is_distributed
from lightning_memopt.batching.errors import BATCHNORM_ADVICE, CHECKLIST, MicroBatchOOMError
from lightning_memopt.batching.oom import is_out_of_memory
from lightning_memopt.batching.sizing import smallest_micro_batch
from lightning_memopt.batching.split import batch_size, micro_batch_sizes, micro_batch_weights, split_batch
from lightning_memopt.batching.state import OptimizerSnapshot, StepState, drop_gradients
from lightning_memopt.memory.device import device_memory
from lightning_memopt.memory.units import format_bytes

__all__ = ["LIGHTNING_SURFACE", "MicroBatchEngine", "MicroBatchOOMError"]

#: The Lightning names this module relies on: (object, attribute). Checked by a test.
LIGHTNING_SURFACE = (
    (Strategy, "training_step"),
    (Strategy, "backward"),
    (Strategy, "optimizer_step"),
    (Strategy, "validation_step"),
    (Strategy, "test_step"),
    (Strategy, "predict_step"),
    (Strategy, "precision_plugin"),
    (Strategy, "lightning_module"),
    (Strategy, "model"),
    (Strategy, "root_device"),
    (ParallelStrategy, "block_backward_sync"),
    (FSDPStrategy, "_activation_checkpointing_kwargs"),  # an instance attribute; read by AutoCheckpoint
)

_EVAL_HOOKS = ("validation_step", "test_step", "predict_step")
# One engine per Trainer. An engine refers to its Trainer only weakly (MicroBatchEngine._trainer): a value
# that held its own key would keep the Trainer, and its model, alive for the whole process.
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNKNOWN = object()  # the model's loss convention, before the first split step looked at it


class _PeerOutOfMemory(Exception):
    """Raised at a sync point when another rank ran out of memory (FSDP2: collectives in forward/backward)."""


class _SyncInBackward(torch.autograd.Function):
    """Identity on its tensors; its backward runs the engine's sync point (and, on a micro-batch's loss,
    queues one more to run when the backward ends, before FSDP's final callback that it precedes)."""

    @staticmethod
    def forward(ctx, engine: MicroBatchEngine, queue_final: bool, *tensors: torch.Tensor):
        ctx.engine, ctx.queue_final = engine, queue_final
        ctx.set_materialize_grads(False)
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        if ctx.queue_final:
            torch.autograd.Variable._execution_engine.queue_callback(ctx.engine._sync_point)
        ctx.engine._sync_point()
        return (None, None, *grads)


def _in_backward() -> bool:
    """True while autograd runs a backward (e.g. an activation checkpoint recomputing its forward)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)  # private; present on torch 2.x
    return task_id is not None and task_id() != -1


class MicroBatchEngine:
    """Runs each optimizer batch as micro-batches; shared by ``AutoAccumulation`` and ``OOMBackoff``.

    One engine per Trainer (:meth:`for_trainer`); each callback sets the options it owns and calls
    :meth:`install` / :meth:`uninstall`, which are counted, so two callbacks never wrap twice.

    Attributes:
        micro_batch_size: Samples per training micro-batch; None runs the whole batch at once.
        eval_micro_batch_size: Samples per validation/test/predict micro-batch; None = whole batch.
        retry_on_oom: Catch out-of-memory errors, restore the step and retry with half the size.
        grow_after: After this many clean steps at a reduced size, try a larger one (None: never).
        overlap_after: Under DDP with OOM retry, after this many clean steps at one size, let the last
            micro-batch synchronize gradients inside its backward (overlap) after agreeing on the first
            k-1; an OOM in that last micro-batch then ends the run. None (default): never.
        count_fn: ``count_fn(micro_batch) -> number`` of loss elements (e.g. non-padding tokens) for
            losses that are a mean over something other than samples; None: the default of
            :func:`~lightning_memopt.batching.counting.choose_count` (Hugging Face ``labels``, else samples).
        split_fn: ``split_fn(batch, sizes) -> list`` for batch types the built-in splitter cannot cut.
        log_metrics: Log ``batching/*`` keys from the training step.
    """

    def __init__(self) -> None:
        self.micro_batch_size: int | None = None
        self.eval_micro_batch_size: int | None = None
        self.retry_on_oom = False
        self.grow_after: int | None = None
        self.count_fn: Callable[[Any], float] | None = None
        self.split_fn: Callable[[Any, list[int]], list[Any]] | None = None
        self.log_metrics = False
        # what happened (read by the callbacks and tests)
        self.num_micro_batches = 1
        self.oom_retries = 0
        self.eval_oom_retries = 0
        self.clean_steps = 0
        self.stable_steps = 0  # clean steps in a row at the current size (overlap mode needs overlap_after)
        self.overlap_after: int | None = None
        self._overlapping = False
        self._past_sync_point = False
        self._unsynced = False  # FSDP2, overlap_after reached: this step runs without sync points
        self.max_micro_batch_size: int | None = None  # cap when growing back (the size we started at)
        self.smallest_failed_size: int | None = None
        self.last_failure: str | None = None
        # machinery
        self._trainer_ref: weakref.ref | None = None
        self._shift: Any = _UNKNOWN  # counting.causal_shift of the module, found on the first split step
        self._warned = False
        self._installs = 0
        self._originals: dict[str, Any] = {}
        self._zero_grad_patched = False
        self._skip_zero_grad = False
        self._pending_backward = False
        self._state: StepState | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def _trainer(self) -> Any:
        """The Trainer served, held weakly: the registry's value must not keep its own key alive."""
        return None if self._trainer_ref is None else self._trainer_ref()

    @_trainer.setter
    def _trainer(self, trainer: Any) -> None:
        self._trainer_ref = None if trainer is None else weakref.ref(trainer)

    @classmethod
    def for_trainer(cls, trainer: Any) -> MicroBatchEngine:
        """The engine of ``trainer``, created on first use (both callbacks share it)."""
        engine = _ENGINES.get(trainer)
        if engine is None:
            engine = _ENGINES[trainer] = cls()
        return engine

    def check(self, trainer: Any, pl_module: Any) -> None:
        """Refuse set-ups the engine cannot run exactly.

        Raises:
            MisconfigurationException: Manual optimization, DeepSpeed, or ``accumulate_grad_batches > 1``.
        """
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                "micro-batching needs automatic optimization, but the LightningModule sets "
                "`automatic_optimization = False`; split the batch inside your own training_step "
                "(lightning_memopt.batching.split_batch) or remove AutoAccumulation/OOMBackoff"
            )
        if "deepspeed" in type(trainer.strategy).__name__.lower():
            raise MisconfigurationException(
                f"micro-batching does not work with {type(trainer.strategy).__name__}: DeepSpeed owns gradient "
                "accumulation; use its `train_micro_batch_size_per_gpu` config instead of AutoAccumulation/OOMBackoff"
            )
        self._check_accumulation(trainer)

    def _check_accumulation(self, trainer: Any) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} with micro-batching: the engine "
                "already accumulates within each batch. Make the DataLoader batch the optimizer batch "
                f"(batch_size * {trainer.accumulate_grad_batches}) and set accumulate_grad_batches=1 "
                "(and no GradientAccumulationScheduler); the effective batch stays the same and the "
                "engine picks how many micro-batches to run"
            )

    def install(self, trainer: Any) -> None:
        """Wrap the strategy's step methods (counted: the second install of a trainer is a no-op)."""
        if self._installs and self._trainer is not trainer:
            raise RuntimeError("a MicroBatchEngine serves one Trainer; use MicroBatchEngine.for_trainer")
        self._installs += 1
        if self._installs > 1:
            return
        self._trainer = trainer
        strategy = trainer.strategy
        wrappers = {
            "training_step": self._training_step,
            "backward": self._backward,
            "optimizer_step": self._optimizer_step,
        }
        for hook in _EVAL_HOOKS:
            wrappers[hook] = self._make_eval_step(hook)
        for name, wrapper in wrappers.items():
            if name in vars(strategy):
                raise RuntimeError(
                    f"strategy.{name} is already replaced on the instance; cannot wrap it twice"
                )
            self._originals[name] = getattr(strategy, name)
            setattr(strategy, name, wrapper)

    def uninstall(self) -> None:
        """Undo :meth:`install` when the last user calls it."""
        if self._installs == 0:
            return
        self._installs -= 1
        if self._installs:
            return
        strategy = self._trainer.strategy
        for name in self._originals:
            vars(strategy).pop(name, None)
        self._originals.clear()
        module = self._trainer.lightning_module
        if module is not None and self._zero_grad_patched:
            vars(module).pop("optimizer_zero_grad", None)
        self._zero_grad_patched = False
        self._state = None
        self._shift = _UNKNOWN  # the next fit may train another model

    @property
    def installed(self) -> bool:
        return self._installs > 0

    # ------------------------------------------------------------------ training
    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer
        module = trainer.lightning_module
        self._check_accumulation(trainer)  # a GradientAccumulationScheduler may change it mid-fit
        batch, batch_idx = args[0], (args[1] if len(args) > 1 else kwargs.get("batch_idx", 0))
        total = self.batch_size(batch, module)
        own_state = self.retry_on_oom and self._state is None  # not inside our optimizer_step wrapper
        if own_state:
            self._state = self._capture(module)
        step_retries = 0
        while True:
            size = min(self.micro_batch_size or total, total)
            self._zero_grad(module, batch_idx)
            failure: str | None = None
            peer = False  # another rank's OOM was learned at a sync point (which was this step's agreement)
            self._overlapping = self._past_sync_point = self._unsynced = False
            try:
                result = self._run_micro_batches(batch, args[1:], kwargs, total, size)
            except _PeerOutOfMemory:
                peer = True
            except BaseException as error:
                if not (self.retry_on_oom and is_out_of_memory(error)):
                    raise
                failure = f"{type(error).__name__}: {error}"
                self.last_failure = failure + "\n" + self._memory_report(module)
            # Outside the except block: the traceback, and the attempt's tensors its frames hold, are gone.
            if peer:
                failed = True
            elif failure is not None and self._past_sync_point:
                # Overlap mode: this rank ran out of memory while gradients synchronize in backward; the
                # other ranks are inside DDP's all-reduce and no agreement can reach them any more.
                raise MicroBatchOOMError(
                    "out of memory in the last micro-batch while DDP synchronizes gradients during backward "
                    "(OOMBackoff(overlap_after=...) mode); this cannot be retried on every rank. Keep "
                    f"overlap_after=None (the default) to make every OOM recoverable.\n{self.last_failure}"
                )
            elif failure is not None and self._unsynced:
                # FSDP2 once stable with overlap_after: no sync points ran, the other ranks are inside an
                # FSDP collective or past the step, and no agreement can reach them.
                raise MicroBatchOOMError(
                    f"out of memory under FSDP2 after {self.stable_steps} clean steps at micro-batch size "
                    f"{size}, with OOMBackoff(overlap_after={self.overlap_after}): the sync points that let "
                    "every rank retry were off, so this cannot be retried on every rank. Keep "
                    f"overlap_after=None (the default) to make every OOM recoverable.\n{self.last_failure}"
                )
            elif (self._overlapping or self._unsynced) and failure is None:
                # overlap (DDP): the sync point before the last micro-batch was this step's agreement;
                # unsynced (FSDP2): a rank that ran out of memory raised, no rank waits for an agreement
                failed = False
            elif self.retry_on_oom and self._agreement_needed():
                failed = any_rank(failure is not None, self._device())
            else:
                failed = failure is not None
            if not failed:
                break
            result = None
            self._recover(module, size, total)
            step_retries += 1
        loss, extras, recorder = result
        if (
            self.retry_on_oom
            and self._agreement_needed()
            and not self._fsdp_modules()
            and not self._overlapping
        ):
            all_reduce_gradients(p for p in trainer.strategy.model.parameters())
        if own_state:
            self._state = None
        self._after_clean_step(step_retries, total)
        recorder.flush()
        if self.log_metrics:
            self._log_engine_metrics(recorder.original_log)
        self._pending_backward = True
        loss = loss.requires_grad_(True)  # a fresh leaf: Lightning's backward call only fires the hooks
        return loss if extras is None else {**extras, "loss": loss}

    def _run_micro_batches(
        self, batch: Any, rest: tuple, kwargs: dict, total: int, size: int
    ) -> tuple[torch.Tensor, dict | None, _LogRecorder]:
        trainer = self._trainer
        strategy = trainer.strategy
        module = trainer.lightning_module
        sizes = micro_batch_sizes(total, size, smallest=smallest_micro_batch(module))
        parts = split_batch(batch, sizes, split_fn=self._split_fn(module))
        weights = self._weights(batch, parts, sizes)
        scaler = getattr(strategy.precision_plugin, "scaler", None)
        self.num_micro_batches = len(parts)
        agree = self.retry_on_oom and self._agreement_needed()
        ddp = _ddp_module(strategy)
        # FSDP2 gathers parameters inside forward and backward: a rank that ran out of memory must tell
        # the others before their next collective. Sync points (a tiny all-reduce) run before each of
        # FSDP's collectives (_arm_sharded); gradients reduce-scatter in every micro-batch's backward, so
        # a failed attempt leaves nothing in FSDP's unsharded buffers.
        sharded = agree and bool(self._fsdp_modules())
        # FSDP2 with overlap_after, sizes stable: no sync points and no agreement at all (none is needed
        # when nobody fails, and a rank that fails raises MicroBatchOOMError instead of retrying).
        self._unsynced = (
            sharded and self.overlap_after is not None and self.stable_steps >= self.overlap_after
        )
        sharded = sharded and not self._unsynced
        # Overlap mode (opt-in, DDP, sizes stable): the ranks agree after the first k-1 micro-batches,
        # then the last one synchronizes gradients inside its backward as DDP normally does. The same
        # size just ran k-1 times in this step, but an OOM in that last micro-batch is not recoverable.
        self._overlapping = (
            agree
            and ddp is not None
            and not sharded
            and not self._unsynced
            and len(parts) >= 2
            and self.overlap_after is not None
            and self.stable_steps >= self.overlap_after
        )
        full_loss: torch.Tensor | None = None
        extras: list[dict] = []  # the other keys of each micro-batch's output, detached
        with _LogRecorder(module) as recorder, self._sync_points(armed=sharded):
            for i, (part, weight) in enumerate(zip(parts, weights)):
                last = i == len(parts) - 1
                # Gradients synchronize in the last micro-batch's backward, unless the ranks must first
                # agree that nobody ran out of memory (then they are averaged after the agreement).
                if sharded or self._unsynced:
                    sync = contextlib.nullcontext()  # FSDP2 reduce-scatters in every micro-batch's backward
                elif self._overlapping and last:
                    self._sync_point()
                    self._past_sync_point = True
                    sync = contextlib.nullcontext()
                else:
                    sync = contextlib.nullcontext() if last and not agree else _no_sync(strategy)
                recorder.weight = weight
                _buffer_broadcast(ddp, on=i == 0)
                with sync:
                    out = self._originals["training_step"](part, *rest, **kwargs)
                    loss = _loss_of(out)
                    scaled = loss * weight if len(parts) > 1 else loss  # k=1: no extra op in the graph
                    if scaler is not None:
                        scaled = scaler.scale(scaled)
                    if sharded:  # sync before the backward, and before FSDP's final callback after it
                        (scaled,) = _SyncInBackward.apply(self, True, scaled)
                    # Every micro-batch runs its backward, so DDP/FSDP communicate as expected. One that counts
                    # no items (all labels -100) has a mean over nothing, NaN, as its loss and weighs 0: its
                    # gradients are zeros (cross-entropy's backward writes only at counted positions).
                    scaled.backward()
                if weight > 0 or len(parts) == 1:  # NaN * 0 is NaN: leave it out of the batch's loss
                    part_loss = loss.detach().float()
                    if len(parts) > 1:
                        part_loss = part_loss * weight
                    full_loss = part_loss if full_loss is None else full_loss + part_loss
                if isinstance(out, Mapping):
                    extras.append({k: _detach(v) for k, v in out.items() if k != "loss"})
                del out, loss, scaled
        assert full_loss is not None
        if not extras:
            return full_loss, None, recorder
        # As for the loss: the full batch's output (scalars weighted by share, per-sample tensors joined).
        combined = extras[0] if len(extras) == 1 else _combine(extras, sizes, weights)
        return full_loss, combined, recorder

    def _backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if not self._pending_backward:
            return self._originals["backward"](closure_loss, optimizer, *args, **kwargs)
        self._pending_backward = False
        # The gradients are already there; fire on_before_backward/on_after_backward once, as Lightning would.
        strategy = self._trainer.strategy
        module = strategy.lightning_module
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, module)
        return strategy.precision_plugin.post_backward(closure_loss, module)

    def _optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """The optimizer step with OOM retry.

        Single process: an OOM in the step (clipping, ``on_before_optimizer_step``, the update) restores
        the step's start, halves the micro-batch, runs the training step again and steps again.

        Distributed: the training step (with its own agreement) runs first, then the optimizer's step.
        While sizes are unsettled — the first step at a micro-batch size: the fit's first step, when
        optimizer state is created lazily, and the first after every back-off or growth — parameters and
        optimizer state are copied to host memory before the step, and the ranks agree after it (one
        8-byte all-reduce): if any rank ran out of memory, every rank restores the copy (undoing the
        update the others made), backs off and retries, so all ranks stay equal. Once a size has
        stepped cleanly there is no copy and no agreement (one all-reduce per step stays the training
        agreement); an OOM in a later optimizer step raises :class:`MicroBatchOOMError` on that rank,
        and the other ranks fail at their next collective.
        """
        original = self._originals["optimizer_step"]
        if not self.retry_on_oom:
            return original(optimizer, closure, model, **kwargs)
        module = self._trainer.lightning_module
        self._state = self._capture(module)
        distributed = self._agreement_needed()
        step_closure = closure
        try:
            if distributed:
                # The micro-batches (and their agreement) first, so every rank reaches the agreement below
                # from the same place, whether its optimizer's pre-step work or its update ran out of memory.
                step_closure = functools.partial(_return, closure())
            while True:
                unsettled = distributed and self.stable_steps <= 1  # first clean step at this size
                snapshot = OptimizerSnapshot.capture([optimizer]) if unsettled else None
                failure: str | None = None
                try:
                    output = original(optimizer, step_closure, model, **kwargs)
                except BaseException as error:
                    if not is_out_of_memory(error):
                        raise
                    failure = f"{type(error).__name__}: {error}"
                    self.last_failure = failure + "\n" + self._memory_report(module)
                # Outside the except block: the attempt's tensors are freed.
                if unsettled:
                    failed = any_rank(failure is not None, self._device())
                elif failure is not None and distributed:
                    raise MicroBatchOOMError(
                        "out of memory in the optimizer step on this rank under a distributed strategy, at a "
                        "micro-batch size that had already stepped cleanly (the ranks agree on optimizer-step "
                        "OOMs only for the first step at each size); the other ranks have stepped, so the step "
                        f"cannot be retried.\n{self.last_failure}\n{CHECKLIST}"
                    )
                else:
                    failed = failure is not None
                if not failed:
                    return output
                output = None
                if snapshot is not None:
                    snapshot.restore()  # every rank: undo the update the ranks that did not fail made
                total = self._last_total or 1
                size = min(self.micro_batch_size or total, total)
                self._recover(module, size, total)
                # Run the training step (and its hooks) at the smaller size now, before the optimizer's
                # own pre-step work, so that the retried step starts from the new micro-batches' state.
                step_closure = functools.partial(_return, closure())
        finally:
            self._state = None

    # ------------------------------------------------------------------ recovery
    def _recover(self, module: Any, size: int, total: int) -> None:
        """Drop the failed attempt, restore the step's start, and pick a smaller micro-batch."""
        self._drop_attempt()
        if self._state is not None:
            self._state.restore()
        memory = self._device_memory()
        if memory is not None:
            memory.empty_cache()
        self.oom_retries += 1
        self.clean_steps = 0
        self.stable_steps = 0
        self.smallest_failed_size = min(self.smallest_failed_size or size, size)
        smallest = smallest_micro_batch(module)
        if size <= 1:
            raise MicroBatchOOMError(
                "out of memory with one sample per micro-batch; splitting the batch further cannot help.\n"
                f"{self.last_failure}\n{CHECKLIST}"
            )
        if size <= smallest:
            raise MicroBatchOOMError(
                f"out of memory with {size} samples per micro-batch, the fewest a model with BatchNorm layers in "
                f"training mode can run. {BATCHNORM_ADVICE}\n{self.last_failure}\n{CHECKLIST}"
            )
        if self.max_micro_batch_size is None:
            self.max_micro_batch_size = self.micro_batch_size or total
        self.micro_batch_size = max(math.ceil(size / 2), smallest)

    def _drop_attempt(self) -> None:
        """Drop a failed attempt's gradients and put FSDP2 back to the start of an iteration."""
        # Gradients before the reset: a sharded module whose backward stopped between computing its
        # gradients and reduce-scattering them still has its unsharded parameters registered, so this
        # drops those gradients too. FSDP's reset_iter_state (torch 2.13) registers the sharded
        # parameters again and keeps the unsharded ones' gradients, which the retry would add to (tested).
        drop_gradients([self._trainer.strategy.model])
        if self._reset_fsdp():
            drop_gradients([self._trainer.strategy.model])  # and the sharded parameters registered again

    def _reset_fsdp(self) -> bool:
        """After an attempt that failed inside a sharded module (FSDP mid-iteration: parameters gathered,
        the forward root set), torch's recovery call reshards and clears that state. False without FSDP2."""
        sharded = self._fsdp_modules()
        if not sharded:
            return False
        root = sharded[0]  # the outermost fully_shard module: modules() yields it first
        if hasattr(root, "reset_iter_state"):  # torch >= 2.13
            root.reset_iter_state()
        else:
            for m in sharded:
                m.reshard()
        return True

    def _after_clean_step(self, step_retries: int, total: int) -> None:
        self._last_total = total
        self.stable_steps += 1  # a step that succeeded at the current size (after its retries, if any)
        if step_retries:
            return
        self.clean_steps += 1
        if self.grow_after is None or self.clean_steps < self.grow_after or self.micro_batch_size is None:
            return
        cap = min(self.max_micro_batch_size or total, total)
        if self.smallest_failed_size is not None:
            cap = min(cap, self.smallest_failed_size - 1)
        grown = min(self.micro_batch_size * 2, cap)
        if grown > self.micro_batch_size:
            self.micro_batch_size = grown
            self.stable_steps = 0  # a new size is unsettled again
        self.clean_steps = 0

    _last_total: int | None = None

    def _capture(self, module: Any) -> StepState:
        scaler = getattr(self._trainer.strategy.precision_plugin, "scaler", None)
        return StepState.capture([module], scaler)

    def _zero_grad(self, module: Any, batch_idx: int) -> None:
        """Zero gradients through the module's own hook, and skip the zero-grad Lightning calls next."""
        trainer = self._trainer
        if not self._zero_grad_patched:
            engine = self

            def optimizer_zero_grad(*args: Any, **kwargs: Any) -> None:
                if engine._skip_zero_grad:
                    engine._skip_zero_grad = False
                    return None
                return type(module).optimizer_zero_grad(module, *args, **kwargs)

            module.optimizer_zero_grad = optimizer_zero_grad
            self._zero_grad_patched = True
        for optimizer in trainer.optimizers:
            type(module).optimizer_zero_grad(module, trainer.current_epoch, batch_idx, optimizer)
        self._skip_zero_grad = True

    # ------------------------------------------------------------------ evaluation
    def _make_eval_step(self, hook: str) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            return self._eval_step(hook, *args, **kwargs)

        return step

    def _eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        original = self._originals[hook]
        if self.eval_micro_batch_size is None and not self.retry_on_oom:
            return original(*args, **kwargs)
        module = self._trainer.lightning_module
        batch = args[0]
        total = self.batch_size(batch, module)
        # FSDP2 all-gathers in each sharded module's forward: sync points before them, as in training.
        sharded = self.retry_on_oom and self._agreement_needed() and bool(self._fsdp_modules())
        while True:
            size = min(self.eval_micro_batch_size or total, total)
            failure: str | None = None
            peer = False
            try:
                with self._sync_points(armed=sharded):
                    output = self._run_eval(original, batch, args[1:], kwargs, total, size)
            except _PeerOutOfMemory:
                peer = True  # learned at a sync point, which was this attempt's agreement
            except BaseException as error:
                if not (self.retry_on_oom and is_out_of_memory(error)):
                    raise
                failure = f"{type(error).__name__}: {error}"
            if peer:
                failed = True
            elif self._agreement_needed():
                failed = any_rank(failure is not None, self._device())
            else:
                failed = failure is not None
            if not failed:
                return output
            output = None
            self._reset_fsdp()
            memory = self._device_memory()
            if memory is not None:
                memory.empty_cache()
            self.eval_oom_retries += 1
            if size <= 1:
                raise MicroBatchOOMError(
                    f"out of memory in {hook} with one sample per micro-batch.\n{failure or 'on another rank'}\n"
                    f"{CHECKLIST}"
                )
            self.eval_micro_batch_size = math.ceil(size / 2)

    def _run_eval(
        self, original: Callable, batch: Any, rest: tuple, kwargs: dict, total: int, size: int
    ) -> Any:
        module = self._trainer.lightning_module
        sizes = micro_batch_sizes(total, size)
        if len(sizes) == 1:
            return original(batch, *rest, **kwargs)
        parts = split_batch(batch, sizes, split_fn=self._split_fn(module))
        weights = self._weights(batch, parts, sizes)
        outputs = []
        with _LogRecorder(module) as recorder:
            for part, weight in zip(parts, weights):
                recorder.weight = weight
                outputs.append(original(part, *rest, **kwargs))
        recorder.flush()
        return _combine(outputs, sizes, weights)

    # ------------------------------------------------------------------ probing
    def probe(self, batch: Any, size: int, *, tracker: Any = None, evaluation: bool = False) -> int | None:
        """Run one forward and backward of ``size`` samples of ``batch``; leave every state as it was.

        Weights are not touched (no optimizer step), gradients are dropped, and buffers, torchmetrics
        states and RNGs are restored, so probing changes nothing a later step could see.

        Args:
            batch: A batch of at least ``size`` samples.
            size: Samples to run.
            tracker: A :class:`~lightning_memopt.memory.MemoryTracker` to measure with (CPU and other
                devices); None measures the CUDA allocator.
            evaluation: Run the evaluation form: ``validation_step`` under ``no_grad``, no backward.

        Returns:
            The peak bytes of the probe, or None if it ran out of memory.
        """
        trainer = self._trainer
        strategy = trainer.strategy
        module = trainer.lightning_module
        total = self.batch_size(batch, module)
        part = (
            split_batch(batch, [size, total - size], split_fn=self._split_fn(module))[0]
            if size < total
            else batch
        )
        memory = self._device_memory(tracker)
        state = self._capture(module)
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
                with _LogRecorder(module), _no_sync(strategy):
                    if evaluation:
                        module.eval()
                        with torch.no_grad():
                            self._originals["validation_step"](part, 0)
                    else:
                        out = self._originals["training_step"](part, 0)
                        _loss_of(out).backward()
                        del out
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

    # ------------------------------------------------------------------ helpers
    def _weights(self, batch: Any, parts: list[Any], sizes: list[int]) -> list[float]:
        """Each micro-batch's share of the items its loss averages over (:mod:`~.counting` says which)."""
        if len(parts) == 1:
            return [1.0]
        if self.count_fn is not None:
            return micro_batch_weights(parts, sizes, self.count_fn)
        if self._shift is _UNKNOWN:
            self._shift = causal_shift(self._trainer.lightning_module)
        count_fn, warning = choose_count(batch, self._shift, check_ignored=not self._warned)
        if warning is not None and not self._warned:
            self._warned = True
            rank_zero_warn(warning)
        if count_fn is not None and count_fn(batch) == 0:
            count_fn = None  # nothing counted in the whole batch: its loss is NaN either way
        return micro_batch_weights(parts, sizes, count_fn)

    def batch_size(self, batch: Any, module: Any) -> int:
        """Samples in ``batch``; ``len(batch)`` for batches only the user's ``split_fn`` can cut."""
        try:
            return batch_size(batch)
        except (TypeError, ValueError):
            if self._split_fn(module) is None:
                raise
            return len(batch)

    def _split_fn(self, module: Any) -> Callable | None:
        if self.split_fn is not None:
            return self.split_fn
        hook = getattr(module, "split_batch", None)
        return hook if callable(hook) else None

    def _agreement_needed(self) -> bool:
        return is_distributed()

    def _fsdp_modules(self) -> list[torch.nn.Module]:
        """The FSDP2 (``fully_shard``) modules of the model, root first; empty without FSDP2."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # torch without FSDP2
            return []
        return [m for m in self._trainer.strategy.model.modules() if isinstance(m, FSDPModule)]

    def _sync_point(self) -> None:
        """All ranks: has anyone run out of memory? (A rank that did answers from its except path.)"""
        if any_rank(False, self._device()):
            raise _PeerOutOfMemory

    def _sharded_with_parameters(self) -> list[torch.nn.Module]:
        """The FSDP2 modules that manage parameters of their own (the ones whose hooks communicate)."""
        sharded = self._fsdp_modules()
        ids = {id(m) for m in sharded}
        owners = []
        for m in sharded:
            inner = {id(p) for c in m.modules() if c is not m and id(c) in ids for p in c.parameters()}
            if any(id(p) not in inner for p in m.parameters()):
                owners.append(m)
        return owners

    @contextlib.contextmanager
    def _sync_points(self, armed: bool):
        """Sync points in front of every FSDP2 collective of a micro-batch (see :meth:`_arm_sharded`)."""
        handles = self._arm_sharded() if armed else []
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _arm_sharded(self) -> list[Any]:
        """Hooks that run a sync point before each FSDP2 all-gather and reduce-scatter of a micro-batch.

        Per sharded module with parameters of its own, verified on torch 2.13 (FSDP2 registers its
        pre-forward hook with ``prepend=True`` and its post-forward hook after the module's others):

        - forward: a pre-hook prepended after ``fully_shard`` runs before FSDP's, which all-gathers;
        - before its backward all-gather: a forward hook prepended before FSDP's post-forward registers
          a tensor hook on the outputs; FSDP's post-forward then registers its pre-backward (all-gather,
          prefetch of the next module) on the same tensors, and tensor hooks run in registration order;
        - before its reduce-scatter: a forward pre-hook that runs after FSDP's (which put its
          post-backward function on the inputs that require grad) puts :class:`_SyncInBackward` on them,
          so in backward the sync point runs before FSDP's post-backward;
        - modules whose inputs need no gradient reduce-scatter in FSDP's final callback of the backward;
          the micro-batch's loss carries a :class:`_SyncInBackward` whose backward (the first node of
          the backward) syncs and queues a sync point as a callback ahead of FSDP's.
        """
        handles = []
        for m in self._sharded_with_parameters():
            handles.append(m.register_forward_pre_hook(lambda *_: self._sync_point(), prepend=True))
            handles.append(m.register_forward_pre_hook(self._sync_before_reduce_scatter, with_kwargs=True))
            handles.append(m.register_forward_hook(self._sync_before_backward_all_gather, prepend=True))
        return handles

    def _sync_before_reduce_scatter(self, module: Any, args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled() or _in_backward():  # no backward, or a checkpoint's recompute
            return None
        leaves, spec = tree_flatten((args, kwargs))
        index = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not index:
            return None
        synced = _SyncInBackward.apply(self, False, *(leaves[i] for i in index))
        for i, t in zip(index, synced):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _sync_before_backward_all_gather(self, module: Any, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or _in_backward():
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        fired = [False]

        def hook(grad: torch.Tensor) -> None:
            if not fired[0]:  # once per forward call, on whichever output's gradient comes first
                fired[0] = True
                self._sync_point()

        for t in tensors:
            t.register_hook(hook)

    def _device(self) -> torch.device:
        return self._trainer.strategy.root_device

    def _device_memory(self, tracker: Any = None) -> Any:
        device = self._device()
        if device.type == "cuda":
            return device_memory(device)
        if tracker is not None:
            return device_memory(device, tracker=tracker)
        return None

    def _memory_report(self, module: Any) -> str:
        """Bytes of the failed step by category, as far as they can be known without a tracker."""
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        grads = sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
        buffers = sum(b.numel() * b.element_size() for b in module.buffers())
        opt_state = 0
        for optimizer in self._trainer.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        opt_state += value.numel() * value.element_size()
        lines = [
            f"Memory of the failed step (micro-batch size {self.micro_batch_size or 'whole batch'}):",
            f"  parameters       {format_bytes(params)}",
            f"  buffers          {format_bytes(buffers)}",
            f"  gradients        {format_bytes(grads)}",
            f"  optimizer state  {format_bytes(opt_state)}",
        ]
        memory = self._device_memory()
        if memory is not None:
            peak = memory.peak()
            rest = peak - params - buffers - grads - opt_state
            lines += [
                f"  activations and temporaries (peak minus the above)  {format_bytes(max(rest, 0))}",
                f"  device peak {format_bytes(peak)} of capacity {format_bytes(memory.capacity() or 0)}",
            ]
        return "\n".join(lines)

    def _log_engine_metrics(self, log: Callable[..., Any]) -> None:
        """Log ``batching/*`` when a value changed and every ``log_every_n_steps`` (when Lightning writes to
        the logger); ``self.log`` costs about as much as a small step's arithmetic, so not every step."""
        values = (
            ("batching/micro_batch_size", float(self.micro_batch_size or self._last_total or 0)),
            ("batching/num_micro_batches", float(self.num_micro_batches)),
            ("batching/oom_retries", float(self.oom_retries)),
        )
        trainer = self._trainer
        every = max(int(getattr(trainer, "log_every_n_steps", 1) or 1), 1)
        if values == self._logged and trainer.global_step % every != 0:
            return
        self._logged = values
        for name, value in values:
            log(name, value, on_step=True, on_epoch=False, batch_size=1)

    _logged: tuple = ()


# ---------------------------------------------------------------------- module-level helpers
class _LogRecorder:
    """Holds back ``self.log`` calls of the micro-batches; logs each name once, as the weighted mean."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.weight = 1.0
        self.original_log = module.log
        self._records: dict[str, list] = {}

    def __enter__(self) -> _LogRecorder:
        recorder = self

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            recorder._records.setdefault(name, []).append((value, recorder.weight, args, kwargs))

        self.module.log = log
        return self

    def __exit__(self, *exc: Any) -> None:
        vars(self.module).pop("log", None)

    def flush(self) -> None:
        for name, records in self._records.items():
            value, _, args, kwargs = records[-1]
            if len(records) == 1:  # one micro-batch: log exactly what the user logged
                self.original_log(name, value, *args, **kwargs)
                continue
            numeric = [
                r
                for r in records
                if isinstance(r[0], (torch.Tensor, int, float)) and not isinstance(r[0], bool)
            ]
            if len(numeric) == len(records):
                weight = sum(r[1] for r in records)
                # weight 0: a micro-batch that counts no items, whose means are NaN
                mean = sum(_as_tensor(r[0]).detach().float() * r[1] for r in records if r[1] > 0) / weight
                value = mean if isinstance(records[-1][0], torch.Tensor) else float(mean)
                if "batch_size" in kwargs:  # the user counted a micro-batch; the step counts them all
                    kwargs = {**kwargs, "batch_size": sum(r[3].get("batch_size", 0) for r in records)}
            self.original_log(name, value, *args, **kwargs)
        self._records.clear()


def _return(value: Any) -> Any:
    """A closure that was already run: the precision plugin calls it once and gets its loss."""
    return value


def _as_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(float(value))


def _loss_of(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise MisconfigurationException(
                f"training_step must return a scalar loss, got a tensor of shape {tuple(loss.shape)}; reduce it "
                "to one number, e.g. loss.mean() (a mean over samples) or loss.sum() / n, before returning it"
            )
        return loss
    raise MisconfigurationException(
        f"with micro-batching, training_step must return the loss tensor or a dict with a 'loss' tensor, got "
        f"{type(output).__name__}; returning None to skip a step cannot skip one micro-batch of it"
    )


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _combine(outputs: list[Any], sizes: list[int], weights: list[float]) -> Any:
    """One step output from the micro-batches': per-sample tensors joined, scalars averaged by share."""
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        if first.dim() > 0 and all(o.dim() > 0 and o.shape[0] == s for o, s in zip(outputs, sizes)):
            return torch.cat(outputs)
        if first.dim() == 0:
            return sum(o.float() * w for o, w in zip(outputs, weights))
        return outputs[-1]
    if isinstance(first, Mapping):
        return type(first)({k: _combine([o[k] for o in outputs], sizes, weights) for k in first})
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        return type(first)(_combine(list(items), sizes, weights) for items in zip(*outputs))
    return outputs[-1]


def _ddp_module(strategy: Any) -> Any:
    model = strategy.model
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


def _no_sync(strategy: Any) -> contextlib.AbstractContextManager:
    if isinstance(strategy, ParallelStrategy):
        return strategy.block_backward_sync()
    return contextlib.nullcontext()


def _buffer_broadcast(ddp: Any, on: bool) -> None:
    """Whether DDP's next forward broadcasts rank 0's buffers. The first micro-batch of a step does, as an
    unsplit DDP forward would; later ones do not (DDP itself stops after a ``no_sync`` forward, and a
    broadcast in a later micro-batch would be a collective that a rank which ran out of memory never
    reaches)."""
    if ddp is not None:
        ddp.require_forward_param_sync = on
