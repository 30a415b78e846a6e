"""AutoCheckpoint: selective activation checkpointing planned under a memory budget."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memopt.callbacks._hooks import wrap_instance_hook
from lightning_memopt.checkpointing import (
    ActivationMeter,
    CostModel,
    Plan,
    apply_checkpointing,
    evaluate_plan,
    find_blocks,
    plan_checkpointing,
    profile_blocks,
    remove_checkpointing,
)
from lightning_memopt.checkpointing.profile import record_block_inputs
from lightning_memopt.memory import MemoryTracker, format_bytes, parse_bytes
from lightning_memopt.memory.device import device_memory

__all__ = ["AutoCheckpoint"]

_MODES = ("auto", "full", "selective", "offload", "every_n")
_TOLERANCE = 0.10  # measured vs predicted activation bytes


class AutoCheckpoint(Callback):
    """Checkpoint the model's repeated blocks: the least recompute whose activations fit in memory.

    With no arguments it finds the repeated blocks (GPT-2's ``h``, a ViT's ``blocks``, a ResNet stage)
    and, where the device's capacity is known (CUDA), plans per block among keep / op-level selective /
    full recompute / CPU offload so that parameters, gradients, optimizer state and activations fit in the
    capacity minus ``headroom``. Where no capacity is known (CPU) and no ``budget`` is given, every block
    is fully checkpointed.

    When things happen (order of transformations, see DESIGN.md): checkpointing is installed right after
    the module's ``configure_model`` (so layers built there, FSDP users' included) and before the strategy
    wraps the model. On the first training batch each block's inputs are recorded and its activation
    bytes measured; after that batch the blocks are profiled on those inputs, the plan is chosen (auto
    mode with a budget or a known capacity), logged once as a table, and from then on applied. The first
    batch that runs the final plan is measured and compared with the prediction (a warning past 10%).
    A resumed run gets the plan from the checkpoint and neither profiles nor plans again.

    Args:
        blocks: Which modules are blocks: classes, class names or module-name patterns
            (``"layers.*"``). Default: discovered (the longest run of same-class children of a
            ``ModuleList``/``Sequential``).
        budget: Memory the training step may use on the device: bytes (``int``), a string such as
            ``"6GiB"``, or a ``float`` in (0, 1], a fraction of the device's capacity. Parameters,
            gradients, optimizer state and the activations outside the blocks are taken off it; the rest
            is the blocks' activation budget. Default: the device capacity times ``1 - headroom``.
        mode: ``"auto"`` plans under the budget; ``"full"``, ``"selective"`` or ``"offload"`` force that
            treatment on every block; ``"every_n"`` fully checkpoints every ``every_n``-th block.
        every_n: The stride of ``mode="every_n"`` (default 2: blocks 0, 2, 4, ...).
        headroom: Fraction of the capacity left free when no ``budget`` is given (default 0.1), for the
            allocator's fragmentation and recomputation's transient memory in backward.
        cost_model: Prices of pointwise recompute and offload bytes in FLOPs (:class:`CostModel`).
        allow_offload: Whether ``auto`` may offload to CPU. Default: only when the device is not the CPU.

    Raises:
        ValueError: For a budget that is not a positive size or a fraction in (0, 1], an unknown mode,
            ``every_n < 1``, a budget with a forced mode, or a bad headroom.

    Logged keys (once, at the first batch that runs the final plan):

    ==============================================  =========================================
    ``auto_checkpoint/activation_bytes_predicted``  bytes the blocks hold for backward (plan)
    ``auto_checkpoint/activation_bytes_measured``   the same, measured with ``MemoryTracker``
    ``auto_checkpoint/recompute_gflops``            predicted recompute GFLOP per step
    ==============================================  =========================================

    Example::

        >>> trainer = pl.Trainer(callbacks=[AutoCheckpoint()])  # doctest: +SKIP
        >>> trainer = pl.Trainer(callbacks=[AutoCheckpoint(budget="6GiB")])  # doctest: +SKIP
        >>> trainer = pl.Trainer(callbacks=[AutoCheckpoint(mode="selective", blocks=["layers.*"])])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        blocks: list[type[torch.nn.Module] | str] | str | None = None,
        budget: int | float | str | None = None,
        mode: Literal["auto", "full", "selective", "offload", "every_n"] = "auto",
        every_n: int = 2,
        headroom: float = 0.1,
        cost_model: CostModel | None = None,
        allow_offload: bool | None = None,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if isinstance(budget, float):
            if not 0 < budget <= 1:
                raise ValueError(
                    f"budget as a float is a fraction of device capacity and must be in (0, 1], got {budget!r}; "
                    "pass bytes (an int or a string like '6GiB') for an absolute budget"
                )
        elif budget is not None:
            parse_bytes(budget, name="budget")
        if budget is not None and mode != "auto":
            raise ValueError(
                f"budget={budget!r} is only used by mode='auto', got mode={mode!r}; drop one of them"
            )
        if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
            raise ValueError(f"every_n must be an int >= 1, got {every_n!r}")
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
        self.blocks = blocks
        self.budget = budget
        self.mode = mode
        self.every_n = every_n
        self.headroom = headroom
        self.cost_model = cost_model or CostModel()
        self.allow_offload = allow_offload
        self.plan: Plan | None = None
        self._loaded_plan: Plan | None = None
        self._blocks: list[tuple[str, torch.nn.Module]] = []
        self._module: pl.LightningModule | None = None
        self._capacity: int | None = None
        self._needs_plan = False  # auto mode with a budget: choose after profiling the first batch
        self._needs_check = False  # the next batch measures the plan and compares
        self._batch_stack: contextlib.ExitStack | None = None
        self._meter: ActivationMeter | None = None
        self._unwrap: Callable[[], None] | None = None  # undoes the configure_model wrapper
        self._inputs: dict | None = None
        self._outside_bytes = 0
        self._skip = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.mode, blocks=repr(self.blocks))

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if getattr(strategy, "_activation_checkpointing_kwargs", None):
            rank_zero_warn(
                "AutoCheckpoint: the strategy already checkpoints activations (FSDPStrategy's "
                "activation_checkpointing_policy); AutoCheckpoint does nothing so blocks are not checkpointed "
                "twice. Remove one of the two."
            )
            self._skip = True
            return
        self._capacity = device_memory(strategy.root_device, tracker=MemoryTracker()).capacity()
        if isinstance(self.budget, float) and self._capacity is None:
            raise MisconfigurationException(
                f"AutoCheckpoint(budget={self.budget!r}) is a fraction of device capacity, but the capacity of "
                f"{strategy.root_device} is unknown; pass bytes instead, e.g. budget='6GiB'"
            )
        self._module = pl_module
        # An instance attribute, removed in teardown; Lightning calls it since it differs from the base hook.
        self._unwrap = wrap_instance_hook(
            pl_module, "configure_model", after=lambda: self._install(trainer, pl_module)
        )

    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Order of transformations (DESIGN.md): 1. BatchNorm swap (callback setup), 2. activation
        # checkpointing HERE, after configure_model and before the strategy converts precision and wraps
        # the model (DDP/FSDP), 3. strategy.setup, 4. micro-batching engine at fit start. Only the blocks'
        # instance `forward` changes, so wrapping, sharding (FSDP2 hooks run around the checkpointed
        # region) and state_dict keys are unaffected whichever order a user's configure_model used.
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
        elif self.mode in ("full", "selective", "offload"):
            choices = dict.fromkeys(names, self.mode)
        elif self.mode == "every_n":
            choices = {n: "full" if i % self.every_n == 0 else "keep" for i, n in enumerate(names)}
        else:
            # Auto: with a budget or a known capacity, plan after profiling the first batch (which runs with
            # every block fully checkpointed, the least memory); otherwise every block stays full.
            choices = dict.fromkeys(names, "full")
            self._needs_plan = self.budget is not None or self._capacity is not None
        apply_checkpointing(pl_module, choices)
        self.plan = self._loaded_plan or Plan.unprofiled(choices)
        self._needs_check = self._loaded_plan is None

    # ------------------------------------------------------------------ first batches
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._skip or not self._blocks or not self._needs_check or self._batch_stack is not None:
            return
        stack = contextlib.ExitStack()
        meter = self._meter = stack.enter_context(ActivationMeter(pl_module, self._blocks))
        if self.plan is not None and not self.plan.predicted:
            held = lambda t: meter.tracker.category_of(t) == "activations"  # noqa: E731
            self._inputs = stack.enter_context(record_block_inputs(self._blocks, held))
        self._batch_stack = stack

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._batch_stack is not None and self._meter is not None:
            # Under a micro-batching engine the micro-batches' backwards already ran: nothing is held now.
            self._outside_bytes = max(
                0, self._meter.tracker.current_breakdown["activations"] - self._meter.total
            )
            self._batch_stack.close()  # measure forward only: backward runs untracked

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx
    ) -> None:
        if self._batch_stack is None:
            return
        self._batch_stack.close()
        self._batch_stack = None
        meter, self._meter = self._meter, None
        assert meter is not None and self.plan is not None
        if not self.plan.predicted:
            inputs, self._inputs = self._inputs, None
            profiles = profile_blocks(
                pl_module, self._blocks, inputs=inputs, context=trainer.precision_plugin.forward_context
            )
            if self._needs_plan:
                self._needs_plan = False
                new = self._plan(trainer, pl_module, profiles)
                if new.choices != self.plan.choices:
                    apply_checkpointing(pl_module, new)
                    self.plan = new
                    rank_zero_info("AutoCheckpoint plan:\n" + new.table())
                    return  # the next batch runs the new plan: measure that one
                self.plan = new
            else:
                self.plan = evaluate_plan(profiles, list(self.plan.choices.values()), self.cost_model)
            rank_zero_info("AutoCheckpoint plan:\n" + self.plan.table())
        self._needs_check = False
        self._compare(pl_module, meter)

    def _plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, profiles) -> Plan:
        with MemoryTracker(pl_module, trainer.optimizers) as tracker:
            states = tracker.current_breakdown
        trainable = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
        static = states["parameters"] + max(states["gradients"], trainable) + states["optimizer_state"]
        if self.budget is None:
            assert self._capacity is not None
            total = int(self._capacity * (1 - self.headroom))
        elif isinstance(self.budget, float):
            assert self._capacity is not None
            total = int(self._capacity * self.budget)
        else:
            total = parse_bytes(self.budget, name="budget")
        blocks_budget = total - static - self._outside_bytes
        # The smallest over ranks (FSDP shards can differ by a few bytes), so that every rank plans the same.
        device = trainer.strategy.root_device
        blocks_budget = int(
            trainer.strategy.reduce(torch.tensor(blocks_budget, device=device), reduce_op="min")
        )
        if blocks_budget <= 0:
            raise MisconfigurationException(
                f"AutoCheckpoint: the budget {format_bytes(total)} does not even hold the parameters, gradients and "
                f"optimizer state ({format_bytes(static)}) and the activations outside the blocks "
                f"({format_bytes(self._outside_bytes)}); raise the budget or shard the model (FSDP)"
            )
        allow_offload = self.allow_offload if self.allow_offload is not None else device.type != "cpu"
        allowed = ["keep", "selective", "full"] + (["offload"] if allow_offload else [])
        return plan_checkpointing(profiles, blocks_budget, allowed=allowed, cost_model=self.cost_model)

    def _compare(self, pl_module: pl.LightningModule, meter: ActivationMeter) -> None:
        assert self.plan is not None
        measured, predicted = meter.total, self.plan.activation_bytes
        pl_module.log_dict(
            {
                "auto_checkpoint/activation_bytes_predicted": float(predicted),
                "auto_checkpoint/activation_bytes_measured": float(measured),
                "auto_checkpoint/recompute_gflops": self.plan.extra_flops / 1e9,
            },
            on_step=True,
            on_epoch=False,
        )
        if abs(measured - predicted) > _TOLERANCE * max(predicted, 1):
            rank_zero_warn(
                f"AutoCheckpoint: the blocks held {format_bytes(measured)} for backward, the plan predicted "
                f"{format_bytes(predicted)} (more than {_TOLERANCE:.0%} apart). The blocks' inputs or behaviour "
                "may change between batches (variable sequence length?); pass a budget with more margin."
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
        self._needs_plan = self._needs_check = False
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
        if self._batch_stack is not None:
            self._batch_stack.close()
            self._batch_stack = None
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None
        if self._blocks:
            remove_checkpointing(pl_module)
        self._blocks = []
        self._module = None
