"""AutoCheckpoint: selective activation checkpointing planned under a memory limit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation, rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memopt._checks import check_bool, check_positive_int
from lightning_memopt.callbacks._hooks import wrap_instance_hook
from lightning_memopt.checkpointing import (
    ActivationMeter,
    CostModel,
    InfeasibleBudgetError,
    Plan,
    apply_checkpointing,
    check_blocks,
    evaluate_plan,
    find_blocks,
    framework_checkpointing,
    keep_where_no_gain,
    plan_within,
    profile_blocks,
    remove_checkpointing,
    state_bytes,
    treatments,
)
from lightning_memopt.checkpointing.profile import ForwardProbe
from lightning_memopt.memory import MemoryTracker, format_bytes
from lightning_memopt.memory.budget import check_headroom, check_max_memory, usable_bytes
from lightning_memopt.memory.device import device_memory

__all__ = ["AutoCheckpoint"]

_MODES = ("auto", "full", "selective", "offload", "every_n")
_TOLERANCE = 0.10  # measured vs predicted activation bytes


class AutoCheckpoint(Callback):
    """Checkpoint the model's repeated blocks: the least recompute whose activations fit in memory.

    With no arguments it finds every stack of repeated blocks (GPT-2's ``h``, T5's encoder and decoder
    blocks, all stages of a ResNet; the rule: :func:`~lightning_memopt.checkpointing.find_blocks`) and,
    where a memory limit is known (``max_memory``, or the capacity of a CUDA device), plans per block
    among keep / op-level selective / full recompute / CPU offload so that parameters, gradients,
    optimizer state and activations fit in ``max_memory * (1 - headroom)``. Where no limit is known
    (CPU), every block is fully checkpointed, except blocks where checkpointing lowers neither the bytes
    held nor the peak: those keep their activations, so the peak never rises.

    When things happen (order of transformations, see DESIGN.md): checkpointing is installed right after
    the module's ``configure_model`` and before the strategy wraps the model. The first training batch
    records each block's inputs and measures its activation bytes; after it the blocks are profiled (only
    the treatments the mode can choose), the plan is chosen, logged once as a table and applied. The first
    batch that runs the final plan is measured and compared with the prediction (a warning past 10%). A
    resumed run gets the plan from the checkpoint and neither profiles nor plans again. Where the model
    already checkpoints itself (transformers' ``gradient_checkpointing_enable()``, timm's
    ``set_grad_checkpointing()``, FSDPStrategy's ``activation_checkpointing_policy``), AutoCheckpoint
    warns once and steps aside: blocks are never checkpointed twice.

    Args:
        blocks: Which modules are blocks: classes, class names or module-name patterns (``"layers.*"``),
            relative to the LightningModule or to the module holding the blocks. Default: discovered.
        max_memory: The memory a training step may use on the device: bytes (``int``), a string such as
            ``"6GiB"``, or a ``float`` in (0, 1], a fraction of the device's capacity. Default (None): the
            capacity where known. Only ``mode="auto"`` uses it.
        mode: ``"auto"`` plans under the limit; ``"full"``, ``"selective"`` or ``"offload"`` force that
            treatment on every block; ``"every_n"`` fully checkpoints every ``every_n``-th block.
        every_n: The stride of ``mode="every_n"`` (default 2: blocks 0, 2, 4, ...).
        headroom: Fraction of ``max_memory`` kept free (default 0.1), for the allocator's fragmentation
            and recomputation's transient memory in backward. Usable bytes: ``max_memory * (1 - headroom)``.
        cost_model: Prices of pointwise recompute and offload bytes in FLOPs (:class:`CostModel`).
        allow_offload: Whether ``auto`` may offload to CPU. Default: only when the device is not the CPU.
        log: Whether to log the keys below.
        budget: Deprecated, use ``max_memory``. ``budget=X`` means ``max_memory=X, headroom=0`` (the old
            meaning: the whole budget was usable).

    Raises:
        ValueError: For a limit that is not a positive size or a fraction in (0, 1], an unknown mode,
            ``every_n < 1``, a limit with a forced mode, a bad headroom, ``blocks``, ``cost_model``,
            ``allow_offload`` or ``log`` of the wrong kind.
        MisconfigurationException: In ``setup``, for a fraction of an unknown capacity; after the first
            batch, for a limit too small for any plan (the message says what it must hold).

    Logged keys (once, at the first batch that runs the final plan):

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
        mode: Literal["auto", "full", "selective", "offload", "every_n"] = "auto",
        every_n: int = 2,
        headroom: float = 0.1,
        cost_model: CostModel | None = None,
        allow_offload: bool | None = None,
        log: bool = True,
        budget: int | float | str | None = None,
    ) -> None:
        self._limit_name = "max_memory" if budget is None else "budget"
        if budget is not None:
            if max_memory is not None:
                raise ValueError(
                    f"pass max_memory={max_memory!r} or the deprecated budget={budget!r}, not both"
                )
            rank_zero_deprecation(
                "AutoCheckpoint(budget=...) is deprecated and will be removed in the next release; use "
                "max_memory=... (budget=X means max_memory=X, headroom=0)"
            )
            max_memory, headroom = budget, 0.0
        check_max_memory(max_memory, name=self._limit_name)
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if max_memory is not None and mode != "auto":
            raise ValueError(
                f"{self._limit_name}={max_memory!r} is only used by mode='auto', got mode={mode!r}"
            )
        check_positive_int("every_n", every_n)
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise ValueError(
                f"cost_model must be a CostModel, got {cost_model!r}; e.g. CostModel(offload_flops_per_byte=1e4)"
            )
        check_bool("allow_offload", allow_offload, none_ok=True)
        check_bool("log", log)
        check_blocks(blocks)
        self.blocks = blocks
        self.max_memory = max_memory
        self.mode = mode
        self.every_n = every_n
        self.headroom = check_headroom(headroom)
        self.cost_model = cost_model or CostModel()
        self.allow_offload = allow_offload
        # Not `self.log`: Lightning sets `callback.log = pl_module.log` on every callback at fit start.
        self.log_metrics = log
        self.plan: Plan | None = None
        self._loaded_plan: Plan | None = None
        self._blocks: list[tuple[str, torch.nn.Module]] = []
        self._module: pl.LightningModule | None = None
        self._usable: int | None = None  # max_memory * (1 - headroom) in bytes, where known
        self._treatments: list[str] = []  # what profiling measures: keep, and what the mode may choose
        self._needs_check = False  # the next batch measures the plan and compares
        self._probe: ForwardProbe | None = None  # measures a batch's forward (and records block inputs)
        self._unwrap: Callable[[], None] | None = None  # undoes the configure_model wrapper

    @property
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.mode, blocks=repr(self.blocks))

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        # FSDPStrategy's, listed (and tested) in batching/engine.py's LIGHTNING_SURFACE.
        if getattr(strategy, "_activation_checkpointing_kwargs", None):
            return self._step_aside("the strategy (FSDPStrategy's activation_checkpointing_policy)")
        capacity = device_memory(strategy.root_device, tracker=MemoryTracker()).capacity()
        try:
            self._usable = usable_bytes(self.max_memory, self.headroom, capacity, name=self._limit_name)
        except ValueError as err:
            raise MisconfigurationException(f"AutoCheckpoint: {err}") from err
        offload = self.allow_offload if self.allow_offload is not None else strategy.root_device.type != "cpu"
        self._treatments = treatments(self.mode, planned=self._usable is not None, offload=offload)
        self._module = pl_module
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
        # Order of transformations (DESIGN.md): 1. BatchNorm swap (callback setup), 2. activation
        # checkpointing HERE, after configure_model and before the strategy converts precision and wraps
        # the model (DDP/FSDP), 3. strategy.setup, 4. micro-batching engine at fit start. Only the blocks'
        # instance `forward` changes, so wrapping, sharding (FSDP2 hooks run around the checkpointed
        # region) and state_dict keys are unaffected whichever order a user's configure_model used.
        own = framework_checkpointing(pl_module)
        if own is not None:
            return self._step_aside(own)
        blocks = find_blocks(pl_module, self.blocks)
        if not blocks:
            rank_zero_warn(
                f"AutoCheckpoint found no repeated blocks in {type(pl_module).__name__} and changes nothing; "
                "pass blocks=[YourBlockClass] or module-name patterns like blocks=['layers.*']"
            )
            return
        self._blocks = blocks
        names = [n for n, _ in blocks]
        if self._loaded_plan is not None:
            choices = dict(self._loaded_plan.choices)
        elif self.mode == "every_n":
            choices = {n: "full" if i % self.every_n == 0 else "keep" for i, n in enumerate(names)}
        else:
            # Auto runs the first batch with every block fully checkpointed (the least memory), then plans.
            choices = dict.fromkeys(names, "full" if self.mode == "auto" else self.mode)
        apply_checkpointing(pl_module, choices)
        self.plan = self._loaded_plan or Plan.unprofiled(choices)
        self._needs_check = self._loaded_plan is None

    # ------------------------------------------------------------------ first batches
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._blocks and self._needs_check and self._probe is None and self.plan is not None:
            self._probe = ForwardProbe(pl_module, self._blocks, record=not self.plan.predicted)

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
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
        assert self.plan is not None
        if not self.plan.predicted:
            context = trainer.precision_plugin.forward_context
            profiles = profile_blocks(
                pl_module, self._blocks, inputs=probe.inputs, context=context, choices=self._treatments
            )
            ran = self.plan.choices
            self.plan = self._choose(trainer, pl_module, profiles, probe.outside_bytes)
            rank_zero_info("AutoCheckpoint plan:\n" + self.plan.table())
            if self.plan.choices != ran:
                apply_checkpointing(pl_module, self.plan)
                return  # the next batch runs the new plan: measure that one
        self._needs_check = False
        self._compare(pl_module, probe.meter)

    def _choose(self, trainer: pl.Trainer, pl_module: pl.LightningModule, profiles, outside: int) -> Plan:
        """The plan to run from now on, given the blocks' profiles."""
        assert self.plan is not None
        ran = list(self.plan.choices.values())
        if self.mode != "auto" or self._usable is None:  # no limit: recompute wherever it lowers the bytes
            chosen = ran if self.mode != "auto" else keep_where_no_gain(profiles, ran)
            return evaluate_plan(profiles, chosen, self.cost_model)
        # The largest over ranks (FSDP shards can differ by a few bytes), so that every rank plans the same.
        held = torch.tensor(
            [state_bytes(pl_module, trainer.optimizers), outside], device=trainer.strategy.root_device
        )
        states, outside = trainer.strategy.reduce(held, reduce_op="max").tolist()
        try:
            allowed, costs = self._treatments, self.cost_model
            return plan_within(
                profiles, self._usable, states=states, outside=outside, allowed=allowed, cost_model=costs
            )
        except InfeasibleBudgetError as err:
            limit = (
                f"{self._limit_name}={self.max_memory!r}" if self.max_memory is not None else "the capacity"
            )
            raise MisconfigurationException(
                f"AutoCheckpoint: {limit} (usable with headroom={self.headroom}: {format_bytes(self._usable)}) "
                f"{err}. Pass {self._limit_name} >= {format_bytes(int(err.minimum / (1 - self.headroom)) + 1)}, "
                "use a smaller micro-batch (AutoAccumulation) or shard the model (FSDP)."
            ) from err

    def _compare(self, pl_module: pl.LightningModule, meter: ActivationMeter) -> None:
        assert self.plan is not None
        measured, predicted = meter.total, self.plan.activation_bytes
        if self.log_metrics:
            pl_module.log_dict(
                {
                    "checkpoint/activation_bytes_predicted": float(predicted),
                    "checkpoint/activation_bytes_measured": float(measured),
                    "checkpoint/recompute_gflops": self.plan.extra_flops / 1e9,
                },
                on_step=True,
                on_epoch=False,
            )
        if abs(measured - predicted) > _TOLERANCE * max(predicted, 1):
            rank_zero_warn(
                f"AutoCheckpoint: the blocks held {format_bytes(measured)} for backward, the plan predicted "
                f"{format_bytes(predicted)} (more than {_TOLERANCE:.0%} apart). The blocks' inputs or behaviour "
                "may change between batches (variable sequence length?); leave more headroom."
            )

    # ------------------------------------------------------------------ state, teardown
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict() if self.plan is not None else None}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("plan") is None:
            return
        self._loaded_plan = Plan.from_dict(state_dict["plan"])
        self.plan = self._loaded_plan
        self._needs_check = False
        if self._module is not None and self._blocks:
            apply_checkpointing(self._module, self._loaded_plan)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning calls no teardown after an exception: take off the measuring hooks (a MemoryTracker
        # left entered would track every later op of the process) and the checkpointing here instead.
        self.teardown(trainer, pl_module, "fit")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None
        if self._blocks:
            remove_checkpointing(pl_module)
        self._blocks = []
        self._module = None
        # Lightning binds the module's log methods onto every callback; a callback kept by the user would
        # keep the module alive through them.
        for name in ("log", "log_dict"):
            self.__dict__.pop(name, None)
