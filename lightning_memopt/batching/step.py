"""One optimizer batch run as micro-batches: the attempts that the engine's retry loop repeats.

:class:`TrainingStep` sizes and cuts the batch (``choose``), runs each micro-batch's ``training_step``
with its weighted loss and backward, then the one-time check of :mod:`~.exactness` (``run``), and after
an out-of-memory error on any rank drops the attempt and halves the size (``recover``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.memory import recursive_detach

from lightning_memopt._replay import replaying
from lightning_memopt.batching import exactness
from lightning_memopt.batching.distributed import any_rank, max_over_ranks_each
from lightning_memopt.batching.loss import batch_key
from lightning_memopt.batching.outputs import (
    LogRecorder,
    StepMetrics,
    combine,
    loss_of,
    reductions,
    warn_inexact,
)
from lightning_memopt.batching.regime import PeerOutOfMemory, Regime, drop_attempt, is_distributed
from lightning_memopt.batching.size_search import smallest_micro_batch
from lightning_memopt.batching.split import describe_split, micro_batch_sizes, split_batch
from lightning_memopt.batching.state import OptimizerSnapshot
from lightning_memopt.data.clock import step_clock
from lightning_memopt.memory.device import is_out_of_memory
from lightning_memopt.memory.phases import running

__all__ = ["Attempt", "EvalStep", "OptimizerStep", "TrainingStep"]


class Attempt(Protocol):
    """What :meth:`MicroBatchEngine.run_with_retry` repeats until it succeeds on every rank."""

    def choose(self) -> Regime: ...  # before anything can fail: sizes, the regime

    def run(self, regime: Regime) -> None: ...

    def settle(self, regime: Regime) -> None: ...  # once every rank's run succeeded: what needs them all

    def recover(self, failure: str | None) -> None: ...  # drop the attempt, pick a smaller size (or raise)

    @property
    def size(self) -> int | None: ...  # samples per micro-batch of the try (a failure's memory report)


@dataclass
class Pass:
    """What one pass over a batch's micro-batches left: the step's loss (None: ``training_step`` returned
    None for an unsplit batch), each micro-batch's output (detached) and loss, how each output's values
    were reduced over its samples (:func:`~.outputs.reductions`), the held-back logs."""

    loss: torch.Tensor | None
    outputs: list[Any] = field(default_factory=list)
    how: list[dict[str, tuple[str, float]]] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    recorder: LogRecorder | None = None
    relearned: bool = False
    seconds: float | None = None
    """Where the pass was timed (a trial step: :attr:`~.sizes.MicroBatchSizes.timing`), the step's forward
    and backward seconds: its micro-steps' together."""


