"""Checkpointing planned from a measured step, for any ``nn.Module`` (plain torch; no Lightning import).

:class:`AutoCheckpointer` is the one implementation of what ``AutoCheckpoint`` does: find the blocks,
run them all ``full`` (the least memory) until a step has been measured, profile the blocks on the
inputs that step recorded, plan under the step's memory limit, apply the plan, re-plan for larger batch
shapes, and take everything off again. The Lightning callback calls it from its hooks;
:func:`auto_checkpoint` calls it once, on an example batch, for a plain training loop (or Fabric)::

    handle = auto_checkpoint(model, batch, max_memory="6GiB")
    for batch in loader:  # the training loop, unchanged
        ...
    handle.remove()  # the model as it was

One step is measured like this: :meth:`AutoCheckpointer.start_step` opens a
:class:`~lightning_memopt.checkpointing.meter.ForwardProbe` (activation bytes, block inputs),
:meth:`~AutoCheckpointer.forward_done` closes it before backward, :meth:`~AutoCheckpointer.finish_step`
profiles and plans (the first time) or compares the plan with what was measured (the next time).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memopt._checks import check_bool
from lightning_memopt._text import first_line
from lightning_memopt.batching.split import tensors_of
from lightning_memopt.batching.state import StepState
from lightning_memopt.checkpointing.apply import (
    apply_checkpointing,
    framework_checkpointing,
    remove_checkpointing,
)
from lightning_memopt.checkpointing.blocks import check_blocks, find_blocks
from lightning_memopt.checkpointing.meter import ForwardProbe
from lightning_memopt.checkpointing.offload import release_offloaders
from lightning_memopt.checkpointing.planner import (
    CostModel,
    Plan,
    check_mode,
    evaluate_plan,
    initial_choices,
    prediction_gap,
)
from lightning_memopt.checkpointing.policy import PlanPolicy
from lightning_memopt.checkpointing.profile import profile_blocks, profile_blocks_run
from lightning_memopt.checkpointing.ranks import Measured, agree
from lightning_memopt.checkpointing.shape_plans import ShapePlans, Signature, full_peak, shape_signature
from lightning_memopt.head.causal_lm import HeadMode, TakenHeads, check_head, take_over_heads
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.memory.device import device_memory, is_out_of_memory
from lightning_memopt.memory.limit import MemoryLimit, StepLimit, check_headroom, check_max_memory
from lightning_memopt.memory.tracker import state_bytes

__all__ = ["AutoCheckpointer", "NoBlockError", "StepOutcome", "auto_checkpoint"]

Gather = Callable[[Any], list[Any]]
"""What every process measured, in rank order (``lambda value: [value]`` in one process)."""
Most = Callable[[list[int]], list[int]]
"""Each value's largest over processes (the identity in one process)."""


def _alone(value: Any) -> list[Any]:
    return [value]


def _same(values: list[int]) -> list[int]:
    return list(values)


class NoBlockError(ValueError):
    """A forced ``mode`` that no block of the model can take (every block keeps its activations)."""


@dataclass
class StepOutcome:
    """What :meth:`AutoCheckpointer.finish_step` did with the step it measured."""

    planned: Plan | None = None
    """The plan made from this step's profiles (its table is worth showing); None if none was made."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Where the step ran a profiled plan: its predicted and measured figures (:meth:`Plan.metrics`)."""
    gap: str | None = None
    """Where the measured bytes are more than 10% from the prediction: why (:func:`prediction_gap`)."""
    notes: list[str] = field(default_factory=list)
    """Blocks left out or kept whole while profiling, and why (:func:`profile_blocks_run`), once each."""


