"""Whether a split step gives the unsplit gradient: the one-time check, and the causes when it does not.

What the check runs, what it costs and the tolerances: ``docs/micro_batching.md``, "Exact by verification".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_memopt._patch import patch
from lightning_memopt._text import listed
from lightning_memopt.batching.state import host_copy, local_tensor
from lightning_memopt.memory.tracker import optimizer_state_to_come, tensor_bytes

__all__ = [
    "batchnorms",
    "causes",
    "difference",
    "gradients",
    "no_dropout",
    "norms",
    "tolerance",
    "written_in_place",
]

_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


@contextlib.contextmanager
def no_dropout() -> Iterator[None]:
    """Run every dropout as the identity (and attention's ``dropout_p`` as 0) inside the ``with`` block.

    The functions of ``torch.nn.functional`` are replaced for the block's duration, not intercepted by a
    mode: an activation checkpoint recomputes its forward in backward outside any ``TorchFunctionMode``,
    and a recomputation that dropped where the forward did not would not match it.
    """
    undo = [patch(F, name, lambda original, input, *args, **kwargs: input) for name in _DROPOUTS]

    def attention(original, query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return original(query, key, value, attn_mask, 0.0, *args, **kwargs)

    undo.append(patch(F, "scaled_dot_product_attention", attention))
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def gradients(module: torch.nn.Module, on_device: bool = False) -> list[torch.Tensor | None]:
    """Copies of every parameter's gradient (a DTensor's local shard's): in host memory, so that the check
    needs no device memory, or, ``on_device``, beside them (where there is room: :func:`room_for_gradients`)."""
    if on_device:
        return [
            None if p.grad is None else local_tensor(p.grad).detach().clone() for p in module.parameters()
        ]
    return [None if p.grad is None else host_copy(p.grad) for p in module.parameters()]


def room_for_gradients(
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    device: torch.device,
    to_come: int | None,
) -> bool:
    """Whether a copy of the step's gradients fits on ``device`` during the check: on CUDA (a host copy of
    a 1.3B model's gradients took 3 s on an H200), before the optimizers' first step, where the state that
    step creates (``to_come`` bytes: measured by the size search, else by
    :func:`~lightning_memopt.memory.tracker.optimizer_state_to_come`; AdamW's is twice the parameters),
    which every later micro-batch holds beside its own peak, is at least the gradients' bytes. Elsewhere
    (a CPU, whose memory the host copy takes alike; a simulated device, which counts only the device's)
    the copy is the host's."""
    if device.type != "cuda" or any(o.state for o in optimizers):
        return False
    grads = tensor_bytes(local_tensor(p.grad) for p in module.parameters() if p.grad is not None)
    return (optimizer_state_to_come(optimizers) if to_come is None else to_come) >= grads


def norms(module: torch.nn.Module) -> list[float | None]:
    """Every parameter's gradient's 2-norm (a DTensor's local shard's) in float64, computed where the
    gradient is; None where it has none."""
    with torch.no_grad():
        return [
            None
            if p.grad is None
            else torch.linalg.vector_norm(local_tensor(p.grad), dtype=torch.float64).item()
            for p in module.parameters()
        ]


def difference(a: list[float | None], gap: list[float | None], floor: float = 0.1) -> float:
    """The largest relative difference between two runs' gradients ``a`` and ``b``, parameter by parameter,
    from the 2-norms of ``a`` and of ``a - b`` (:func:`norms`; None: no gradient, zeros):
    ``|a - b| / (2 |a| + |a - b|)``, 0 where both are zero. The check computes ``a - b`` where the gradients
    are, by running the second split's backward with its loss negated on top of ``a``: no copy of either.

    A gradient whose scale is under ``floor`` of the largest is measured against that fraction instead
    (:func:`tolerance` gives it by precision): one that is zero in exact arithmetic (a key projection's bias,
    which softmax cancels) is rounding alone, and one whose terms cancel (a LayerNorm's bias, a sum over
    every token) is rounded as its terms are; relative to itself that rounding would read as a different
    gradient.
    """
    pairs = [(d or 0.0, 2 * (x or 0.0) + (d or 0.0)) for x, d in zip(a, gap, strict=True)]
    least = floor * max((scale for _, scale in pairs), default=0.0)
    return max((d / max(scale, least) for d, scale in pairs if scale > 0), default=0.0)


def tolerance(module: torch.nn.Module, mixed: bool, loss: torch.dtype | None = None) -> tuple[float, float]:
    """How far two exact splits may differ by rounding, and the floor of :func:`difference`: by the least
    precise of the gradients' dtypes and the ``loss``'s (a float64 model whose loss is computed in float32,
    as Hugging Face's losses upcast to float32, carries float32 rounding); ``mixed``: autocast.

    The floor is a tenth of the largest gradient in float32 and float64 (in float32 a bar of 1e-6 of the
    largest, about ten of its ulps), the whole of it in half precision, where every gradient is measured
    against the largest: a tenth bars 2e-3 of it there, one bfloat16 half-ulp, and under ``bf16-mixed``
    Swin's patch-embedding LayerNorm bias (6% of the largest gradient, a sum over every token) read 7.7% of
    that tenth between a micro-batch of 8 and two of 4 (7e-9 in float32); against the largest, 0.8%. A
    split that changes the step still reads far above the bar: weighed by samples where the loss is a
    token mean, 3.3% (a toy model) and 24% (Llama).
    """
    dtypes = {p.dtype for p in module.parameters() if p.requires_grad} | (
        {loss} if loss is not None else set()
    )
    if mixed or dtypes & {torch.float16, torch.bfloat16}:
        return 2e-2, 1.0
    if dtypes == {torch.float64}:
        return 1e-9, 0.1
    return 1e-5, 0.1


def batchnorms(module: torch.nn.Module) -> list[str]:
    """Names of the BatchNorm layers that normalize by the statistics of their input (training mode)."""
    return [
        name or type(m).__name__
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm) and (m.training or not m.track_running_stats)
    ]


@contextlib.contextmanager
def written_in_place(module: torch.nn.Module) -> Iterator[list[str]]:
    """Names of the parameters and buffers of ``module`` written inside the ``with`` block, BatchNorm
    statistics excepted (:func:`batchnorms` names those).

    Parameters by their version counters (nothing but the user writes a parameter during a step);
    buffers by their values, since DDP writes its rank-0 buffers into every rank's before a forward.
    """
    statistics = {
        id(b) for m in module.modules() if isinstance(m, _BatchNorm) for b in m.buffers(recurse=False)
    }
    params = [(name, p, p._version) for name, p in module.named_parameters()]
    buffers = [(name, b, b.detach().clone()) for name, b in module.named_buffers() if id(b) not in statistics]
    written: list[str] = []
    try:
        yield written
    finally:
        written += [name for name, p, version in params if p._version != version]
        written += [name for name, b, saved in buffers if not torch.equal(b, saved)]


def causes(*, batchnorm: list[str], written: list[str], unexplained: bool, drawn: bool = False) -> str:
    """Why a split step differs from another split of the same batch, and what to do: from what it showed."""
    found = []
    if batchnorm:
        found.append(
            f"BatchNorm layers ({listed(batchnorm)}) normalize each micro-batch by its own statistics; add "
            "lightning_memopt.BatchNormToGroupNorm() to the callbacks (GroupNorm does not depend on the batch)"
        )
    if written:
        found.append(
            f"training_step writes {listed(written)} in place, so the write happens once per micro-batch (and "
            "again when a step is retried) instead of once per step; move it to on_train_batch_end or "
            "on_before_optimizer_step"
        )
    if unexplained:
        found.append(
            "the loss it returns is not explained by the torch loss functions it calls, so micro-batches are "
            "weighed by samples; pass count_fn=... (the number of items the loss averages over in a "
            "micro-batch, or 'sum' for a loss that is a sum)"
        )
    if drawn and not found:
        found.append(
            "training_step draws random numbers besides dropout's (LayerDrop, noise, random masks), and each "
            "micro-batch draws its own where the whole batch drew once; turn that randomness off, or draw "
            "it once per batch (in the DataLoader's collate function), to train as the unsplit batch would"
        )
    if not found:
        found.append(
            "its gradient depends on how the batch is split: the loss couples the samples of a batch (in-batch "
            "negatives, a load-balancing term) or is not a mean or sum over them; accumulate over fewer, larger "
            "micro-batches or compute that term over the whole batch yourself"
        )
    return "; and ".join(found)