class TrainingStep:
    """One training batch as micro-batches, attempt after attempt until one succeeds on every rank
    (``rest`` and ``kwargs``: ``training_step``'s other arguments)."""

    def __init__(self, engine: Any, batch: Any, rest: tuple, kwargs: dict) -> None:
        self.engine, self.batch, self.rest, self.kwargs = engine, batch, rest, kwargs
        self.module = engine.trainer.lightning_module
        self.total = engine.batch_size(batch)
        self.width = engine.length(batch)
        self.floor = smallest_micro_batch(self.module)
        self.key = batch_key(batch)
        self.checking: bool | None = False  # None: wanted, but the ranks cannot agree on it before the step
        self.size = self.total  # samples per micro-batch of this attempt
        self.sizes: list[int] = [self.total]
        self.pad = 0  # FSDP2: repeats of the last micro-batch, weighted 0, to run the count the ranks agreed
        self.result = Pass(None)
        self._combined: tuple[Pass, Any] | None = None  # (the pass, its output), combined once
        self._to_check: tuple[Any, list[str]] | None = None  # the check's start state and writes (settle)

    @property
    def loss(self) -> torch.Tensor | None:
        return self.result.loss

    @property
    def seconds(self) -> float | None:
        """The step's measured seconds, where it was a trial step (:attr:`Pass.seconds`)."""
        return self.result.seconds

    @property
    def output(self) -> Any:
        """The step's output besides the loss (None: the loss alone); the keys that cannot be combined
        exactly from the micro-batches' are named in a warning, once."""
        outs = self.result.outputs
        if not outs or not isinstance(outs[0], dict):
            return None if self.loss is not None or not outs else outs[0]
        extras = [{k: v for k, v in o.items() if k != "loss"} for o in outs]
        if len(extras) == 1:
            return extras[0]
        if self._combined is None or self._combined[0] is not self.result:
            inexact: list[str] = []
            self._combined = self.result, combine(extras, self.sizes, how=self.result.how, inexact=inexact)
            warn_inexact(inexact, self.engine.warned)
        return self._combined[1]

    # ------------------------------------------------------------------ the attempt
    def choose(self) -> Regime:
        engine = self.engine
        engine.zero_grad()
        # The one-time check runs on every rank or on none: decided with the sizes' agreement, where the
        # ranks have one before the step (else None: what one rank can see is said without a comparison).
        # Not in the trial's planning turn (the batch recomputed, in micro-batches twice as large): the step
        # after it checks the next way's.
        self.size, count, self.checking = engine.sizes.plan(
            total=self.total,
            width=self.width,
            probes=engine.probes(self.batch),
            flag=lambda size: engine.check_due(self.key) and size < self.total and not engine.sizes.planning,
        )
        self.sizes = micro_batch_sizes(self.total, self.size, smallest=self.floor, count=count)
        self.pad = count - len(self.sizes) if count and engine.sharded() is not None else 0
        regime = engine.choose("training", count or len(self.sizes), self.size)
        engine.last_regime = regime.name
        return regime

    def run(self, regime: Regime) -> None:
        engine, key = self.engine, self.key
        checking = bool(self.checking) and (len(self.sizes) > 1 or is_distributed())
        looking = checking or (self.checking is None and len(self.sizes) > 1 and engine.check_due(key))
        start = engine.capture(self.module) if checking else None
        # In one process a pass whose weights a later micro-batch proves wrong runs again (redo); ranks
        # could disagree on that, so there it is said instead.
        redo = not checking and not is_distributed()
        with exactness.written_in_place(self.module) if looking else contextlib.nullcontext([]) as written:
            self.result = self.run_pass(regime, self.sizes, self.pad, redo=redo)
        engine.written.update(written)
        if self.result.relearned and not checking:
            engine.report_inexact(
                "the count its loss divides by did not follow the rule learned from earlier micro-batches; pass "
                "count_fn=... (the number of items the loss averages over in a micro-batch, or 'sum')",
                local=True,
            )
        # The one-time check runs once every rank's pass succeeded (settle): a rank out of memory in its pass
        # agrees on the failure first, where it used to meet the others in the check's collectives.
        self._to_check = (start, written) if checking else None
        if looking and not checking:  # distributed, no agreement to check on: what one rank can see, said
            engine.checked_keys.add(key)
            batchnorm = exactness.batchnorms(self.module)
            if written or batchnorm:
                engine.report_inexact(
                    exactness.causes(batchnorm=batchnorm, written=written, unexplained=False), local=True
                )

    def settle(self, regime: Regime) -> None:
        """The one-time exactness check, where this step runs it (:meth:`_check`)."""
        if self._to_check is not None:
            (start, written), self._to_check = self._to_check, None
            self.engine.checked_keys.add(self.key)
            self._check(regime, start, written)

    def recover(self, failure: str | None) -> None:
        engine = self.engine
        drop_attempt(engine.trainer.strategy.model, engine.sharded())
        engine.restore()
        engine.sizes.failed(self.size, total=self.total, floor=self.floor, failure=engine.last_failure)

    # ------------------------------------------------------------------ one pass over the micro-batches
    def run_pass(
        self,
        regime: Regime,
        sizes: list[int],
        pad: int,
        *,
        check: bool = False,
        subtract: bool = False,
        redo: bool = False,
        batch: Any = None,
    ) -> Pass:
        """Run ``sizes`` as micro-batches, then ``pad`` repeats of the last, weighted 0 (their gradients are
        zeros; their outputs and logs are left out). ``check``: a pass of the one-time check, which the
        engine's counters do not see; ``subtract``: its gradients are taken from those the parameters hold
        (each micro-batch's loss negated), so that they end as the difference of two splits. ``redo``: where
        the weights are learned while the pass runs and a later micro-batch shows that an earlier one was
        weighed by a wrong rule, run it again from its start with the rules every micro-batch confirmed.
        ``batch``: what ``sizes`` split, the step's batch by default (the check may run its leading samples
        only)."""
        engine, module = self.engine, self.module
        batch = self.batch if batch is None else batch
        parts = split_batch(batch, sizes, split_fn=engine.split_fn(module))
        weights = engine.weights.step(batch, parts, sizes)
        start = engine.capture(module) if redo and weights.weights is None else None
        parts = parts + parts[-1:] * pad
        scaler = getattr(engine.trainer.strategy.precision_plugin, "scaler", None)
        if not check:
            engine.num_micro_batches, engine.ran_size = len(parts), max(sizes)
        result = Pass(None, recorder=LogRecorder(module))
        cut = len(sizes) > 1 and engine.split_fn(module) is None  # by the built-in splitter
        noted = _SplitNote(batch, sizes) if cut else contextlib.nullcontext()
        metrics = StepMetrics(module).step() if len(parts) > 1 else contextlib.nullcontext()
        # A trial step's micro-steps are timed, forward and backward, on the device's clock (nothing else is)
        clock = step_clock(engine.trainer.strategy.root_device) if engine.sizes.timing and not check else None
        spans: list[tuple[Any, Any]] = []
        with result.recorder, regime.armed(), metrics:
            for i, part in enumerate(parts):
                result.recorder.share = sizes[i] / sum(sizes) if i < len(sizes) else 0.0
                began = clock.mark() if clock is not None else None
                with regime.around(i, last=i == len(parts) - 1), weights.observing() as observer:
                    with noted:
                        out = engine.original("training_step")(part, *self.rest, **self.kwargs)
                    loss = loss_of(out)
                    if loss is None:
                        if len(parts) > 1:
                            raise MisconfigurationException(_NONE)
                        return Pass(None, [out], recorder=result.recorder)
                    # Read before backward frees the graph: how each output value reduced its samples.
                    how = reductions(out, sizes[i]) if isinstance(out, dict) else {}
                    weighted = weights.weighted(i, loss, observer)
                    if scaler is not None:
                        weighted = scaler.scale(weighted)
                    if subtract:
                        weighted = -weighted
                    # Lightning's hooks see this as forward (it runs inside training_step): MemoryMonitor
                    # files it under backward, where it runs.
                    with running("backward"), noted:
                        regime.wrap_loss(weighted).backward()
                if i < len(sizes):
                    if clock is not None:
                        spans.append((began, clock.mark()))
                    # Detached, as Lightning keeps a step's output: a value's graph would hold its
                    # micro-batch's activations (logits.max() saves the logits) until the step ends.
                    result.outputs.append(recursive_detach(out))
                    result.how.append(how)
                    result.losses.append(loss.detach())
                del out, loss, weighted
        result.loss, result.relearned = weights.loss, weights.relearned
        if clock is not None and spans:
            # Every micro-step counts: the first (gradients allocated again after zero_grad) and the last
            # (DDP's gradient all-reduce) are paid every step, however many micro-steps it runs
            clock.settle(spans[-1][1])
            result.seconds = sum(clock.seconds(a, b) for a, b in spans)
        if start is not None and result.relearned:
            start.restore()
            drop_attempt(engine.trainer.strategy.model, None)
            return self.run_pass(regime, sizes, pad, check=check, subtract=subtract, batch=batch)
        return result

    # ------------------------------------------------------------------ the one-time check
    def _check(self, regime: Regime, start: Any, written: list[str]) -> None:
        """Run the batch's leading micro-batches (:func:`checked_micro_batches`) again as another split,
        compare the gradients, and say why they differ.

        The step's own results (gradients, buffers, RNGs, logs) are put back after; nothing of the
        comparison stays. A step that wrote parameters or buffers in place is not run again (the writes
        would repeat): they are the cause.
        """
        engine, module = self.engine, self.module
        device = engine.trainer.strategy.root_device
        batchnorm = exactness.batchnorms(module)
        # Every rank takes the same path (the same passes, hence the same collectives): the flags are agreed.
        skip, random, again, single = max_over_ranks_each(
            [
                bool(written or batchnorm),
                not engine.capture(module).same_rng(start),
                self.result.relearned,
                self.sizes[0] < 2,  # a micro-batch of one sample: no other split of the same size
            ],
            device,
        )
        if again and not skip:
            # A rule chosen on the first micro-batch failed on a later one: the step again, with the rules
            # all its micro-batches confirmed.
            start.restore()
            drop_attempt(engine.trainer.strategy.model, None)
            self.result = self.run_pass(regime, self.sizes, self.pad)
        after = engine.capture(module)
        if skip:  # not run again when the cause is known: writes in place would repeat, BatchNorm differs
            engine.report_inexact(exactness.causes(batchnorm=batchnorm, written=written, unexplained=False))
            return
        if single:
            return
        optimizers = engine.trainer.optimizers
        # The size search's figure where it was measured with no optimizer state, as the room needs (the
        # probes' cache, BatchProbes._states, is keyed so too: by the state entries it was measured at)
        held_at = engine.held_at
        to_come = held_at[2] if held_at is not None and held_at[0] == 0 else None
        room = exactness.room_for_gradients(module, optimizers, device, to_come)
        kept = exactness.gradients(module, on_device=room)  # the step's own, put back after
        # Another split of the same samples: every boundary moved by half a micro-batch, so that a weight
        # that does not follow what the loss divides by, or a loss that couples neighbouring samples,
        # shows in the gradient (twice as many halves can miss a coupling inside each pair). Of the whole
        # batch under DDP/FSDP2 (every rank the same passes); else of its leading micro-batches, run as
        # the step ran them too unless they are the whole batch and no random number was drawn (then the
        # step's own gradients are the reference). The moved split runs last with its loss negated, on top
        # of the reference's gradients: they end as the difference, and nothing but the step's own
        # gradients is copied (a copy of a 1.3B model's gradients to the host took 3 s on an H200; on the
        # device where the optimizer state to come leaves room).
        count = len(self.sizes) if is_distributed() else checked_micro_batches(self.sizes)
        checked = self.sizes[:count]  # FSDP2's padding repeats (weighted 0) follow, as in the step
        part = self.batch
        if count < len(self.sizes):
            part = split_batch(
                self.batch, [sum(checked), self.total - sum(checked)], split_fn=engine.split_fn(module)
            )[0]
        half = checked[0] // 2
        moved = [half, *checked[:-1], checked[-1] - half]
        runs = [checked] if random or count < len(self.sizes) else []  # without dropout
        runs.append(moved)
        drawn = False
        reference = None if runs[0] is checked else exactness.norms(module)
        for sizes in runs:
            start.restore()
            if reference is None:  # the reference's gradients start from none
                drop_attempt(engine.trainer.strategy.model, None)
            # replaying(): what learns from forwards (AutoCheckpoint) skips these
            with exactness.no_dropout(), replaying():
                self.run_pass(regime, sizes, self.pad, check=True, subtract=reference is not None, batch=part)
            drawn = drawn or start.drawn_since()  # random numbers drawn beside dropout's
            if reference is None:
                reference = exactness.norms(module)
        mixed = "mixed" in type(engine.trainer.strategy.precision_plugin).__name__.lower()
        loss_dtype = self.result.losses[0].dtype if self.result.losses else None
        bar, floor = exactness.tolerance(module, mixed, loss_dtype)
        gap = exactness.difference(reference, exactness.norms(module), floor)
        inexact = any_rank(gap > bar, device)
        after.restore()
        engine.put_gradients(kept)
        if inexact:
            cause = exactness.causes(
                batchnorm=[], written=[], unexplained=engine.weights.unexplained(self.batch), drawn=drawn
            )
            engine.report_inexact(f"{cause} (relative difference {gap:.2g} between two splits of one batch)")


