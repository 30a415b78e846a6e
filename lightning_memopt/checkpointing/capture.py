"""A block's inputs from one forward of the model: what each block is profiled on.

:func:`record_block_inputs` records them around a forward the caller runs (a real training step, under
``AutoCheckpoint``); :func:`capture_block_inputs` runs the model once for them, keeping nothing else.
Either way each block's inputs are kept detached, with what the profile needs to know about them: whether
the block chains to the one before, which inputs an earlier block or an op outside the blocks already
holds, and which required grad.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_memopt._compat import in_backward
from lightning_memopt._replay import is_replaying
from lightning_memopt._tree import tensors
from lightning_memopt.checkpointing.calls import storage_key, without_cache

__all__ = ["BlockInputs", "capture_block_inputs", "record_block_inputs"]


@dataclass
class BlockInputs:
    """A block's inputs from one forward of the model, detached, and whether it chains to the last."""

    args: tuple
    kwargs: dict
    chained: bool
    input_held: bool = False
    shared: tuple[int, ...] = ()
    """Positions (in ``tensors((args, kwargs))`` order, the primary input excluded) of inputs that an
    earlier block also took, or that autograd already holds (an attention mask, T5's position bias, an
    encoder's output fed to every decoder block): held once, they are counted in the first block only."""
    grad_inputs: tuple[int, ...] | None = None
    """Positions (in ``tensors((args, kwargs))`` order) of inputs that required grad in the model's
    forward; None where unknown (captured without gradients): then every floating-point input does. A
    stem's input (the batch) needs none, and autograd saves less when it does not."""
    same_shape: bool = True
    """Whether the block's primary output had the shape of its primary input (a layer of a stack maps the
    hidden state to the hidden state: ``find_blocks``' rule 6)."""


def _detach(value):
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value)


@contextlib.contextmanager
def record_block_inputs(
    blocks: Iterable[tuple[str, nn.Module]], is_held: Callable[[torch.Tensor], bool] | None = None
) -> Iterator[dict[str, BlockInputs]]:
    """Keep each block's inputs (detached) from the forwards run while entered; yields the dict it fills.

    The last forward call of each block is kept, never a recomputation in backward nor a replay
    (:mod:`lightning_memopt._replay`): when a micro-batching engine runs probes, then the real
    micro-batches, then its one-time check in one step, the profile is of the micro-batch size that
    training uses. ``is_held(tensor)`` tells whether
    autograd already holds a tensor (used for a block's input that is not the previous block's output).
    Used by :func:`capture_block_inputs` and, around a real training step, by ``AutoCheckpoint``.
    """
    captured: dict[str, BlockInputs] = {}
    last_output: list[torch.Tensor | None] = [None]  # a reference, so its storage key cannot be reused
    taken: set[int | None] = set()  # storages of inputs taken by earlier blocks (referenced in `captured`)

    def pre_hook(name):
        def hook(module, a, kw):
            if not in_backward() and not is_replaying():
                first = next(iter(tensors((a, kw))), None)
                last = last_output[0]
                chained = first is not None and last is not None and storage_key(first) == storage_key(last)
                held = first is not None and not chained and is_held is not None and is_held(first)
                # Without the key/value cache: the block runs again on these inputs, and a cache would grow.
                a, kw = without_cache(module, a, kw)
                others = list(enumerate(tensors((a, kw))))[1:]
                shared = tuple(
                    i for i, t in others if storage_key(t) in taken or (is_held is not None and is_held(t))
                )
                taken.update(storage_key(t) for _, t in others)
                grads = None  # under no_grad nothing requires grad: profile as if every input did
                if torch.is_grad_enabled():
                    grads = tuple(i for i, t in enumerate(tensors((a, kw))) if t.requires_grad)
                captured[name] = BlockInputs(_detach(a), _detach(kw), chained, held, shared, grads)

        return hook

    def post_hook(name):
        def hook(module, a, kw, out):
            if not in_backward() and not is_replaying():
                last_output[0] = first = next(iter(tensors(out)), None)
                primary = next(iter(tensors((a, kw))), None)
                if name in captured and first is not None and primary is not None:
                    captured[name].same_shape = first.shape == primary.shape

        return hook

    handles = []
    for name, block in blocks:
        handles.append(block.register_forward_pre_hook(pre_hook(name), with_kwargs=True))
        handles.append(block.register_forward_hook(post_hook(name), with_kwargs=True))
    try:
        yield captured
    finally:
        last_output[0] = None
        for h in handles:
            h.remove()


def capture_block_inputs(
    model: nn.Module,
    blocks: Iterable[tuple[str, nn.Module]],
    *args,
    context: Callable[[], contextlib.AbstractContextManager] | None = None,
    **kwargs,
) -> dict[str, BlockInputs]:
    """Run ``model(*args, **kwargs)`` once and keep each block's inputs (detached).

    ``context`` (e.g. an autocast) is entered around the run. The global RNG state and the model's
    buffers are as they were afterwards.
    """
    blocks = list(blocks)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    # Autograd records the graph but the blocks' saved tensors are dropped (pack returns nothing): memory
    # as without gradients plus what ops outside the blocks save, and we learn which storages those hold.
    # Outside ops' saved tensors stay referenced for the run: a freed storage's key could be reused.
    held: dict[int | None, torch.Tensor] = {}
    depth = [0]

    def pack(t):
        if depth[0] == 0:
            held[storage_key(t)] = t

    def enter(*_):
        depth[0] += 1

    def leave(*_):
        depth[0] -= 1

    handles = [
        h for _, b in blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))
    ]
    try:
        # Leave no trace: RNG and buffers (BatchNorm statistics) are restored after the run.
        with (
            record_block_inputs(blocks, lambda t: storage_key(t) in held) as captured,
            torch.random.fork_rng(devices=[]),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None),
            (context or contextlib.nullcontext)(),
        ):
            model(*args, **kwargs)
    finally:
        held.clear()
        for h in handles:
            h.remove()
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return captured
