"""Predict one training step's memory: peak bytes per phase and per category, per rank.

The step runs as Lightning runs it (``training_step`` in the precision plugin's forward context,
``zero_grad`` after it, ``backward``, ``optimizer.step``) under a
:class:`~lightning_memopt.memory.MemoryTracker`. On fake tensors nothing is allocated and the numbers
are the ones a real run on the CPU measures, byte for byte (the tests check it); on real tensors the same
function is a measurement. The measured step starts from the state a previous step leaves behind: every
trainable parameter has a gradient (in Lightning's order the previous step's gradients are alive during
the next forward) and the optimizer state exists; it is made by an optimizer step on zero gradients,
not by a whole training step (half the time on a 7B model; a parameter that gets no gradient in a real
step would be counted with gradient and state here).

What is modeled rather than run (the docs give each formula):

- sharding over ``world_size`` ranks (FSDP2 ``fully_shard`` per block): every parameter is split along
  dim 0 into ``ceil(d0 / N)`` rows per rank (padded), gradients and optimizer state follow their
  parameter; during forward and backward the two largest blocks are held unsharded (the current one and
  the prefetched next); buffers are replicated.
- DDP: the reducer's gradient buckets, one flat copy of all gradients (``gradient_as_bucket_view=False``,
  Lightning's default), alive for the whole run, booked as ``other``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from lightning_memopt.batching.split import batch_size, micro_batch_sizes, split_batch
from lightning_memopt.checkpointing import apply_checkpointing, observe_saved, remove_checkpointing
from lightning_memopt.memory import CATEGORIES, MemoryTracker
from lightning_memopt.memory.report import PHASES, empty_record, fold_peak

__all__ = [
    "PRECISIONS",
    "StepPrediction",
    "predict_step",
    "precision_plugin",
    "precision_applied",
    "first_optimizer",
    "shard",
]

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")
Strategy = Literal["ddp", "fsdp"]


@dataclass
class StepPrediction:
    """Peak bytes of one training step on one rank, by phase and by category at each phase's peak."""

    record: dict[str, int]
    """A :mod:`lightning_memopt.memory.report` record: ``forward``, ``forward_parameters``, ... bytes."""
    modeled: list[str] = field(default_factory=list)
    """What was modeled instead of run (sharding, DDP buckets); empty when every byte was counted."""

    @property
    def peak_bytes(self) -> int:
        """The step's peak: the largest phase peak."""
        return max(self.record[p] for p in PHASES)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=lambda p: self.record[p])

    @property
    def phases(self) -> dict[str, dict[str, int]]:
        """``{phase: {"peak": bytes, category: bytes, ...}}``."""
        return {
            p: {"peak": self.record[p], **{c: self.record[f"{p}_{c}"] for c in CATEGORIES}} for p in PHASES
        }

    @property
    def categories(self) -> dict[str, int]:
        """Bytes per category at the step's peak."""
        return {c: self.record[f"{self.peak_phase}_{c}"] for c in CATEGORIES}


def precision_plugin(precision: str, device_type: str = "cpu"):
    """Lightning's precision plugin for ``precision`` (the one the Trainer would build).

    Raises:
        ValueError: For a precision this planner does not support.
    """
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    if precision in ("32-true", "32"):
        return Precision()
    if precision == "bf16-mixed":
        return MixedPrecision("bf16-mixed", device=device_type)
    if precision in ("bf16-true", "16-true"):
        return HalfPrecision(precision)
    raise ValueError(
        f"precision {precision!r} is not supported by the planner; use one of {PRECISIONS} (16-mixed's "
        "GradScaler is not modeled: plan with bf16-mixed, whose memory is the same up to the scaler)"
    )


def first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The first optimizer out of anything ``configure_optimizers`` may return."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return first_optimizer(configured[0])
    raise TypeError(
        f"cannot find an optimizer in what configure_optimizers returned: {configured!r}; return an "
        "optimizer, a list of them, or a dict with an 'optimizer' key"
    )


def _loss(output: Any) -> torch.Tensor:
    return output["loss"] if isinstance(output, dict) else output