CHECKED_SAMPLES = 8
"""The one-time check runs again at least this many samples of the batch (or all of it): the fewest leading
micro-batches that hold them (:func:`checked_micro_batches`). Two samples routed to one expert hide a
load-balancing term that eight show."""


def checked_micro_batches(sizes: list[int]) -> int:
    """How many of a step's leading micro-batches (of ``sizes`` samples) the one-time check runs again: the
    fewest that hold :data:`CHECKED_SAMPLES` samples, or all of them.

    Example::

        >>> checked_micro_batches([12, 12, 12, 12]), checked_micro_batches([3, 3, 3, 3])
        (1, 3)
    """
    held = itertools.accumulate(sizes)
    return next((count for count, n in enumerate(held, 1) if n >= CHECKED_SAMPLES), len(sizes))


_NONE = (
    "training_step returned None (skip this batch) for a micro-batch of a batch that runs as several: one "
    "micro-batch cannot skip the step, and the others have run their backward already. Leave such samples "
    "out of the DataLoader's batches, or return a loss for every micro-batch"
)


class _SplitNote:
    """Adds :func:`~.split.describe_split`'s line to an error the user's step raises on a micro-batch of a
    batch the built-in splitter cut (not to an out-of-memory error, this rank's or another's: those are
    retried or reported)."""

    def __init__(self, batch: Any, sizes: list[int]) -> None:
        self.batch, self.sizes = batch, sizes

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if (
            isinstance(error, Exception)
            and not isinstance(error, PeerOutOfMemory)
            and not is_out_of_memory(error)
        ):
            note = describe_split(self.batch, self.sizes)
            if note not in getattr(error, "__notes__", ()):
                error.add_note(note)
        return False  # the error goes on as it is, with one line more