class AutoCheckpointer:
    """Activation checkpointing of a model's blocks, planned from a measured step under a memory limit.

    The options are ``AutoCheckpoint``'s (its page documents each); ``name`` is how messages call the
    caller (``"AutoCheckpoint"``, ``"auto_checkpoint"``). Use :func:`auto_checkpoint` in a plain training
    loop; this class is the step-by-step form a training framework drives from its hooks.

    Raises:
        ValueError: For an option of the wrong kind or value (the message names it and the fix).

    Example::

        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(3)])
        >>> checkpointer = AutoCheckpointer(mode="selective")
        >>> checkpointer.prepare("cpu")
        >>> checkpointer.install(model)  # None: installed (else the reason it was not, to warn with)
        >>> checkpointer.start_step(((4, 8),))  # the batch's shapes
        >>> loss = model(torch.randn(4, 8)).sum()
        >>> checkpointer.forward_done()
        >>> loss.backward()
        >>> outcome = checkpointer.finish_step()  # profiled and planned: the first measured step
        >>> outcome.planned.choices, outcome.planned.activation_bytes < outcome.planned.baseline_bytes
        ({'0': 'selective', '1': 'selective', '2': 'selective'}, True)
        >>> checkpointer.remove()
    """

    def __init__(
        self,
        *,
        blocks: list[type[nn.Module] | str] | str | None = None,
        max_memory: MemoryLimit = None,
        mode: str = "auto",
        every_n: int = 2,
        headroom: float = 0.1,
        cost_model: CostModel | None = None,
        allow_offload: bool | None = None,
        head: HeadMode = "auto",
        name: str = "AutoCheckpoint",
    ) -> None:
        check_max_memory(max_memory)
        check_mode(mode, every_n, cost_model)
        if max_memory is not None and mode != "auto":
            raise ValueError(f"max_memory={max_memory!r} is only used by mode='auto', got mode={mode!r}")
        check_bool("allow_offload", allow_offload, none_ok=True)
        check_blocks(blocks)
        self.blocks = blocks
        self.max_memory = max_memory
        self.mode = mode
        self.every_n = every_n
        self.headroom = check_headroom(headroom)
        self.cost_model = cost_model
        self.allow_offload = allow_offload
        self.name = name
        self.head = check_head(head)
        self._heads = TakenHeads([])  # the chunked output heads installed
        self._own_head = False  # the size search chose the model's own head: none is installed again
        self.plan: Plan | None = None
        """The plan the blocks run; None before :meth:`install` (or where no blocks were found)."""
        self.shape_plans = ShapePlans()  # under a limit: the plans made, by the shapes they were made for
        self._loaded_plan: Plan | None = None  # from a checkpoint: applied at install, never profiled
        self._found: list[tuple[str, nn.Module]] = []
        self._model: nn.Module | None = None
        self._policy: PlanPolicy | None = None  # mode, limit, treatments: resolved in prepare
        self._needs_check = False  # the next step measures the plan and compares
        self._signature: Signature = ()  # the shapes of the step running
        self._batch: list[torch.Tensor] = []  # its batch's tensors, until its forward ends
        self._by_shape = False  # whether plans are made per batch shape: auto under a known limit
        self._probe: ForwardProbe | None = None  # measures a step's forward (and records block inputs)
        self._kept_peak: Callable[[int], float] | None = None  # the size search's kept peaks (decided)
        self._trial_plan: Plan | None = None  # the plan the size search's trial runs (try_plan)
        self._trying = False  # the step running is profiled for the trial's plan

    def prepare(self, device: torch.device | str) -> None:
        """Resolve the limit (a fraction of ``device``'s capacity where given so) and the treatments.

        Raises:
            ValueError: For a fraction of an unknown capacity.
        """
        device = torch.device(device)
        capacity = device_memory(device, tracker=MemoryTracker()).capacity()
        offload = self.allow_offload if self.allow_offload is not None else device.type != "cpu"
        limit = StepLimit.resolve(self.max_memory, self.headroom, capacity)
        self._policy = PlanPolicy.for_mode(
            self.mode, limit, offload=offload, cost_model=self.cost_model, device=device
        )
        self._by_shape = self.mode == "auto" and limit.usable is not None

    @property
    def active(self) -> bool:
        """Whether blocks were found and are checkpointed."""
        return bool(self._found) and self.plan is not None

    @property
    def measuring(self) -> bool:
        """Whether the step running is measured (:meth:`finish_step` has work to do)."""
        return self._probe is not None

    @property
    def found(self) -> list[tuple[str, nn.Module]]:
        """The ``(name, module)`` blocks found at :meth:`install`."""
        return list(self._found)

    def install(self, model: nn.Module) -> str | None:
        """Find the blocks of ``model`` and run them ``full`` (or the mode's treatment, or a loaded plan).

        Returns:
            Why nothing was installed (the model checkpoints itself, no blocks were found), for the
            caller to warn with; None once installed.

        Raises:
            ValueError: For ``blocks`` that match nothing, with the candidate classes found.
        """
        # A causal LM's output head computes its loss chunk by chunk (lightning_memopt.head), where it can.
        self._heads = take_over_heads(model, "keep" if self._own_head else self.head, note=self.note)
        own = framework_checkpointing(model)
        if own is not None:
            return (
                f"{self.name}: {own} already checkpoints activations and {self.name} does nothing, so that "
                "blocks are not checkpointed twice. Remove one of the two."
            )
        blocks = find_blocks(model, self.blocks)
        if not blocks:
            return (
                f"{self.name} found no repeated blocks in {type(model).__name__} and changes nothing; "
                "pass blocks=[YourBlockClass] or module-name patterns like blocks=['layers.*']"
            )
        self._found, self._model = blocks, model
        loaded, names = self._loaded_plan, [n for n, _ in blocks]
        choices = dict(loaded.choices) if loaded else initial_choices(names, self.mode, self.every_n)
        apply_checkpointing(model, choices)
        self.plan, self._needs_check = loaded or Plan.unprofiled(choices), loaded is None
        return None

    def start_step(
        self, signature: Signature, most: Most = _same, batch: Any = None, sized: bool = False
    ) -> None:
        """Before a step on a batch of ``signature`` (:func:`~lightning_memopt.checkpointing.shape_plans.step_signature`):
        under a limit, switch to the plan made for its shapes (a batch larger than all planned runs every
        block ``full`` and is profiled); open the probe where the step is to be measured. ``batch``: the
        step's batch, which a measured step counts beside what it holds (until :meth:`forward_done`);
        ``sized``: a micro-batching engine sizes its micro-batches (:meth:`ShapePlans.next_plan`)."""
        if not self.active:
            return
        self._signature, self._batch = signature, [t for _, t in tensors_of(batch, strict=False)]
        if self._by_shape and self.plan.predicted:  # a plan covering every rank's batch, or profile them
            plan = self.shape_plans.next_plan(signature, self.plan, most, sized)
            self._needs_check = self._needs_check or not plan.predicted
            if plan is not self.plan:
                self.plan = plan
                apply_checkpointing(self._model, plan.choices)
        if self._needs_check and self._probe is None:
            self._probe = ForwardProbe(self._model, self._found, record=not self.plan.predicted)

    @property
    def own_head(self) -> bool:
        """Whether the size search may also try the model's own output head (``head="auto"`` installed a
        chunked one): the chunked head pays only where it lets larger micro-batches run faster."""
        return self.head == "auto" and self._heads.installed

    def use(self, way: str) -> None:
        """Run every block ``"keep"`` or ``"full"`` (``"own head"``: kept, and the model's own output head
        computes the loss) while the micro-batch size is searched, the search's ways
        (:class:`~lightning_memopt.batching.sizes.Recompute`); nothing is measured meanwhile (a tracking
        dispatch mode would distort the probes' timings)."""
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        self._heads.use_own(way == "own head")
        choices = initial_choices([n for n, _ in self._found], "keep" if way == "own head" else way)
        apply_checkpointing(self._model, choices)
        self.plan = Plan.unprofiled(choices)

    def try_plan(self, kept_peak: Callable[[int], float] | None = None) -> None:
        """Run the least recompute that fits the micro-batch about to run, for the size search's trial
        (:class:`~lightning_memopt.batching.sizes.Recompute`): the first time, every block recomputes and
        the step is measured, and the plan is made when it ends (:meth:`finish_step`), for the micro-batch
        that ran; every later time that plan runs, unmeasured (its step is timed). ``kept_peak``: as for
        :meth:`decided`."""
        if self._trial_plan is None:
            self._kept_peak = kept_peak
            self.use("full")
            self._trying = True
            self._probe = ForwardProbe(self._model, self._found, record=True)
            return
        self.use("full")  # the chunked head, and no probe open
        self.plan = self._trial_plan
        apply_checkpointing(self._model, self.plan)

    def decided(self, way: str, why: str, kept_peak: Callable[[int], float] | None = None) -> None:
        """The size search chose ``way``: ``keep`` and ``own head`` are final (plain micro-batches are
        the fastest step that fits: nothing to profile or plan, said in one line; ``own head`` also takes
        the chunked output head off, the model's own computing its loss); after ``full`` the plan the trial
        ran (:meth:`try_plan`) runs on, and its next step is measured against it; where no trial ran, this
        step is measured and the least recompute that fits the chosen micro-batch is planned, as without
        micro-batching.

        ``kept_peak(samples)``: the peak bytes the search measured for a whole micro-step with every block
        kept. What the profile does not account for of it at the micro-batch that runs is the transient
        outside the blocks beside every activation kept, when the forward ends and backward starts (the
        loss's gradient w.r.t. the logits): the plan holds it beside the activations it keeps
        (:attr:`~lightning_memopt.checkpointing.Plan.transient`), so it never keeps what the search measured
        not to fit."""
        planned, self._trial_plan, self._trying = self._trial_plan, None, False
        self._kept_peak = kept_peak if way == "full" and planned is None else None  # the plan to make
        self.use(way)
        if way == "own head":  # nothing of the head stays attached, nor comes back on resume
            self._leave_own_head()
        if way != "full":
            self._needs_check = self._by_shape = False
            self.shape_plans = ShapePlans()  # the trial's plan, if one was made, is not run
            head = " and leaves its own output head" if way == "own head" else ""
            self.note(f"{self.name} checkpoints no block of {type(self._model).__name__}{head}: {why}")
            self._unpin_unless_offloading()  # a trial's plan that offloaded does not run
            return
        self.note(f"{self.name} recomputes: {why}")
        if planned is not None:
            self.plan, self._needs_check = planned, True
            apply_checkpointing(self._model, planned)
            self._unpin_unless_offloading()
            return
        self._probe = ForwardProbe(self._model, self._found, record=True)

    def fall_back(self, why: str) -> bool:
        """Where the size search decided ``keep`` or ``own head`` (:meth:`decided`), a batch that not one
        sample of fits with every block kept (longer sequences than the search's): from this step on the
        blocks are planned per batch shape, as after ``full``: this step recomputes every block and is
        measured for its plan, and each batch shape no plan covers does the same (the output head stays as
        decided). Said in one line with ``why``. Whether it changed anything (False: already planned per
        shape, not ``auto``, no limit to plan under, no blocks: the engine's error stands).
        (:class:`~lightning_memopt.batching.sizes.Recompute`)"""
        if not self.active or self._by_shape or self.mode != "auto" or self._policy.limit.usable is None:
            return False
        self._by_shape = True
        choices = initial_choices([n for n, _ in self._found], "full")
        apply_checkpointing(self._model, choices)
        self.plan, self._needs_check = Plan.unprofiled(choices), True
        if self._probe is None:
            self._probe = ForwardProbe(self._model, self._found, record=True)
        self.note(
            f"{self.name} recomputes from now on: {why}; each batch shape runs the least recompute that fits "
            "its micro-batches, planned at its first step"
        )
        return True

    def forward_done(self) -> None:
        """The step's forward ended: measure no more (backward runs untracked)."""
        if self._probe is not None:
            self._probe.forward_done(self._batch)
        self._batch = []  # no reference to the batch stays

    def finish_step(
        self,
        *,
        context: Callable[[], contextlib.AbstractContextManager] | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        gather: Gather = _alone,
        signature: Signature | None = None,
    ) -> StepOutcome:
        """After the step: profile the blocks and plan (the step ran unprofiled choices), or compare the
        profiled plan with the bytes the step measured.

        Args:
            context: The precision context the step's forward ran under (autocast), for profiling.
            optimizers: Whose state counts in the step's memory (with parameters and gradients).
            gather: What every process measured (:func:`~lightning_memopt.checkpointing.ranks.gather_over_ranks`):
                every rank plans on each figure's largest, so all run one plan.
            signature: The shapes the blocks really ran (the last micro-batch's), if not the batch's.

        Raises:
            NoPlanFitsError: Under a limit, if no plan fits.
            NoBlockError: For a forced ``mode`` that no block takes (each block's reason in the message).
        """
        probe, self._probe = self._probe, None
        if probe is None:
            return StepOutcome()
        probe.close()
        planned, notes = None, []
        self._signature = signature or self._signature  # what ran: after a back-off, smaller micro-batches
        if not self.plan.predicted:
            ran, planned = self.plan.choices, self._plan_from(probe, context, optimizers, gather)
            notes = self._notes
            if planned is None:  # not profiled (out of memory): the blocks run on as this step ran them
                self._needs_check = False
                if self._trying:
                    self._trial_plan, self._trying = self.plan, False
                return StepOutcome(notes=notes)
            if self._trying:  # the trial's: run at its next turns (try_plan), timed
                self._trial_plan, self._trying = planned, False
            if planned.choices != ran:
                apply_checkpointing(self._model, planned)
            # The next step runs the plan and is measured: this one may have run other micro-batches (the
            # size search's, an exactness check's halves) than those the plan is made for.
            return StepOutcome(planned=planned, notes=notes)
        self._needs_check = False
        total = probe.meter.total
        # A batch smaller than the one planned for holds less: only holding more is then a gap.
        exact = self.shape_plans.exact(self._signature, self.plan)
        measured = total if exact else max(total, self.plan.activation_bytes)
        gap = prediction_gap(self.plan.activation_bytes, measured)
        return StepOutcome(planned=planned, metrics=self.plan.metrics(total), gap=gap, notes=notes)

    def _plan_from(self, probe: ForwardProbe, context, optimizers, gather: Gather) -> Plan | None:
        """Profile the blocks on the inputs ``probe`` recorded and choose the plan (every rank the same);
        None where profiling ran out of memory on some rank (said in :attr:`_notes`): no plan is made, and
        the blocks run on as the step ran them (every block ``full`` in ``auto``: the least memory)."""
        policy = self._policy
        # auto under a limit also times each treatment on the policy's clock: plans priced in seconds
        options = dict(inputs=probe.inputs, context=context, choices=policy.treatments, clock=policy.clock)
        # blocks the forward ran, profiled without ever raising: what cannot be profiled is left out or kept
        options.update(discovered=self.blocks is None, profile=profile_blocks)
        failure = None
        try:
            self._found, profiles, self._notes = profile_blocks_run(self._model, self._found, **options)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            failure = f"{type(error).__name__}: {first_line(error, 160)}"
        measured = None  # outside the except block: the profile's tensors went with its frames
        if failure is None:
            states = state_bytes(self._model, optimizers) if policy.limit.usable is not None else 0
            outside = probe.outside_bytes + probe.batch_bytes  # held outside the blocks through the step
            transient = self._transient(profiles, states + outside)
            measured = Measured(self._signature, profiles, states, outside, transient)
        # Every rank plans on the largest figures over ranks: the same plan, fitting every rank's batch.
        gathered = gather(measured)
        if any(m is None for m in gathered):
            where = f" ({failure})" if failure is not None else " on another process"
            self._notes = [
                f"profiling the blocks on the step's micro-batch ran out of memory{where}; they run on as this "
                "step ran them, unplanned (every block full in mode 'auto': the least memory)"
            ]
            return None
        agreed = agree(gathered)
        held = lambda: (agreed.states, agreed.outside, agreed.transient)  # noqa: E731
        self.plan = policy.choose(agreed.profiles, self.plan.choices, held)
        self._unpin_unless_offloading()
        if not self._trying:  # a trial's plan is said with the decision, if it runs
            self._say_if_idle(self._model)
        if self._by_shape:
            first, *others = agreed.signatures
            self.shape_plans.add(first, self.plan, full_bytes=full_peak(agreed.profiles), also=others)
        return self.plan

    def _unpin_unless_offloading(self) -> None:
        """Where no block of the plan that runs offloads, free the pinned host buffers that the profile's
        ``offload`` passes left in the shared pools (:func:`~lightning_memopt.checkpointing.offload.release_offloaders`):
        else they stay pinned until the process ends, as many bytes as a block saves at the profiled
        micro-batch (gigabytes for a large model). A plan that offloads keeps them for its steps."""
        if "offload" not in self.plan.choices.values():
            release_offloaders()

    def _transient(self, profiles: list, held: int) -> int:
        """The transient beside every activation kept (:meth:`decided`): the peak the size search measured
        with every block kept, at the micro-batch that ran (the line through its probes beyond them), less
        ``held`` (parameters, gradients, optimizer state, activations outside the blocks, the batch) and
        what the blocks hold kept, as profiled; 0 where no search measured it."""
        kept_peak, self._kept_peak = self._kept_peak, None
        if kept_peak is None or not self._signature or len(self._signature[-1]) != 1:
            return 0
        ran = self._signature[-1][0]  # step_signature's micro-batch entry: the samples that ran
        blocks = evaluate_plan(profiles, ["keep"] * len(profiles)).activation_bytes
        return max(0, int(kept_peak(ran)) - held - blocks)

    def _say_if_idle(self, model: nn.Module) -> None:
        """Never a silent no-op: where the plan treats no block, say why in one line (a forced mode that
        applies to no block is an error; under a limit, keeping every block is the fastest plan that fits).

        Raises:
            NoBlockError: For a forced ``mode`` that no block can take.
        """
        if any(choice != "keep" for choice in self.plan.choices.values()):
            return
        what = type(model).__name__
        if self._by_shape and self.shape_plans.made and self._signature:  # one plan of several, by shape
            what += f" for batches of shapes {list(self._signature)}"
        found = len(self.plan.choices)
        cause = "; ".join(self._notes) if self._notes else None
        if self.mode != "auto":
            raise NoBlockError(
                f"{self.name}(mode={self.mode!r}) applies to no block of {what} ({found} profiled): "
                f"{cause or 'no block can be recomputed'}. Pass blocks=[...] naming modules that can be "
                "recomputed, or use mode='auto'"
            )
        if self._policy.limit.usable is not None and self.plan.predicted:
            why = f"the step fits {self.plan_limit()} with every block keeping its activations (no recompute)"
        else:
            why = cause or "recomputing no block lowers the bytes held or the peak"
        self.note(f"{self.name} checkpoints no block of {what}: {why}")

    def state(self) -> dict[str, Any]:
        """The plans as plain values, for a checkpoint (:meth:`load_state`), and whether the size search
        chose the model's own output head."""
        plan = self.plan.to_dict() if self.plan is not None else None
        trial = self._trial_plan.to_dict() if self._trial_plan is not None else None
        return {
            "plan": plan,
            "shapes": self.shape_plans.state(),
            "own_head": self._own_head,
            "trial_plan": trial,
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Take the plans of :meth:`state`: applied now if installed, else at :meth:`install`; not profiled.
        Where the size search had chosen the model's own head, the chunked one is taken off (or never
        installed): the resumed run computes its loss as the run that saved did."""
        if state.get("own_head"):
            self._leave_own_head()
        if state.get("trial_plan") is not None:  # saved during the size search's trial
            self._trial_plan = Plan.from_dict(state["trial_plan"])
        if state.get("plan") is None:
            return
        self.plan = self._loaded_plan = Plan.from_dict(state["plan"])
        self.shape_plans.load(state["shapes"])
        self._needs_check = False
        if self._model is not None and self._found:
            apply_checkpointing(self._model, self._loaded_plan)

    def _leave_own_head(self) -> None:
        self._own_head = True
        self._take_heads_off()

    def _take_heads_off(self) -> None:
        self._heads()
        self._heads = TakenHeads([])

    def remove(self) -> None:
        """Take everything off the model: its blocks run their own ``forward`` again, and the offload pools'
        pinned host buffers are freed (safe to call twice)."""
        # Also after an exception: a MemoryTracker left entered would track every later op of the process.
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self._found and self._model is not None:
            remove_checkpointing(self._model)
        release_offloaders()
        self._take_heads_off()
        self._found, self._model, self._batch = [], None, []

    def note(self, text: str) -> None:
        """Say ``text`` to the user (a warning; the callback says it on rank zero)."""
        warnings.warn(text, UserWarning, stacklevel=3)

    def __repr__(self) -> str:
        if not self.active:
            return f"{type(self).__name__}(mode={self.mode!r}, not installed)"
        return f"{type(self).__name__}(mode={self.mode!r}, {self.plan_limit()}):\n{self.plan.table()}"

    def plan_limit(self) -> str:
        """The limit planned under, in the user's terms (``"max_memory='6GiB'"``; ``"no limit"``)."""
        if self._policy is None or self._policy.limit.usable is None:
            return "no limit"
        return self._policy.limit.describe()