@contextlib.contextmanager
def precision_applied(module: nn.Module, plugin) -> Any:
    """The module converted by the precision plugin (bf16-true), restored to its dtypes afterwards."""
    dtypes = [(t, t.dtype) for t in [*module.parameters(), *module.buffers()]]
    target = getattr(plugin, "_desired_input_dtype", None)
    if target is not None:
        # What HalfPrecision.convert_module's ``module.to(dtype)`` does, tensor by tensor: ``module.to``
        # swaps fake tensors, which fails while a weak reference (the fake mode's memo) points at one.
        for t, dtype in dtypes:
            if dtype.is_floating_point:
                t.data = t.data.to(target)
    try:
        yield
    finally:
        for t, dtype in dtypes:
            if t.dtype != dtype:
                t.data = t.data.to(dtype)


def _warm_up(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Bring the step's starting state about as a first training step would, at a fraction of its cost:
    every trainable parameter has a gradient (zeros) and the optimizer has stepped once (its state exists).
    Only the state matters here, never the values (the step is not the one being measured)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()


def _run_step(module, optimizer, batch, plugin, record, tracker) -> None:
    with tracker:
        tracker.reset_peak()
        with plugin.forward_context():
            loss = _loss(module.training_step(batch, 0))
        # Lightning's order: zero_grad after training_step, so the last step's gradients are alive
        # during this forward.
        optimizer.zero_grad(set_to_none=True)
        fold_peak(record, "forward", tracker.peak, tracker.peak_breakdown)
        tracker.reset_peak()
        loss.backward()
        del loss
        fold_peak(record, "backward", tracker.peak, tracker.peak_breakdown)
        tracker.reset_peak()
        optimizer.step()
        fold_peak(record, "optimizer", tracker.peak, tracker.peak_breakdown)


def predict_step(
    module: nn.Module,
    batch: Any,
    *,
    precision: str = "32-true",
    micro_batch_size: int | None = None,
    checkpoint: dict[str, str] | None = None,
    world_size: int = 1,
    strategy: Strategy = "ddp",
    blocks: list[tuple[str, nn.Module]] | None = None,
    optimizer_fn: Callable[[], Any] | None = None,
) -> StepPrediction:
    """Peak memory of one training step of ``module`` on ``batch``, per phase and category, per rank.

    Args:
        module: A LightningModule (or any module with ``training_step`` and ``configure_optimizers``), on
            fake tensors for a prediction or real ones for a measurement. Left as it was.
        batch: One full training batch (what the DataLoader yields on one rank).
        precision: Lightning's precision flag (``32-true``, ``bf16-mixed``, ``bf16-true``, ``16-true``).
        micro_batch_size: Run the step as ``AutoAccumulation(micro_batch_size=...)`` does: the largest
            micro-batch (a view of the batch) with the previous micro-batch's gradients alive.
        checkpoint: Block name to treatment (``keep``/``selective``/``full``), applied for the step.
        world_size: Ranks the run uses; with ``strategy="fsdp"`` parameters, gradients and optimizer
            state are sharded over them (modeled, see the module docstring).
        strategy: ``"ddp"`` (replicated) or ``"fsdp"`` (``ModelParallelStrategy`` with ``fully_shard``).
        blocks: The blocks FSDP wraps one by one (default: none, only the root; ``find_blocks`` gives them).
        optimizer_fn: Makes the optimizer (default: ``module.configure_optimizers``).

    Returns:
        A :class:`StepPrediction`.

    Raises:
        ValueError: For an unknown precision or strategy, or a micro-batch size out of range.

    Example::

        >>> from torch._subclasses.fake_tensor import FakeTensorMode  # doctest: +SKIP
        >>> with FakeTensorMode(): model, batch = MyModule(), torch.zeros(8, 512, dtype=torch.long)  # doctest: +SKIP
        >>> predict_step(model, batch, precision="bf16-mixed").peak_bytes  # doctest: +SKIP
    """
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    plugin = precision_plugin(precision)
    if micro_batch_size is not None:
        total = batch_size(batch)
        if not 1 <= micro_batch_size <= total:
            raise ValueError(
                f"micro_batch_size must be in [1, {total}] (the batch size), got {micro_batch_size!r}"
            )
        batch = split_batch(batch, micro_batch_sizes(total, micro_batch_size))[0]
    was_training = module.training
    module.train()
    grads = [(p, p.grad) for p in module.parameters()]
    try:
        with precision_applied(module, plugin), _checkpointed(module, checkpoint):
            optimizer = first_optimizer((optimizer_fn or module.configure_optimizers)())
            tracker = MemoryTracker(module, optimizer)
            record = empty_record(1, PHASES)
            with warnings.catch_warnings(), observe_saved(_mark_cached(tracker)):
                # training_step's self.log warns when no Trainer is attached: expected here.
                warnings.filterwarnings("ignore", message=".*self.log.*")
                _warm_up(module, optimizer)
                _run_step(module, optimizer, batch, plugin, record, tracker)
            del optimizer, tracker
    finally:
        for p, g in grads:
            p.grad = g
        module.train(was_training)
    prediction = StepPrediction(record)
    if world_size > 1:
        _distribute(prediction, module, world_size, strategy, blocks or [])
    return prediction


def _mark_cached(tracker: MemoryTracker) -> Callable[[str, torch.Tensor], None]:
    # Tensors cached by selective checkpointing bypass saved-tensor hooks: mark them as activations.
    def seen(kind: str, t: torch.Tensor) -> None:
        if kind == "cached":
            tracker.mark(t, "activations")

    return seen


@contextlib.contextmanager
def _checkpointed(module: nn.Module, checkpoint: dict[str, str] | None):
    if not checkpoint:
        yield
        return
    apply_checkpointing(module, checkpoint)
    try:
        yield
    finally:
        remove_checkpointing(module)


def shard(numel_rows: int, row_bytes: int, world_size: int) -> int:
    """Bytes one rank holds of a parameter of ``numel_rows`` dim-0 rows: ``ceil(rows / N)`` rows (padded)."""
    return math.ceil(numel_rows / world_size) * row_bytes


def _param_shard_bytes(params: list[nn.Parameter], world_size: int) -> tuple[int, int]:
    full = sharded = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        rows = p.shape[0] if p.dim() else 1
        full += nbytes
        sharded += shard(rows, nbytes // max(rows, 1), world_size)
    return full, sharded


def _distribute(prediction: StepPrediction, module, world_size: int, strategy: Strategy, blocks) -> None:
    """Turn a single-device prediction into a per-rank one (see the module docstring)."""
    rec = prediction.record
    params = list(dict.fromkeys(module.parameters()))
    trainable = [p for p in params if p.requires_grad]
    if strategy == "ddp":
        buckets = sum(p.numel() * p.element_size() for p in trainable)
        for phase in PHASES:
            rec[phase] += buckets
            rec[f"{phase}_other"] += buckets
        prediction.modeled.append(f"DDP gradient buckets: {buckets} bytes (other), every phase")
        return
    full, sharded = _param_shard_bytes(params, world_size)
    full_t, sharded_t = _param_shard_bytes(trainable, world_size)
    ratio = sharded_t / full_t if full_t else 1.0
    unsharded = sorted(
        (sum(p.numel() * p.element_size() for p in b.parameters()) for _, b in blocks), reverse=True
    )
    # Blocks are gathered one at a time with the next one prefetched; without blocks the root holds all.
    gathered = sum(unsharded[:2]) if unsharded else full
    for phase in PHASES:
        saved_params = full - sharded
        extra = gathered if phase in ("forward", "backward") else 0
        new_params = rec[f"{phase}_parameters"] - saved_params + extra
        new_grads = round(rec[f"{phase}_gradients"] * ratio)
        new_state = round(rec[f"{phase}_optimizer_state"] * ratio)
        delta = (
            (new_params - rec[f"{phase}_parameters"])
            + (new_grads - rec[f"{phase}_gradients"])
            + (new_state - rec[f"{phase}_optimizer_state"])
        )
        rec[f"{phase}_parameters"], rec[f"{phase}_gradients"] = new_params, new_grads
        rec[f"{phase}_optimizer_state"] = new_state
        rec[phase] += delta
    prediction.modeled.append(
        f"FSDP sharding over {world_size} ranks: parameters {full} -> {sharded} bytes per rank, "
        f"{gathered} bytes gathered unsharded in forward/backward"
    )
