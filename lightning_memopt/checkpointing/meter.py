"""The bytes each block makes autograd hold during a real forward, and what is held outside the blocks.

:class:`ActivationMeter` attributes a :class:`~lightning_memopt.memory.MemoryTracker`'s activations to
the blocks as they run; :class:`ForwardProbe` wraps one training step's forward with it (and, asked, records
each block's inputs for profiling: ``capture.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from lightning_memopt._compat import in_backward
from lightning_memopt._replay import is_replaying
from lightning_memopt._tree import tensors
from lightning_memopt.checkpointing.apply import observe_saved
from lightning_memopt.checkpointing.calls import storage_key
from lightning_memopt.checkpointing.capture import BlockInputs, record_block_inputs
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.memory.tracker import allocated_bytes

__all__ = ["ActivationMeter", "ForwardProbe"]


class ActivationMeter:
    """Measure, with a :class:`~lightning_memopt.memory.MemoryTracker`, the bytes each block makes autograd
    hold during a forward: the growth of the tracker's ``activations`` while the block runs (so a boundary
    tensor counts in the block that holds it first, as in :class:`~lightning_memopt.checkpointing.Plan`).

    Tensors cached by selective checkpointing are marked as activations (they bypass saved-tensor hooks);
    tensors offloaded to CPU are not counted (they leave the device; on a CPU-only machine they are
    ``other`` bytes of the same memory).

    Args:
        model: The model; its parameters are categorized as such.
        blocks: ``(name, module)`` pairs to attribute bytes to.
        optimizers: Optimizers whose state the tracker should categorize, optional.

    Example::

        >>> from lightning_memopt.checkpointing import find_blocks
        >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2)])
        >>> with ActivationMeter(model, find_blocks(model)) as meter:
        ...     loss = model(torch.randn(4, 8)).sum()
        >>> meter.block_bytes
        {'0': 256, '1': 256}
    """

    def __init__(self, model: nn.Module, blocks: Iterable[tuple[str, nn.Module]], optimizers=None) -> None:
        self.blocks = list(blocks)
        self.tracker = MemoryTracker(model, optimizers)
        self.block_bytes: dict[str, int] = {}
        self._stack = contextlib.ExitStack()

    @property
    def total(self) -> int:
        """Bytes held by all blocks together."""
        return sum(self.block_bytes.values())

    def _beyond_views(self, inputs: list[torch.Tensor]) -> int:
        """The bytes the tracker counts for the storages behind ``inputs`` beyond the views of them that the
        block was handed, where it made autograd hold those storages: a micro-batch is a slice of its batch,
        and a stem that saves it holds nothing the batch does not (the plan counts the slice, as a storage
        of its own; the tracker, the whole storage autograd holds)."""
        views: dict[int, list] = {}  # storage: [a tensor on it, the bytes of the views handed in]
        for t in inputs:
            key = storage_key(t)
            if key is not None and self.tracker.category_of(t) == "activations":
                views.setdefault(key, [t, 0])[1] += t.numel() * t.element_size()
        return sum(
            max(0, self.tracker.bytes_of(t) - allocated_bytes(seen, t.device)) for t, seen in views.values()
        )

    def _mark(self, kind: str, t: torch.Tensor) -> None:
        if kind == "cached":
            self.tracker.mark(t, "activations")

    def __enter__(self) -> ActivationMeter:
        start: dict[str, tuple[int, list[torch.Tensor]]] = {}

        def pre(name):
            def hook(module, args, kwargs):
                # the last forward counts, as above; never a replay (the one-time exactness check's passes)
                if torch.is_grad_enabled() and not in_backward() and not is_replaying():
                    inputs = [
                        t for t in tensors((args, kwargs)) if self.tracker.category_of(t) != "activations"
                    ]
                    start[name] = (self.tracker.current_breakdown["activations"], inputs)

            return hook

        def post(name):
            def hook(module, args, out):
                if name in start:
                    before, inputs = start.pop(name)
                    grown = self.tracker.current_breakdown["activations"] - before
                    self.block_bytes[name] = grown - self._beyond_views(inputs)

            return hook

        for name, block in self.blocks:
            self._stack.callback(block.register_forward_pre_hook(pre(name), with_kwargs=True).remove)
            self._stack.callback(block.register_forward_hook(post(name)).remove)
        self._stack.enter_context(self.tracker)
        self._stack.enter_context(observe_saved(self._mark))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


class ForwardProbe:
    """Around one training step's forward: the blocks' activation bytes (:class:`ActivationMeter`), the
    activations held outside the blocks, and (``record=True``) each block's inputs for profiling.

    Call :meth:`forward_done` when the forward ends (before backward) and :meth:`close` after the step;
    ``close`` is safe to call twice and after an exception.
    """

    def __init__(self, model: nn.Module, blocks: Iterable[tuple[str, nn.Module]], *, record: bool) -> None:
        self._stack = contextlib.ExitStack()
        self.meter = self._stack.enter_context(ActivationMeter(model, blocks))
        self.inputs: dict[str, BlockInputs] | None = None
        self.outside_bytes = 0
        """Activations autograd holds at the end of the forward outside the blocks (embeddings, head, loss)."""
        self.batch_bytes = 0
        """The batch's bytes that autograd has not held during the forward (:meth:`forward_done`): the batch
        stays alive beside the activations through the step."""
        self.open = True
        if record:
            held = lambda t: self.meter.tracker.category_of(t) == "activations"  # noqa: E731
            self.inputs = self._stack.enter_context(record_block_inputs(self.meter.blocks, held))

    def forward_done(self, batch: Iterable[torch.Tensor] = ()) -> None:
        """Stop measuring: backward runs untracked. Under a micro-batching engine the micro-batches'
        backwards already ran and nothing is held now: the blocks' bytes were taken as they ran, and what
        is held outside them is read from the most activations held at once (the last forward's end).
        ``batch``: the step's batch tensors, whose storages autograd has not held count in
        :attr:`batch_bytes` (each once); one it held (token ids an embedding saved, images a patch
        embedding saved: a micro-batch is a view of the batch's storage) counted among the activations
        outside the blocks, also where the micro-batches' backwards have let it go since."""
        if self.open:
            self.outside_bytes = max(0, self.meter.tracker.most_activations - self.meter.total)
            tracker, seen = self.meter.tracker, set()
            for t in batch:
                key = storage_key(t)
                if key is None or key in seen or tracker.was_saved(t):
                    continue
                seen.add(key)
                self.batch_bytes += allocated_bytes(t.untyped_storage().nbytes(), t.device)
        self.close()

    def close(self) -> None:
        self.open = False
        self._stack.close()
