"""The micro-batch engine: one optimizer batch run as k micro-batches, with OOM retry on every rank.

The Lightning-facing wrappers, installed on the strategy at fit start (the Lightning names they rely on,
and why: :mod:`~lightning_memopt.batching.surface`), and the one retry loop that training, the optimizer
step and evaluation share, :meth:`MicroBatchEngine.run_with_retry`. One training step, top to bottom:

1. Capture the step's start state (RNGs, buffers, torchmetrics, GradScaler) if OOM retry is on.
2. Zero gradients; size the batch's micro-batches for its length (:mod:`~.per_batch`: from the memory
   model over shapes, agreed across ranks, or in padded tokens) and split it.
3. For each micro-batch: the user's ``training_step`` (through the strategy, so DDP/FSDP forward and
   autocast apply), its loss times its share of the items the loss averages over
   (:mod:`~lightning_memopt.batching.counting`), scaled by the GradScaler, ``.backward()``. Logged
   values are recorded, not logged yet.
4. The attempt's regime (:mod:`~lightning_memopt.batching.regime`, chosen once per attempt) says what
   runs around each micro-batch (``no_sync``, FSDP2 sync points), how the ranks agree whether any ran
   out of memory, and what follows success (averaging gradients under DDP). Its docstring is the one
   place where the small collectives per step are counted.
5. On an out-of-memory error (in 3, on any rank): drop the attempt, restore the start state, run the
   batch again at the size :class:`~.policy.SizePolicy` picks, or raise :class:`MicroBatchOOMError`.
6. Log each recorded value once, as the weighted mean over micro-batches (:mod:`~.outputs`), and return
   the full-batch loss as a fresh leaf tensor; the wrapped ``backward`` then only fires the hooks.
7. With OOM retry on, on CUDA (in one process, or with a memory model over shapes): feed the
   allocator's retries during the step to
   :class:`~.thrash.ThrashWatch`; when it says the allocator thrashes, halve the size for the next steps
   (:meth:`~.policy.SizePolicy.near_miss`) without retrying this one, which trained.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_memopt._compat import tree_flatten
from lightning_memopt.batching import regime as regimes
from lightning_memopt.batching.errors import CHECKLIST, MicroBatchOOMError
from lightning_memopt.batching.oom import is_out_of_memory
from lightning_memopt.batching.outputs import ChangedOrEvery, LogRecorder, StepOutputs, combine, loss_of
from lightning_memopt.batching.per_batch import size_batch
from lightning_memopt.batching.policy import SizePolicy, halve_eval
from lightning_memopt.batching.probe import measure_peak
from lightning_memopt.batching.regime import PeerOutOfMemory, Regime, choose_regime, drop_attempt
from lightning_memopt.batching.report import memory_of, memory_report, tensor_bytes
from lightning_memopt.batching.sizing import smallest_micro_batch
from lightning_memopt.batching.split import micro_batch_sizes
from lightning_memopt.batching.splitter import Splitter
from lightning_memopt.batching.state import OptimizerSnapshot, StepState
from lightning_memopt.batching.surface import (
    SkipNextZeroGrad,
    StrategyWrappers,
    check_accumulation,
    check_setup,
)
from lightning_memopt.batching.thrash import ThrashWatch
from lightning_memopt.memory.tracker import MemoryTracker, state_bytes

__all__ = ["MicroBatchEngine", "MicroBatchOOMError"]

_EVAL_HOOKS = ("validation_step", "test_step", "predict_step")
# One engine per Trainer. An engine refers to its Trainer only weakly (MicroBatchEngine._trainer): a value
# that held its own key would keep the Trainer, and its model, alive for the whole process.
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNKNOWN = object()  # not looked at yet (the model's loss convention; its FSDP2 modules)
T = TypeVar("T")


def _kept(part: str, name: str) -> property:
    """An engine attribute kept on one of its parts (``policy``, ``splitter``); the callbacks set it."""
    return property(
        lambda self: getattr(getattr(self, part), name), lambda self, v: setattr(getattr(self, part), name, v)
    )


class MicroBatchEngine(StrategyWrappers):
    """Runs each optimizer batch as micro-batches; shared by ``AutoAccumulation`` and ``OOMBackoff``.

    One engine per Trainer (:meth:`for_trainer`); each callback sets the options it owns and calls
    :meth:`install` / :meth:`uninstall`, which are counted, so two callbacks never wrap twice.

    Attributes:
        micro_batch_size: Samples per training micro-batch; None runs the whole batch at once. It and the
            other sizes and counters of :class:`SizePolicy` live on :attr:`policy`.
        eval_micro_batch_size: Samples per validation/test/predict micro-batch; None = whole batch.
        retry_on_oom: Catch out-of-memory errors, restore the step and retry with half the size.
        overlap_after: Under DDP/FSDP2 with OOM retry, after this many clean steps at one size, stop
            agreeing before the gradient sync (:mod:`~lightning_memopt.batching.regime`). None: never.
        count_fn, split_fn, length_fn: How batches are weighed, cut and measured (on :attr:`splitter`).
        log_metrics: Log ``batching/*`` keys from the training step.
        last_regime: The name of the last training attempt's regime (``Regime.name``; None before one).
        ran_size: Samples of the largest (the last, :func:`~.split.micro_batch_sizes`) micro-batch of the
            last training attempt that ran.
        shape_probes: ``(tokens per sample, samples, bytes above its start or None)`` of each probe that measured a new
            length for the policy's :class:`~.shapes.ShapeModel` (:func:`~.per_batch.size_batch`).
        thrash_watch: The rule that says when the CUDA allocator thrashes (:class:`~.thrash.ThrashWatch`);
            watched only with ``retry_on_oom``, on a CUDA device, in one process or with a memory model over
            shapes (whose per-step agreement on the count lets each rank lower its own sizes).
        near_misses: Training steps since the engine was created after which :attr:`thrash_watch` said the
            allocator thrashed (each halved the size, unless it was at the floor already). Not retries:
            ``oom_retries`` does not count them.
    """

    micro_batch_size = _kept("policy", "micro_batch_size")
    grow_after = _kept("policy", "grow_after")
    max_micro_batch_size = _kept("policy", "max_micro_batch_size")
    smallest_failed_size = _kept("policy", "smallest_failed_size")
    oom_retries = _kept("policy", "oom_retries")
    clean_steps = _kept("policy", "clean_steps")
    stable_steps = _kept("policy", "stable_steps")
    count_fn = _kept("splitter", "count_fn")
    split_fn = _kept("splitter", "split_fn")
    length_fn = _kept("splitter", "length_fn")

    def __init__(self) -> None:
        super().__init__()
        self.policy = SizePolicy()
        self.eval_micro_batch_size: int | None = None
        self.retry_on_oom = False
        self.overlap_after: int | None = None
        self.splitter = Splitter()
        self.log_metrics = False
        # what happened (read by the callbacks and tests)
        self.num_micro_batches = 1
        self.eval_oom_retries = 0
        self.last_failure: str | None = None
        self.last_regime: str | None = None
        self.shape_probes: list[tuple[int, int, int | None]] = []
        self.ran_size: int | None = None
        self.thrash_watch = ThrashWatch()
        self.near_misses = 0
        self._warned_thrashing = False
        self._sharding: Any = _UNKNOWN  # regime.find_sharding of the model, found once per fit
        self._zero_grad = SkipNextZeroGrad()
        self._pending_backward = False
        self._state: StepState | None = None
        self._metrics = ChangedOrEvery()
        self._held_at: tuple[int, int] | None = None  # optimizer state entries, and state_bytes then

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def for_trainer(cls, trainer: Any) -> MicroBatchEngine:
        """The engine of ``trainer``, created on first use (both callbacks share it)."""
        return _ENGINES.get(trainer) or _ENGINES.setdefault(trainer, cls())

    def check(self, trainer: Any, pl_module: Any) -> None:
        """Refuse set-ups the engine cannot run exactly (:func:`~.surface.check_setup`)."""
        check_setup(trainer, pl_module)

    @override
    def _wrappers(self) -> dict[str, Callable[..., Any]]:
        steps = {"training_step": self._training_step, "backward": self._backward}
        steps["optimizer_step"] = self._optimizer_step
        return steps | {name: functools.partial(self._eval_step, name) for name in _EVAL_HOOKS}

    @override
    def _uninstalled(self) -> None:
        self._zero_grad.remove()
        self._state = None
        self._sharding = _UNKNOWN  # the next fit may train another model
        self.splitter.forget_model()
        self._held_at = None

    # ------------------------------------------------------------------ the retry loop
    def run_with_retry(
        self,
        choose: Callable[[], Regime],
        attempt: Callable[[Regime], T],
        recover: Callable[[str | None], None],
    ) -> tuple[T, Regime, int]:
        """Run ``attempt`` until it succeeds on every rank; the one retry loop of the engine.

        Each round: ``choose()`` the attempt's regime (before anything can fail), run ``attempt(regime)``,
        catch an out-of-memory error (only with ``retry_on_oom``; every other error propagates) or another
        rank's, learned at a sync point; let the regime agree whether any rank failed; if so,
        ``recover(failure)`` (drop the attempt, pick a smaller size, or raise) and go again.

        Returns:
            The successful attempt's result, its regime, and how many attempts failed before it.
        """
        retries = 0
        while True:
            regime = choose()
            result: Any = None
            failure: str | None = None
            peer = False
            try:
                result = attempt(regime)
            except PeerOutOfMemory:
                peer = True  # learned at a sync point, which was this attempt's agreement
            except BaseException as error:
                if not (self.retry_on_oom and is_out_of_memory(error)):
                    raise
                failure = f"{type(error).__name__}: {error}"
            # Outside the except block: the traceback, and the attempt's tensors its frames hold, are gone.
            if failure is not None:
                self.last_failure = failure + "\n" + self._memory_report()
            if not regime.failed(self.last_failure if failure is not None else None, peer):
                return result, regime, retries
            result = None
            recover(failure)
            retries += 1

    def _sharded(self) -> regimes.Sharding | None:
        """The model's FSDP2 modules, found once per fit (on the first step: the strategy shards in setup)."""
        if self._sharding is _UNKNOWN:
            self._sharding = regimes.find_sharding(self._trainer.strategy.model)
        return self._sharding

    def _choose(self, phase: regimes.Phase, micro_batches: int = 1, size: int = 0) -> Regime:
        return choose_regime(
            phase,
            self._trainer.strategy,
            retry=self.retry_on_oom,
            sharding=self._sharded(),
            micro_batches=micro_batches,
            stable_steps=self.stable_steps,
            overlap_after=self.overlap_after,
            size=size,
        )

    # ------------------------------------------------------------------ training
    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer
        module = trainer.lightning_module
        check_accumulation(trainer)  # a GradientAccumulationScheduler may change it mid-fit
        batch, batch_idx = args[0], (args[1] if len(args) > 1 else kwargs.get("batch_idx", 0))
        total = self.batch_size(batch, module)
        own_state = self.retry_on_oom and self._state is None  # not inside our optimizer_step wrapper
        if own_state:
            self._state = self._capture(module)
        before = self._allocator_retries()
        sizes: list[int] = []
        pad = [0]

        def choose() -> Regime:
            self._zero_grad.zero_now(self._trainer, batch_idx)
            size, count = self._size_for(batch, total)
            sizes[:] = micro_batch_sizes(total, size, smallest=smallest_micro_batch(module), count=count)
            # FSDP2 communicates inside every micro-batch: a rank with fewer samples than the count the ranks
            # agreed on runs its last micro-batch again, weighted 0, until it has run as many
            pad[0] = count - len(sizes) if count and self._sharded() is not None else 0
            regime = self._choose("training", count or len(sizes), size)
            self.last_regime = regime.name
            return regime

        def attempt(regime: Regime) -> tuple[torch.Tensor, dict | None, LogRecorder]:
            return self._run_micro_batches(batch, args[1:], kwargs, sizes, regime, pad=pad[0])

        def recover(failure: str | None) -> None:
            self._recover(module, self.policy.size_for(total), total)

        (loss, extras, recorder), regime, retries = self.run_with_retry(choose, attempt, recover)
        regime.succeeded()
        if own_state:
            self._state = None
        # before growth may change them: the size, and what the watch keys its window on (the budget in
        # tokens; with a model, its predictions, which only misses and new lengths change)
        model = self.policy.model
        ran_at = self.policy.size_for(total), self.policy.tokens.budget if model is None else model.revision
        self.policy.succeeded(retried=retries > 0, total=total)
        if before is not None:
            self._watch_allocator(before, *ran_at, total=total, retried=retries > 0)
        recorder.flush()
        if self.log_metrics:
            size, k = self.micro_batch_size or total, self.num_micro_batches
            values = {"micro_batch_size": size, "num_micro_batches": k, "oom_retries": self.oom_retries}
            if before is not None:  # thrashing is watched
                values["near_misses"] = self.near_misses
            self._metrics.log(recorder.original_log, self._trainer, values)
        self._pending_backward = True
        loss = loss.requires_grad_(True)  # a fresh leaf: Lightning's backward call only fires the hooks
        return loss if extras is None else {**extras, "loss": loss}

    def _size_for(self, batch: Any, total: int) -> tuple[int, int | None]:
        """Samples per micro-batch for ``batch``, and the number of micro-batches every rank runs when
        sizes follow a :class:`~.shapes.ShapeModel` (:func:`~.per_batch.size_batch`; None otherwise)."""
        return size_batch(
            self.policy,
            width=self.splitter.length(batch),
            total=total,
            device=self._trainer.strategy.root_device,
            held=lambda: self.probe_base(batch),
            probe=lambda size: self._probe_increment(batch, size),
            record=self.shape_probes,
        )

    @classmethod
    def installed_for(cls, trainer: Any) -> MicroBatchEngine | None:
        """The engine splitting ``trainer``'s batches, or None (never creates one)."""
        engine = _ENGINES.get(trainer)
        return engine if engine is not None and engine.installed else None

    @classmethod
    def planned_size(cls, trainer: Any, batch: Any) -> int | None:
        """Samples of the largest micro-batch ``batch`` will run as on ``trainer``, from what is known now (no
        probe, no collective, nothing changed); None where no engine splits its batches. The step may then
        run smaller ones (a retry, the ranks' agreed count) or, after a probe of a new length, larger."""
        engine = cls.installed_for(trainer)
        if engine is None:
            return None
        policy, total = engine.policy, engine.batch_size(batch, trainer.lightning_module)
        if policy.model is not None:
            width = engine.splitter.length(batch)
            size = policy.model.samples_for(width, held=engine.probe_base(batch))
        elif policy.micro_batch_size is None:
            size = total
        elif regimes.is_distributed():  # sizes in samples there (per_batch.py)
            size = policy.micro_batch_size
        else:
            size = max(1, policy.tokens.budget // engine.splitter.length(batch))
        return max(
            micro_batch_sizes(
                total, min(size, total), smallest=smallest_micro_batch(trainer.lightning_module)
            )
        )

    def probe_base(self, batch: Any) -> int:
        """The bytes alive when a micro-step of ``batch`` starts, besides what it allocates: the allocator's
        count on CUDA; elsewhere what a probe's :class:`~lightning_memopt.memory.MemoryTracker` counts at its
        start: parameters, buffers, optimizer state, the gradients the backward will create, and what
        :meth:`probe` marks (the batch and the step's snapshot for a retry)."""
        memory = self._device_memory()
        if memory is not None:
            return memory.allocated()
        optimizers = self._trainer.optimizers
        entries = sum(len(o.state) for o in optimizers)  # counted again when the optimizer creates state
        if self._held_at is None or self._held_at[0] != entries:
            self._held_at = (entries, state_bytes(self._trainer.strategy.model, optimizers))
        return self._held_at[1] + tensor_bytes(self._held_tensors(batch))

    def _held_tensors(self, batch: Any) -> list[torch.Tensor]:
        """Tensors the device holds through a step besides the model's: the batch and the step's snapshot."""
        snapshot = self._state.tensors() if self._state is not None else []
        return [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)] + snapshot

    def _probe_increment(self, batch: Any, size: int) -> int | None:
        """Bytes one training micro-step of ``size`` samples of ``batch`` rises above its start (None: OOM)."""
        base = self.probe_base(batch)
        peak = self.probe(batch, size, tracker=self.probe_tracker())
        return None if peak is None else peak - base

    def probe_tracker(self) -> Any:
        """What measures a probe: the CUDA allocator (None), or a tracker of live tensors elsewhere."""
        strategy = self._trainer.strategy
        if strategy.root_device.type == "cuda":
            return None
        return MemoryTracker(strategy.model, self._trainer.optimizers)

    def _run_micro_batches(
        self, batch: Any, rest: tuple, kwargs: dict, sizes: list[int], regime: Regime, *, pad: int = 0
    ) -> tuple[torch.Tensor, dict | None, LogRecorder]:
        """Run the micro-batches of ``sizes``, then ``pad`` repeats of the last one weighted 0 (their
        gradients are zeros; their outputs and logged values are left out)."""
        strategy = self._trainer.strategy
        module = strategy.lightning_module
        parts, weights = self.splitter.cut(batch, sizes, module)
        real, self.ran_size = len(parts), max(sizes)
        parts, weights = parts + parts[-1:] * pad, weights + [0.0] * pad
        scaler = getattr(strategy.precision_plugin, "scaler", None)
        self.num_micro_batches = len(parts)
        outputs = StepOutputs(real)
        with LogRecorder(module) as recorder, regime.armed():
            for i, (part, weight) in enumerate(zip(parts, weights)):
                recorder.weight = weight
                with regime.around(i, last=i == len(parts) - 1):
                    out = self._originals["training_step"](part, *rest, **kwargs)
                    loss = loss_of(out)
                    scaled = loss * weight if len(parts) > 1 else loss  # k=1: no extra op in the graph
                    if scaler is not None:
                        scaled = scaler.scale(scaled)
                    # Every micro-batch runs its backward, so DDP/FSDP communicate as expected. One that counts
                    # no items (all labels -100) has a mean over nothing, NaN, as its loss and weighs 0: its
                    # gradients are zeros (cross-entropy's backward writes only at counted positions).
                    regime.wrap_loss(scaled).backward()
                if i < real:
                    outputs.add(out, loss, weight)
                del out, loss, scaled
        return outputs.loss, outputs.output(sizes, weights[:real]), recorder

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
        """The optimizer step with OOM retry: an OOM in it (clipping, ``on_before_optimizer_step``, the
        update) restores the step's start, runs the training step again at a smaller size and steps again.
        Distributed: the training step (and its agreement) runs first, so every rank reaches the step's own
        agreement (while sizes are unsettled, :mod:`~lightning_memopt.batching.regime`) from the same place.
        """
        original = self._originals["optimizer_step"]
        if not self.retry_on_oom:
            return original(optimizer, closure, model, **kwargs)
        module = self._trainer.lightning_module
        self._state = self._capture(module)
        step = [closure, None]  # the closure the step runs, the snapshot of this attempt

        def choose() -> Regime:
            regime = self._choose("optimizer_step")  # after the training step: it counts as stable
            step[1] = OptimizerSnapshot.capture([optimizer]) if regime.agrees else None
            return regime

        def recover(failure: str | None) -> None:
            if step[1] is not None:
                step[1].restore()  # every rank: undo the update the ranks that did not fail made
            total = self.policy.last_total or 1
            self._recover(module, self.policy.size_for(total), total)
            # Run the training step (and its hooks) at the smaller size now, before the optimizer's own
            # pre-step work, so that the retried step starts from the new micro-batches' state.
            step[0] = functools.partial(_return, closure())

        try:
            if regimes.is_distributed():
                # The micro-batches (and their agreement) first, so every rank reaches the step's agreement
                # from the same place, whether its optimizer's pre-step work or its update ran out of memory.
                step[0] = functools.partial(_return, closure())
            return self.run_with_retry(
                choose, lambda _: original(optimizer, step[0], model, **kwargs), recover
            )[0]
        finally:
            self._state = None

    # ------------------------------------------------------------------ recovery
    def _recover(self, module: Any, size: int, total: int) -> None:
        """Drop the failed attempt, restore the step's start, and pick a smaller micro-batch."""
        drop_attempt(self._trainer.strategy.model, self._sharded())
        if self._state is not None:
            self._state.restore()
        self._empty_cache()
        self.policy.back_off(size, total=total, floor=smallest_micro_batch(module), failure=self.last_failure)

    # ------------------------------------------------------------------ thrashing
    def _allocator_retries(self) -> int | None:
        """The CUDA allocator's cumulative retries, where thrashing is watched: with OOM retry on, on CUDA
        (other devices have no caching allocator), in one process or with a memory model over shapes
        (whose per-step agreement on the micro-batch count lets each rank lower its own sizes); None
        elsewhere."""
        if not self.retry_on_oom or (regimes.is_distributed() and self.policy.model is None):
            return None
        memory = self._device_memory()
        return None if memory is None else memory.alloc_retries()

    def _watch_allocator(
        self, before: int, size: int, budget: int | None, *, total: int, retried: bool
    ) -> None:
        """Feed the step's allocator retries to :attr:`thrash_watch`; on thrashing, halve the size for the
        next steps (``size``: samples this step ran at; ``budget``: the same in padded tokens)."""
        if retried:  # the out-of-memory error's own retries; the size was just halved: a new window
            model = self.policy.model
            self.thrash_watch.reset(self.policy.tokens.budget if model is None else model.revision)
            return
        if not self.thrash_watch.step(self._allocator_retries() - before, size=budget):
            return
        self.near_misses += 1
        floor = smallest_micro_batch(self._trainer.lightning_module)
        if self.policy.near_miss(size, total=total, floor=floor) or self._warned_thrashing:
            return
        self._warned_thrashing = True
        rank_zero_warn(
            f"The CUDA caching allocator keeps freeing its cache and retrying allocations (thrashing: every "
            f"such step synchronizes the device and reallocates, a large slowdown) at {size} samples per "
            f"micro-batch, the fewest this model can run. Training goes on, slowly. Against fragmentation, "
            f"set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts; to need less "
            f"memory:\n{CHECKLIST}"
        )

    def _empty_cache(self) -> None:
        if (memory := self._device_memory()) is not None:
            memory.empty_cache()

    def _capture(self, module: Any) -> StepState:
        scaler = getattr(self._trainer.strategy.precision_plugin, "scaler", None)
        return StepState.capture([module], scaler)

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        original = self._originals[hook]
        if self.eval_micro_batch_size is None and not self.retry_on_oom:
            return original(*args, **kwargs)
        batch = args[0]
        total = self.batch_size(batch, self._trainer.lightning_module)

        def attempt(regime: Regime) -> Any:
            with regime.armed():  # FSDP2: sync points before each sharded module's forward all-gather
                return self._run_eval(original, batch, args[1:], kwargs, total)

        def recover(failure: str | None) -> None:
            if self._sharded() is not None:
                self._sharded().reset()
            self._empty_cache()
            self.eval_oom_retries += 1
            size = min(self.eval_micro_batch_size or total, total)
            self.eval_micro_batch_size = halve_eval(size, hook=hook, failure=failure)

        return self.run_with_retry(lambda: self._choose("evaluation"), attempt, recover)[0]

    def _run_eval(self, original: Callable, batch: Any, rest: tuple, kwargs: dict, total: int) -> Any:
        module = self._trainer.lightning_module
        sizes = micro_batch_sizes(total, min(self.eval_micro_batch_size or total, total))
        if len(sizes) == 1:
            return original(batch, *rest, **kwargs)
        parts, weights = self.splitter.cut(batch, sizes, module)
        outputs = []
        with LogRecorder(module) as recorder:
            for part, weight in zip(parts, weights):
                recorder.weight = weight
                outputs.append(original(part, *rest, **kwargs))
        recorder.flush()
        return combine(outputs, sizes, weights)

    # ------------------------------------------------------------------ probing
    def probe(self, batch: Any, size: int, *, tracker: Any = None, evaluation: bool = False) -> int | None:
        """Peak bytes of one training (``evaluation``: validation) micro-step of ``size`` samples of ``batch``,
        None if it ran out of memory, leaving every state as it was (:func:`~.probe.measure_peak`).
        ``tracker``: a :class:`~lightning_memopt.memory.MemoryTracker` where there is no CUDA allocator."""
        module = self._trainer.lightning_module
        total = self.batch_size(batch, module)
        part = self.splitter.split(batch, [size, total - size], module)[0] if size < total else batch
        step = functools.partial(
            self._originals["validation_step" if evaluation else "training_step"], part, 0
        )
        memory, state = self._device_memory(tracker), self._capture(module)
        if tracker is not None:  # what the device holds meanwhile, which an allocator would count too
            for tensor in self._held_tensors(batch):
                tracker.mark(tensor, "other")
        return measure_peak(
            self._trainer.strategy, step, memory=memory, state=state, tracker=tracker, evaluation=evaluation
        )

    # ------------------------------------------------------------------ helpers
    def batch_size(self, batch: Any, module: Any) -> int:
        """Samples in ``batch``; ``len(batch)`` for batches only the user's ``split_fn`` can cut."""
        return self.splitter.batch_size(batch, module)

    def _device_memory(self, tracker: Any = None) -> Any:
        return memory_of(self._trainer.strategy.root_device, tracker)

    def _memory_report(self) -> str:
        module, optimizers = self._trainer.lightning_module, self._trainer.optimizers
        return memory_report(module, optimizers, self.micro_batch_size, self._device_memory())


def _return(value: Any) -> Any:
    """A closure that was already run: the precision plugin calls it once and gets its loss."""
    return value
