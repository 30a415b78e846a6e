"""AutoCheckpoint: selective activation checkpointing planned under a memory limit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_memopt._checks import check_bool
from lightning_memopt.callbacks._hooks import ReleasingCallback, wrap_instance_hook
from lightning_memopt.callbacks._micro_batching import engine_of
from lightning_memopt.checkpointing import (
    ActivationMeter,
    CostModel,
    InfeasibleBudgetError,
    Plan,
    PlanPolicy,
    StepLimit,
    apply_checkpointing,
    check_blocks,
    check_mode,
    deprecated_budget,
    find_blocks,
    framework_checkpointing,
    initial_choices,
    prediction_gap,
    profile_blocks,
    remove_checkpointing,
    state_bytes,
)
from lightning_memopt.checkpointing.profile import ForwardProbe
from lightning_memopt.checkpointing.ranks import Agreed, Measured, agree, gather_over_ranks, most_over_ranks
from lightning_memopt.checkpointing.shapes import ShapePlans, full_peak, step_signature
from lightning_memopt.head.causal_lm import HeadMode, check_head, take_over_heads
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.memory.budget import check_headroom, check_max_memory
from lightning_memopt.memory.device import device_memory

__all__ = ["AutoCheckpoint"]


class AutoCheckpoint(ReleasingCallback):
    """Checkpoint the model's repeated blocks: the least step time whose activations fit in memory.

    With no arguments it finds every stack of repeated blocks (GPT-2's ``h``, T5's encoder and decoder
    blocks, all stages of a ResNet) and the stem before them (a CNN's first convolution, norm and pooling,
    a patch embedding), each a unit (the rule: :func:`~lightning_memopt.checkpointing.find_blocks`). Where
    a memory limit is known (``max_memory``, or a CUDA device's capacity), it plans per unit among keep /
    op-level selective / pointwise modules / full / CPU offload, by the time each is measured to take, so
    that the step fits in ``max_memory * (1 - headroom)``. Where none is known (CPU), every unit is fully
    checkpointed, except units where that lowers neither the bytes held nor the peak: those keep their
    activations, so the peak never rises.

    When (details on the docs page): installed after ``configure_model``, before the strategy wraps the
    model; profiled and planned after the first batch, whose successor is measured against the plan (a
    warning past 10%); under a limit, again after each batch larger than all planned ones (by shape:
    :class:`~lightning_memopt.checkpointing.shapes.ShapePlans`), which runs every block full; a resumed run
    takes the plans from the checkpoint. Under DDP/FSDP every rank runs the same plan, made on each figure's
    largest over ranks (:mod:`~lightning_memopt.checkpointing.ranks`, which counts the collectives). Where the model checkpoints itself (transformers'
    ``gradient_checkpointing_enable()``, timm's ``set_grad_checkpointing()``, FSDPStrategy's
    ``activation_checkpointing_policy``) it warns once and steps aside.

    Args:
        blocks: Which modules are blocks: classes, class names or module-name patterns (``"layers.*"``),
            relative to the LightningModule or to the module holding the blocks. Default: discovered.
        max_memory: The memory a training step may use on the device: bytes (``int``), a string such as
            ``"6GiB"``, or a ``float`` in (0, 1], a fraction of the device's capacity. Default (None): the
            capacity where known. Only ``mode="auto"`` uses it.
        mode: ``"auto"`` plans under the limit; ``"full"``, ``"selective"``, ``"offload"``, ``"pointwise"``
            force that treatment on every block; ``"every_n"`` fully checkpoints every ``every_n``-th block.
        every_n: The stride of ``mode="every_n"`` (default 2: blocks 0, 2, 4, ...).
        headroom: Fraction of ``max_memory`` kept free (default 0.1), for the allocator's fragmentation
            and recomputation's transient memory in backward. Usable bytes: ``max_memory * (1 - headroom)``.
        cost_model: How treatments are priced (:class:`CostModel`): by default in seconds each is timed to
            take while profiling (``use_time=False``: in FLOPs, with offload priced by a timed copy).
        allow_offload: Whether ``auto`` may offload to CPU. Default: only when the device is not the CPU.
        log: Whether to log the keys below.
        head: A Hugging Face causal LM's loss without its logits (:data:`~lightning_memopt.head.HeadMode`).
        budget: Deprecated, use ``max_memory``. ``budget=X`` means ``max_memory=X, headroom=0`` (the old
            meaning: the whole budget was usable).

    Raises:
        ValueError: For a limit that is not a positive size or a fraction in (0, 1], an unknown mode,
            ``every_n < 1``, a limit with a forced mode, a bad headroom, ``blocks``, ``cost_model``,
            ``allow_offload`` or ``log`` of the wrong kind.
        MisconfigurationException: In ``setup``, for a fraction of an unknown capacity; after the first
            batch, for a limit too small for any plan (the message says what it must hold).

    Logged keys (at the first batch that runs each plan made):

    ==========================================  =============================================
    ``checkpoint/activation_bytes_predicted``   bytes the blocks hold for backward (the plan)
    ``checkpoint/activation_bytes_measured``    the same, measured with ``MemoryTracker``
    ``checkpoint/recompute_gflops``             predicted recompute, GFLOP per step
    ==========================================  =============================================

    Example::

        >>> trainer = pl.Trainer(callbacks=[AutoCheckpoint()])  # doctest: +SKIP
        >>> trainer = pl.Trainer(callbacks=[AutoCheckpoint(max_memory="6GiB")])  # doctest: +SKIP
        >>> trainer = pl.Trainer(callbacks=[AutoCheckpoint(mode="selective", blocks=["layers.*"])])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        blocks: list[type[torch.nn.Module] | str] | str | None = None,
        # float before str: a CLI's "0.5" is a fraction (jsonargparse tries the union's types in order)
        max_memory: int | float | str | None = None,
        mode: Literal["auto", "full", "selective", "offload", "every_n", "pointwise"] = "auto",
        every_n: int = 2,
        headroom: float = 0.1,
        cost_model: CostModel | None = None,
        allow_offload: bool | None = None,
        log: bool = True,
        budget: int | float | str | None = None,
        head: HeadMode = "auto",
    ) -> None:
        max_memory, headroom, self._limit_name = deprecated_budget(max_memory, headroom, budget)
        check_max_memory(max_memory, name=self._limit_name)
        check_mode(mode, every_n, max_memory, cost_model, name=self._limit_name)
        check_bool("allow_offload", allow_offload, none_ok=True)
        check_bool("log", log)
        check_blocks(blocks)
        self.blocks, self.head, self._undo_head = blocks, check_head(head), lambda: None
        # log_metrics, not `self.log`: Lightning sets `callback.log = pl_module.log` on every callback.
        self.max_memory, self.mode, self.every_n, self.log_metrics = max_memory, mode, every_n, log
        self.headroom = check_headroom(headroom)
        self.cost_model, self.allow_offload = cost_model, allow_offload
        self.plan: Plan | None = None
        self._loaded_plan: Plan | None = None
        self._blocks: list[tuple[str, torch.nn.Module]] = []
        self._module: pl.LightningModule | None = None
        self._policy: PlanPolicy | None = None  # mode, limit, treatments: resolved in setup
        self._needs_check = False  # the next batch measures the plan and compares
        self.shape_plans = ShapePlans()  # under a limit: the plans made, by the shapes they were made for
        self._signature: tuple = ()  # the shapes of the batch running
        self._by_shape = False  # whether plans are made per batch shape: auto under a known limit
        self._probe: ForwardProbe | None = None  # measures a batch's forward (and records block inputs)
        self._unwrap: Callable[[], None] | None = None  # undoes the configure_model wrapper

    @property
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.mode, blocks=repr(self.blocks))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        # FSDPStrategy's, listed (and tested) in lightning_memopt/_lightning.py.
        if getattr(strategy, "_activation_checkpointing_kwargs", None):
            return self._step_aside("the strategy (FSDPStrategy's activation_checkpointing_policy)")
        capacity = device_memory(strategy.root_device, tracker=MemoryTracker()).capacity()
        offload = self.allow_offload if self.allow_offload is not None else strategy.root_device.type != "cpu"
        try:
            limit = StepLimit.resolve(self.max_memory, self.headroom, capacity, name=self._limit_name)
        except ValueError as err:
            raise MisconfigurationException(f"AutoCheckpoint: {err}") from err
        self._policy = PlanPolicy.for_mode(
            self.mode, limit, offload=offload, cost_model=self.cost_model, device=strategy.root_device
        )
        self._module, self._by_shape = pl_module, self.mode == "auto" and limit.usable is not None
        # An instance attribute, removed in teardown; Lightning calls it since it differs from the base hook.
        self._unwrap = wrap_instance_hook(
            pl_module, "configure_model", after=lambda: self._install(trainer, pl_module)
        )

    def _step_aside(self, who: str) -> None:
        rank_zero_warn(
            f"AutoCheckpoint: {who} already checkpoints activations and AutoCheckpoint does nothing, so that "
            "blocks are not checkpointed twice. Remove one of the two."
        )

    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Order (DESIGN.md): BatchNorm swap, checkpointing HERE (after configure_model, before precision and
        # DDP/FSDP wrapping), strategy.setup, micro-batching. Only the blocks' (and LM's) `forward` changes.
        self._undo_head = take_over_heads(pl_module, self.head, note=rank_zero_warn)
        if (own := framework_checkpointing(pl_module)) is not None:
            return self._step_aside(own)
        blocks = find_blocks(pl_module, self.blocks)
        if not blocks:
            return rank_zero_warn(
                f"AutoCheckpoint found no repeated blocks in {type(pl_module).__name__} and changes nothing; "
                "pass blocks=[YourBlockClass] or module-name patterns like blocks=['layers.*']"
            )
        self._blocks = blocks
        loaded, names = self._loaded_plan, [n for n, _ in blocks]
        choices = dict(loaded.choices) if loaded else initial_choices(names, self.mode, self.every_n)
        apply_checkpointing(pl_module, choices)
        self.plan, self._needs_check = loaded or Plan.unprofiled(choices), loaded is None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._blocks or self.plan is None:
            return
        engine = engine_of(trainer)
        self._signature = step_signature(batch, None if engine is None else engine.peek(batch))
        if self._by_shape and self.plan.predicted:  # a plan covering every rank's batch, or profile them
            most = lambda flags: most_over_ranks(trainer.strategy, flags)  # noqa: E731
            plan = self.shape_plans.next_plan(self._signature, self.plan, most)
            self._needs_check = self._needs_check or not plan.predicted
            if plan is not self.plan:
                self.plan = plan
                apply_checkpointing(pl_module, plan.choices)
        if self._needs_check and self._probe is None:
            self._probe = ForwardProbe(pl_module, self._blocks, record=not self.plan.predicted)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._probe is not None:
            self._probe.forward_done()  # measure the forward only: backward runs untracked

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx
    ) -> None:
        probe, self._probe = self._probe, None
        if probe is None:
            return
        probe.close()
        if not self.plan.predicted:
            policy, context = self._policy, trainer.precision_plugin.forward_context
            # auto under a limit also times each treatment on the policy's clock: plans priced in seconds
            options = dict(
                inputs=probe.inputs, context=context, choices=policy.treatments, clock=policy.clock
            )
            profiles = profile_blocks(pl_module, self._blocks, **options)
            states = state_bytes(pl_module, trainer.optimizers) if policy.limit.usable is not None else 0
            if engine := engine_of(trainer):  # profiled: the last (largest) micro-batch
                self._signature = step_signature(batch, engine.ran_size)
            # Every rank plans on the largest figures over ranks: the same plan, fitting every rank's batch.
            mine = Measured(self._signature, profiles, states, probe.outside_bytes)
            agreed = agree(gather_over_ranks(trainer.strategy, mine))
            ran = self.plan.choices
            self.plan = self._choose(agreed)
            rank_zero_info("AutoCheckpoint plan:\n" + self.plan.table())
            if self._by_shape:
                first, *others = agreed.signatures
                self.shape_plans.add(first, self.plan, full_bytes=full_peak(agreed.profiles), also=others)
            if self.plan.choices != ran:
                apply_checkpointing(pl_module, self.plan)
                return  # the next batch runs the new plan: measure that one
        self._needs_check = False
        self._compare(pl_module, probe.meter)

    def _choose(self, agreed: Agreed) -> Plan:
        """The plan to run from now on, given what the ranks measured (the same on every rank)."""
        held = lambda: (agreed.states, agreed.outside)  # noqa: E731
        try:
            return self._policy.choose(agreed.profiles, list(self.plan.choices.values()), held)
        except InfeasibleBudgetError as err:
            raise MisconfigurationException(f"AutoCheckpoint: {err}") from err

    def _compare(self, pl_module: pl.LightningModule, meter: ActivationMeter) -> None:
        if self.log_metrics:
            metrics = {f"checkpoint/{k}": v for k, v in self.plan.metrics(meter.total).items()}
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        # A batch smaller than the one planned for holds less: only holding more is then a gap.
        exact = self.shape_plans.exact(self._signature, self.plan)
        measured = meter.total if exact else max(meter.total, self.plan.activation_bytes)
        if (gap := prediction_gap(self.plan.activation_bytes, measured)) is not None:
            rank_zero_warn(f"AutoCheckpoint: {gap}")

    @override
    def state_dict(self) -> dict[str, Any]:
        plan = self.plan.to_dict() if self.plan is not None else None
        return {"plan": plan, "shapes": self.shape_plans.state()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("plan") is None:
            return
        self.plan = self._loaded_plan = Plan.from_dict(state_dict["plan"])
        self.shape_plans.load(state_dict.get("shapes"), self._loaded_plan)
        self._needs_check = False
        if self._module is not None and self._blocks:
            apply_checkpointing(self._module, self._loaded_plan)

    @override
    def _release(self) -> None:
        # Also after an exception: a MemoryTracker left entered would track every later op of the process.
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None
        self._undo_head()
        if self._blocks and self._module is not None:
            remove_checkpointing(self._module)
        self._blocks, self._module = [], None