class OptimizerStep:
    """The optimizer step as an :class:`Attempt`; on an out-of-memory error every rank undoes the update
    its first step at a size may have made, and the training step runs again smaller."""

    def __init__(
        self,
        engine: Any,
        original: Callable,
        optimizer: Any,
        closure: Callable,
        model: Any,
        kwargs: dict,
    ) -> None:
        self.engine, self.original, self.optimizer = engine, original, optimizer
        self.model, self.kwargs = model, kwargs
        self.train = closure  # the training step and its backward, as Lightning's closure runs them
        self.closure = closure  # what the optimizer step calls: the training step, or its result
        self.snapshot: OptimizerSnapshot | None = None
        self.result: Any = None

    def run_all(self) -> Any:
        if is_distributed():
            # The micro-batches (and their agreement) first, so every rank reaches the step's agreement
            # from the same place, whether its optimizer's pre-step work or its update ran out of memory.
            self.closure = functools.partial(_return, self.train())
        self.engine.run_with_retry(self)
        return self.result

    def choose(self) -> Regime:
        regime = self.engine.choose("optimizer_step")  # after the training step: it counts as stable
        self.snapshot = OptimizerSnapshot.capture([self.optimizer]) if regime.agrees else None
        return regime

    def run(self, regime: Regime) -> None:
        self.result = self.original(self.optimizer, self.closure, self.model, **self.kwargs)

    @property
    def size(self) -> int | None:
        return self.engine.ran_size  # the training step's, which the optimizer step runs after

    def settle(self, regime: Regime) -> None:
        pass

    def recover(self, failure: str | None) -> None:
        engine = self.engine
        if self.snapshot is not None:
            self.snapshot.restore()  # every rank: undo the update the ranks that did not fail made
        drop_attempt(engine.trainer.strategy.model, engine.sharded())
        engine.restore()
        total = engine.sizes.last_total or 1
        floor = smallest_micro_batch(engine.trainer.lightning_module)
        engine.sizes.failed(engine.sizes.size(total), total=total, floor=floor, failure=engine.last_failure)
        # Run the training step (and its hooks) at the smaller size now, before the optimizer's own
        # pre-step work, so that the retried step starts from the new micro-batches' state.
        self.closure = functools.partial(_return, self.train())