def _forward_of(model: nn.Module, example_batch: Any) -> Callable[[], Any]:
    """How the example batch runs the model's forward: ``model(t)``, ``model(*batch)``, ``model(**batch)``,
    or the callable itself."""
    if isinstance(example_batch, torch.Tensor):
        return lambda: model(example_batch)
    if isinstance(example_batch, (tuple, list)):
        return lambda: model(*example_batch)
    if isinstance(example_batch, Mapping):
        return lambda: model(**example_batch)
    if callable(example_batch) and not isinstance(example_batch, nn.Module):
        return example_batch
    raise TypeError(
        f"example_batch must be a tensor, a tuple or list (model(*batch)), a dict (model(**batch)) or a "
        f"callable taking no arguments that runs the forward and returns the loss; got "
        f"{type(example_batch).__name__}"
    )


def _device_of(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


@contextlib.contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Run a measuring forward that training must not notice: the random generators and the buffers
    (BatchNorm statistics) are put back, and a ``backward`` inside it is refused (it would write ``.grad``)."""
    start, grads = StepState.capture([model]), [p.grad for p in model.parameters()]
    try:
        yield
    finally:
        start.restore()
    if any(p.grad is not g for p, g in zip(model.parameters(), grads)):
        raise ValueError(
            "example_batch ran backward (the parameters' .grad changed): the callable must run the forward "
            "and return the loss only; auto_checkpoint measures the forward and leaves .grad alone"
        )


def auto_checkpoint(
    model: nn.Module,
    example_batch: Any,
    *,
    max_memory: MemoryLimit = None,
    mode: str = "auto",
    blocks: list[type[nn.Module] | str] | str | None = None,
    every_n: int = 2,
    headroom: float = 0.1,
    cost_model: CostModel | None = None,
    allow_offload: bool | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> AutoCheckpointer:
    """Checkpoint ``model``'s repeated blocks with the plan ``AutoCheckpoint`` would choose, without Lightning.

    One forward of ``example_batch`` is measured (the blocks' activations and their inputs), each block
    is profiled under each treatment, and the plan of least step time whose step fits in
    ``max_memory * (1 - headroom)`` is applied. Give the largest batch training will see: the plan is
    made for it. Call it before a wrapper (DDP, FSDP, ``fabric.setup``) wraps the model. The forward
    leaves no trace: random generators, buffers and ``.grad`` are as before.

    Args:
        model: The model (any ``nn.Module``); its blocks are found as ``AutoCheckpoint`` finds them.
        example_batch: A tensor (``model(batch)``), a tuple or list (``model(*batch)``), a dict
            (``model(**batch)``), or a callable taking no arguments that runs the forward and returns the
            loss (``lambda: loss_fn(model(x), y)``; it must not call ``backward``).
        max_memory: The memory a training step may use: bytes (``int``), a string such as ``"6GiB"``, or
            a ``float`` in (0, 1], a fraction of the device's capacity. Default: the CUDA capacity; on a
            CPU none (every block is fully checkpointed where that saves memory).
        mode: ``"auto"`` plans under the limit; ``"full"``, ``"selective"``, ``"offload"``,
            ``"pointwise"`` force that treatment on every block; ``"every_n"`` checkpoints every n-th.
        blocks: Which modules are blocks (classes, class names, name patterns). Default: discovered.
        every_n: The stride of ``mode="every_n"``.
        headroom: Fraction of ``max_memory`` kept free (default 0.1).
        cost_model: How treatments are priced (:class:`~lightning_memopt.checkpointing.CostModel`).
        allow_offload: Whether ``auto`` may offload to CPU. Default: only off the CPU.
        optimizer: Its state counts in the step's memory with the parameters and their gradients (state
            an optimizer such as Adam creates at its first step is not there yet: leave headroom for it).
        context: A callable returning the context the training forward runs under (e.g.
            ``lambda: torch.autocast("cuda", torch.bfloat16)``), used for the measured forward and profiling.

    Returns:
        The :class:`AutoCheckpointer` applied: ``.plan`` (``print(handle)`` shows its table) and
        ``.remove()``, which gives the blocks their own ``forward`` back (``state_dict`` keys never change).

    Raises:
        TypeError: For a ``model`` that is not an ``nn.Module`` or an ``example_batch`` of another kind.
        ValueError: For a bad option, ``blocks`` that match nothing, an ``example_batch`` callable that
            runs backward, or a fraction of an unknown capacity.
        NoPlanFitsError: If no plan fits ``max_memory`` (the message says what the step must hold);
            the model is left as it was.

    Example::

        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)])
        >>> handle = auto_checkpoint(model, torch.randn(32, 64), max_memory="1.2MiB", headroom=0.0)
        >>> handle.plan.activation_bytes < handle.plan.baseline_bytes  # print(handle): the plan's table
        True
        >>> handle.remove()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    forward = _forward_of(model, example_batch)
    checkpointer = AutoCheckpointer(
        blocks=blocks,
        max_memory=max_memory,
        mode=mode,
        every_n=every_n,
        headroom=headroom,
        cost_model=cost_model,
        allow_offload=allow_offload,
        name="auto_checkpoint",
    )
    checkpointer.prepare(_device_of(model))
    why = checkpointer.install(model)
    if why is not None:
        warnings.warn(why, UserWarning, stacklevel=2)
        return checkpointer
    try:
        _measure_and_plan(checkpointer, model, example_batch, forward, optimizer, context)
    except BaseException:
        checkpointer.remove()  # a failed call leaves the model as it was
        raise
    return checkpointer


def _measure_and_plan(checkpointer, model, example_batch, forward, optimizer, context) -> None:
    """One measured forward of the example, then the profiles and the plan (:meth:`~AutoCheckpointer.finish_step`)."""
    signature = shape_signature(example_batch) if not callable(example_batch) else ()
    with _untouched(model), torch.enable_grad():
        checkpointer.start_step(signature, batch=None if callable(example_batch) else example_batch)
        try:
            with context() if context is not None else contextlib.nullcontext():
                out = forward()
            checkpointer.forward_done()  # measured while the forward's graph is alive
            del out  # the graph goes: nothing stays held
        finally:
            checkpointer.forward_done()  # closes the probe if the forward raised (safe twice)
    outcome = checkpointer.finish_step(
        context=context, optimizers=[optimizer] if optimizer is not None else []
    )
    for note in outcome.notes:
        warnings.warn(f"auto_checkpoint: {note}", UserWarning, stacklevel=3)
