"""AutoCheckpoint: selective activation checkpointing planned under a memory limit.

The Lightning adapter of :class:`~lightning_memopt.checkpointing.auto.AutoCheckpointer` (which
``auto_checkpoint`` also uses outside Lightning): the hooks below say *when* each of its steps runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_memopt._checks import check_bool
from lightning_memopt.callbacks._hooks import ReleasingCallback, wrap_instance_hook
from lightning_memopt.callbacks._micro_batching import engine_of
from lightning_memopt.callbacks._output import info
from lightning_memopt.checkpointing import CostModel, NoPlanFitsError
from lightning_memopt.checkpointing.auto import AutoCheckpointer, NoBlockError
from lightning_memopt.checkpointing.ranks import gather_over_ranks, most_over_ranks
from lightning_memopt.checkpointing.shape_plans import step_signature

__all__ = ["AutoCheckpoint"]


class AutoCheckpoint(AutoCheckpointer, ReleasingCallback):
    """Checkpoint the model's repeated blocks: the least step time whose activations fit in memory.

    With no arguments its units are every stack of layers the forward runs (hybrid stacks too) and the
    stem before them (:func:`~lightning_memopt.checkpointing.find_blocks`); one that writes state keeps its
    activations, with a note. Where a memory limit is known (``max_memory``, or a CUDA device's capacity),
    it plans per unit among keep / op-level selective / pointwise modules / full / CPU offload, by the time
    each is measured to take, so that the step fits in ``max_memory * (1 - headroom)``. Where none is known
    (CPU), every unit is fully checkpointed, except where that lowers neither the bytes held nor the peak.

    Beside ``AutoAccumulation`` (probing for a size), the first batch's search decides whether to recompute
    at all: micro-batching is exact, so recomputation is worth only a faster step. The largest micro-batch
    that fits with every block kept is timed against the largest with every block recomputed; plain
    micro-batches win unless the larger ones make the optimizer step faster or nothing fits kept, and the
    plan is then made for the micro-batch that runs (``docs/micro_batching.md``, "One decision"). One line
    says what was decided.

    When (details on the docs page): installed after ``configure_model``, before the strategy wraps the
    model; profiled and planned after the first batch, whose successor is measured against the plan (a
    warning past 10%); under a limit, again after each batch larger than all planned ones (by shape:
    :class:`~lightning_memopt.checkpointing.shape_plans.ShapePlans`), which runs every block full; a resumed run
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

    Raises:
        ValueError: For a limit that is not a positive size or a fraction in (0, 1], an unknown mode,
            ``every_n < 1``, a limit with a forced mode, a bad headroom, ``blocks``, ``cost_model``,
            ``allow_offload`` or ``log`` of the wrong kind.
        MisconfigurationException: In ``setup``, for a fraction of an unknown capacity; after the first
            batch, for a limit too small for any plan (the message says what it must hold), or a forced
            ``mode`` that no block can take (each block's reason).

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
        head: Literal["auto", "chunked", "keep"] = "auto",
    ) -> None:
        options = dict(blocks=blocks, max_memory=max_memory, mode=mode, every_n=every_n, headroom=headroom)
        options.update(cost_model=cost_model, allow_offload=allow_offload, head=head)
        super().__init__(**options)
        check_bool("log", log)
        # Not `self.log`: Lightning sets `callback.log = pl_module.log` on every callback at fit start.
        self.log_metrics = log
        self._unwrap: Callable[[], None] | None = None  # undoes the configure_model wrapper

    def note(self, text: str) -> None:
        rank_zero_warn(text)

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
            return rank_zero_warn(
                "AutoCheckpoint: the strategy (FSDPStrategy's activation_checkpointing_policy) already "
                "checkpoints activations and AutoCheckpoint does nothing, so that blocks are not "
                "checkpointed twice. Remove one of the two."
            )
        try:
            self.prepare(strategy.root_device)
        except ValueError as err:
            raise MisconfigurationException(f"AutoCheckpoint: {err}") from err
        # An instance attribute, removed in teardown; Lightning calls it since it differs from the base hook.
        self._unwrap = wrap_instance_hook(
            pl_module, "configure_model", after=lambda: self._install(pl_module)
        )

    def _install(self, pl_module: pl.LightningModule) -> None:
        # Order (DESIGN.md): BatchNorm swap, checkpointing HERE (after configure_model, before precision and
        # DDP/FSDP wrapping), strategy.setup, micro-batching. Only the blocks' instance `forward` changes.
        why = self.install(pl_module)
        if why is not None:
            rank_zero_warn(why)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.active:
            return
        engine = engine_of(trainer)
        searching = engine is not None and (not engine.sizes.probed or engine.sizes.timing)
        if searching and self.mode == "auto" and self.plan.choices:
            # The first batch's search and its trial decide whether to recompute at all (batching/sizes.py:
            # decide); a run resumed during the trial goes on with it.
            engine.sizes.recompute = self
        if engine is not None:  # a later batch not one sample of which fits kept: recompute (sizes.failed)
            engine.sizes.fallback = self
        signature = step_signature(batch, None if engine is None else engine.peek(batch))
        self.start_step(
            signature, lambda flags: most_over_ranks(trainer.strategy, flags), batch, engine is not None
        )

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self.forward_done()  # measure the forward only: backward runs untracked

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx
    ) -> None:
        if not self.measuring:
            return
        engine = engine_of(trainer)  # profiled: the last (largest) micro-batch
        ran = step_signature(batch, engine.ran_size) if engine is not None else None
        try:
            outcome = self.finish_step(
                context=trainer.precision_plugin.forward_context,
                optimizers=trainer.optimizers,
                gather=lambda mine: gather_over_ranks(trainer.strategy, mine),
                signature=ran,
            )
        except (NoPlanFitsError, NoBlockError) as err:
            raise MisconfigurationException(f"AutoCheckpoint: {err}") from err
        for note in outcome.notes:
            rank_zero_warn(f"AutoCheckpoint: {note}")
        if outcome.planned is not None:
            info("AutoCheckpoint plan:\n" + outcome.planned.table())
        if outcome.metrics and self.log_metrics:
            metrics = {f"checkpoint/{k}": v for k, v in outcome.metrics.items()}
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        if outcome.gap is not None:
            rank_zero_warn(f"AutoCheckpoint: {outcome.gap}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.state()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.load_state(state_dict)

    @override
    def _release(self) -> None:
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None
        self.remove()