class EvalStep:
    """A validation/test/predict step as an :class:`Attempt`: micro-batches of the evaluation size, each
    halved on an out-of-memory error."""

    def __init__(self, engine: Any, hook: str, original: Callable, args: tuple, kwargs: dict) -> None:
        self.engine, self.hook, self.original, self.args, self.kwargs = engine, hook, original, args, kwargs
        self.total = engine.batch_size(args[0])
        self.result: Any = None

    def choose(self) -> Regime:
        return self.engine.choose("evaluation")

    @property
    def size(self) -> int:
        return min(self.engine.sizes.eval_size or self.total, self.total)

    def run(self, regime: Regime) -> None:
        engine, batch = self.engine, self.args[0]
        sizes = micro_batch_sizes(self.total, self.size)
        with regime.armed():  # FSDP2: sync points before each sharded module's forward all-gather
            if len(sizes) == 1:
                self.result = self.original(*self.args, **self.kwargs)
                return
            module = engine.trainer.lightning_module
            parts = split_batch(batch, sizes, split_fn=engine.split_fn(module))
            outputs = []
            with LogRecorder(module) as recorder:
                for part, n in zip(parts, sizes):
                    recorder.share = n / self.total
                    outputs.append(self.original(part, *self.args[1:], **self.kwargs))
            recorder.flush()
            self.result = None if outputs[0] is None else combine(outputs, sizes)

    def settle(self, regime: Regime) -> None:
        pass

    def recover(self, failure: str | None) -> None:
        engine = self.engine
        if engine.sharded() is not None:
            engine.sharded().reset()
        engine.restore()
        engine.sizes.halve_eval(self.size, hook=self.hook, failure=failure)


def _return(value: Any) -> Any:
    """A closure that was already run: the precision plugin calls it once and gets its loss."""
    return value
