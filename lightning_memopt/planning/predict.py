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

Sharding (``strategy="fsdp"``, Lightning's ``ModelParallelStrategy``) is run, not modeled: a copy of the
module is sharded by :func:`shard_module` (each block, then the top-level children), over a
process group of torch's ``fake`` backend (collectives move nothing), and the step of rank 0 is tracked;
it equals a real 2-process gloo run per rank, byte for byte (the tests check it). Modeled: DDP's gradient
buckets, one flat copy of all gradients (``gradient_as_bucket_view=False``, Lightning's default) alive
for the whole run, booked as ``other``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn

from lightning_memopt.batching.split import batch_size, micro_batch_sizes, split_batch
from lightning_memopt.checkpointing import apply_checkpointing, observe_saved, remove_checkpointing
from lightning_memopt.head.causal_lm import output_heads, take_over_heads
from lightning_memopt.memory import CATEGORIES, MemoryTracker
from lightning_memopt.memory.report import HEAD, PHASES, empty_record, fold_peak

__all__ = [
    "PRECISIONS",
    "StepPrediction",
    "predict_step",
    "precision_plugin",
    "precision_applied",
    "first_optimizer",
    "fake_process_group",
    "shard_module",
]

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")
Strategy = Literal["ddp", "fsdp"]
Head = Literal["own", "chunked"]
"""How a Hugging Face causal LM's loss is computed in the predicted step: by its own head (``"own"``), or
chunk by chunk (``"chunked"``, :func:`~lightning_memopt.head.causal_lm.take_over_heads`)."""
HEADS: tuple[str, ...] = get_args(Head)


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
        """``{phase: {"peak": bytes, category: bytes, ..., "head": bytes}}`` (``head`` where counted)."""
        figures = (*CATEGORIES, HEAD) if f"{PHASES[0]}_{HEAD}" in self.record else CATEGORIES
        return {p: {"peak": self.record[p], **{c: self.record[f"{p}_{c}"] for c in figures}} for p in PHASES}

    @property
    def categories(self) -> dict[str, int]:
        """Bytes per category at the step's peak."""
        return {c: self.record[f"{self.peak_phase}_{c}"] for c in CATEGORIES}

    @property
    def head_bytes(self) -> int | None:
        """Of the step's peak, the bytes the output head made (a part of ``activations`` and ``other``;
        :class:`~lightning_memopt.memory.MemoryTracker`), or None where no head was counted."""
        return self.record.get(f"{self.peak_phase}_{HEAD}")


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
    """One step in Lightning's order; ``batch`` is a list of micro-batches when micro-batching."""
    with tracker:
        tracker.reset_peak()
        if isinstance(batch, _MicroBatches):
            loss = _micro_batched_forward(module, optimizer, batch, plugin, record, tracker)
        else:
            with plugin.forward_context():
                loss = _loss(module.training_step(batch, 0))
            # Lightning's order: zero_grad after training_step, so the last step's gradients are alive
            # during this forward.
            optimizer.zero_grad(set_to_none=True)
        fold_peak(record, "forward", tracker.peak, tracker.peak_figures)
        tracker.reset_peak()
        loss.backward()
        del loss
        fold_peak(record, "backward", tracker.peak, tracker.peak_figures)
        tracker.reset_peak()
        optimizer.step()
        fold_peak(record, "optimizer", tracker.peak, tracker.peak_figures)


class _MicroBatches(list):
    """The micro-batches of one step (a list that is never itself a batch)."""


def _micro_batched_forward(
    module, optimizer, micro_batches: _MicroBatches, plugin, record, tracker
) -> torch.Tensor:
    """What ``AutoAccumulation``'s engine does inside ``training_step``: gradients zeroed first, then each
    micro-batch forward and backward (loss weighted by its share of the samples), gradients accumulating;
    it returns the batch's loss, detached, as a fresh tensor that requires grad (Lightning's backward of
    it is a no-op). Only the first micro-batch and the last, the largest (:func:`~lightning_memopt.batching.
    split.micro_batch_sizes` puts the larger last), run: every other repeats the last's memory or less, with
    the gradients alive (3 + 3 + 4: the 4's). Each micro-batch's backward is filed under backward, where it
    runs (as ``MemoryMonitor`` files it: :func:`~lightning_memopt.memory.phases.running`)."""
    optimizer.zero_grad(set_to_none=True)
    sizes = [batch_size(mb) for mb in micro_batches]
    total = torch.zeros(())
    ran = [0, len(micro_batches) - 1] if len(micro_batches) > 1 else [0]
    for mb, size in ((micro_batches[i], sizes[i]) for i in ran):
        with plugin.forward_context():
            loss = _loss(module.training_step(mb, 0))
        fold_peak(record, "forward", tracker.peak, tracker.peak_figures)
        tracker.reset_peak()
        (loss * (size / sum(sizes))).backward()
        total = total + loss.detach() * (size / sum(sizes))
        del loss
        fold_peak(record, "backward", tracker.peak, tracker.peak_figures)
        tracker.reset_peak()
    return total.requires_grad_(True)


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
    fresh: Callable[[], nn.Module] | None = None,
    head: Head | None = None,
) -> StepPrediction:
    """Peak memory of one training step of ``module`` on ``batch``, per phase and category, per rank.

    Args:
        module: A LightningModule (or any module with ``training_step`` and ``configure_optimizers``), on
            fake tensors for a prediction or real ones for a measurement. Left as it was.
        batch: One full training batch (what the DataLoader yields on one rank).
        precision: Lightning's precision flag (``32-true``, ``bf16-mixed``, ``bf16-true``, ``16-true``).
        micro_batch_size: Run the step as ``AutoAccumulation(micro_batch_size=...)`` does: micro-batches
            (views of the batch) forward and backward inside ``training_step``, gradients accumulating.
        checkpoint: Block name to treatment (``keep``/``selective``/``full``), applied for the step.
        world_size: Ranks the run uses; with ``strategy="fsdp"`` the module is sharded over them.
        strategy: ``"ddp"`` (replicated) or ``"fsdp"`` (``ModelParallelStrategy`` with ``fully_shard``).
        blocks: The blocks ``fully_shard`` wraps one by one before the root (``find_blocks`` gives them;
            default: only the root).
        optimizer_fn: Makes the optimizer (default: ``module.configure_optimizers``).
        fresh: Builds a new copy of ``module`` (on fake tensors), to be sharded: ``fully_shard`` changes a
            module for good. Required with ``strategy="fsdp"`` and ``world_size > 1``. (Not
            ``copy.deepcopy``: deep-copying a fake module that has run a step can crash the interpreter.)
        head: Count the output head's bytes (``<phase>_head`` in the record, :attr:`StepPrediction.head_bytes`)
            of the Hugging Face causal LMs in the module, computing their loss as :data:`Head` says;
            ``"chunked"`` takes them over for the step (without the first call's comparison with their
            own loss, which needs values) and puts them back. Default None: no head line, heads as built.

    Returns:
        A :class:`StepPrediction`.

    Raises:
        ValueError: For an unknown precision, strategy or head, or a micro-batch size out of range.
        RuntimeError: With ``head="chunked"``, if the module holds no causal LM whose head can be taken.

    Example::

        >>> from torch._subclasses.fake_tensor import FakeTensorMode  # doctest: +SKIP
        >>> with FakeTensorMode(): model, batch = MyModule(), torch.zeros(8, 512, dtype=torch.long)  # doctest: +SKIP
        >>> predict_step(model, batch, precision="bf16-mixed").peak_bytes  # doctest: +SKIP
    """
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    if head is not None and head not in HEADS:
        raise ValueError(f"head must be one of {HEADS} or None, got {head!r}")
    if strategy == "fsdp" and world_size > 1 and fresh is None:
        raise ValueError(
            "strategy='fsdp' needs fresh=: a callable that builds the module again, to be sharded"
        )
    plugin = precision_plugin(precision)
    if micro_batch_size is not None:
        total = batch_size(batch)
        if not 1 <= micro_batch_size <= total:
            raise ValueError(
                f"micro_batch_size must be in [1, {total}] (the batch size), got {micro_batch_size!r}"
            )
        if micro_batch_size < total:
            batch = _MicroBatches(split_batch(batch, micro_batch_sizes(total, micro_batch_size)))
    if strategy == "fsdp" and world_size > 1:
        with fake_process_group(world_size) as mesh:
            # fully_shard changes the module for good: shard a copy (the copy costs nothing on fake tensors).
            # Precision first, as Lightning converts the module before the strategy wraps it.
            sharded = fresh()
            with precision_applied(sharded, plugin):
                shard_module(sharded, [b for _, b in _same_blocks(sharded, module, blocks or [])], mesh)
                record = _measure(sharded, batch, plugin, checkpoint, optimizer_fn, head)
        return StepPrediction(record)
    with precision_applied(module, plugin):
        prediction = StepPrediction(_measure(module, batch, plugin, checkpoint, optimizer_fn, head))
        if world_size > 1:
            _add_ddp_buckets(prediction, module)  # in the run's precision: the buckets are gradient-typed
    return prediction


def _measure(module, batch, plugin, checkpoint, optimizer_fn, head=None) -> dict[str, int]:
    """One tracked step of ``module`` (already in its precision), leaving its gradients and mode as they were."""
    was_training = module.training
    module.train()
    grads = [(p, p.grad) for p in module.parameters()]
    try:
        with _checkpointed(module, checkpoint), _head_taken(module, head):
            optimizer = first_optimizer((optimizer_fn or module.configure_optimizers)())
            heads = output_heads(module) if head is not None else []
            tracker = MemoryTracker(module, optimizer, heads=heads)
            record = empty_record(1, PHASES, head=head is not None)
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
    return record


def _same_blocks(copy_: nn.Module, original: nn.Module, blocks) -> list[tuple[str, nn.Module]]:
    """The blocks of ``copy_`` with the names of ``blocks`` (found on ``original``)."""
    modules = dict(copy_.named_modules())
    return [(name, modules[name]) for name, _ in blocks]


def shard_module(module: nn.Module, blocks: list[nn.Module], mesh) -> None:
    """FSDP2 the way the planner assumes a user's ``configure_model`` does it.

    ``fully_shard`` on each block, then on each direct child of ``module`` that holds parameters outside
    the blocks (a Hugging Face model inside a LightningModule, an embedding, a head), then on ``module``
    itself only if it holds parameters directly. Children, not the LightningModule: ``training_step``
    calls the children, so their forward hooks (which gather the parameters) run; the LightningModule's
    own ``forward`` may never be called.
    """
    from torch.distributed.fsdp import fully_shard

    # By module, not parameter: fully_shard replaces a block's parameters with new (DTensor) ones.
    in_blocks = {id(m) for b in blocks for m in b.modules()}

    def holds_own(child: nn.Module) -> bool:
        return any(
            p is not None for m in child.modules() if id(m) not in in_blocks for p in m._parameters.values()
        )

    for block in blocks:
        fully_shard(block, mesh=mesh)
    for child in module.children():
        if holds_own(child):
            fully_shard(child, mesh=mesh)
    if any(p is not None for p in module._parameters.values()):
        fully_shard(module, mesh=mesh)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """A ``world_size``-rank process group whose collectives move nothing (torch's ``fake`` backend), and
    its 1-D device mesh; this process is rank 0. What FSDP2 allocates per rank is then exactly what a real
    run allocates (the tests compare with a 2-process gloo run).

    Raises:
        RuntimeError: If a process group already exists (plan in a fresh process).
    """
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's own tool for this

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized; predict FSDP sharding in a fresh process")
    with unset_fake_temporarily():  # the mesh reads real tensors
        dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (world_size,))
        except BaseException:
            dist.destroy_process_group()
            raise
    try:
        yield mesh
    finally:
        dist.destroy_process_group()


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


@contextlib.contextmanager
def _head_taken(module: nn.Module, head: str | None):
    if head != "chunked":
        yield
        return
    undo = take_over_heads(module, "chunked", note=lambda _: None, verify=False)  # strict: never a note
    try:
        yield
    finally:
        undo()


def _add_ddp_buckets(prediction: StepPrediction, module: nn.Module) -> None:
    """DDP's reducer holds one flat copy of every gradient for the whole run (``gradient_as_bucket_view``
    is off in Lightning's DDPStrategy): modeled, booked as ``other`` in every phase."""
    buckets = sum(p.numel() * p.element_size() for p in dict.fromkeys(module.parameters()) if p.requires_grad)
    for phase in PHASES:
        prediction.record[phase] += buckets
        prediction.record[f"{phase}_other"] += buckets
    prediction.modeled.append("DDP gradient buckets: one flat copy of the gradients, as other, every phase")
