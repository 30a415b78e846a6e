"""The distributed regime of one attempt: what runs around each micro-batch, how a failure is agreed on,
what happens after success; chosen in one place, :func:`choose_regime`.

The rule every regime keeps: after any point where a rank can run out of memory, every rank's next
collective is a sync point (:func:`sync_point`), so no rank waits in a collective another will not
reach. What each regime costs per step: ``docs/micro_batching.md``, "Out of memory on one rank".
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import ParallelStrategy

from lightning_memopt._compat import (
    fsdp_module_type,
    in_backward,
    queue_backward_callback,
    reset_fsdp_iteration,
    tree_flatten,
    tree_unflatten,
)
from lightning_memopt.batching.distributed import (
    all_reduce_gradients,
    any_rank,
    is_distributed,
    max_over_ranks_each,
)
from lightning_memopt.batching.errors import MicroBatchOOMError, checklist
from lightning_memopt.batching.state import drop_gradients

__all__ = [
    "Agreed",
    "Overlapped",
    "PeerOutOfMemory",
    "Regime",
    "Sharded",
    "Sharding",
    "SyncInBackward",
    "Unagreed",
    "choose_regime",
    "ddp_module",
    "drop_attempt",
    "find_sharding",
    "no_sync",
    "sync_point",
]

Phase = Literal["training", "evaluation", "optimizer_step"]


class PeerOutOfMemory(Exception):
    """Raised at a sync point when another rank ran out of memory (FSDP2: collectives in forward/backward)."""


def sync_point(device: torch.device) -> None:
    """All ranks: has anyone run out of memory? (A rank that did answers from its recovery path.)

    Raises:
        PeerOutOfMemory: If another rank did.
    """
    if any_rank(False, device):
        raise PeerOutOfMemory


def ddp_module(strategy: Any) -> Any:
    """The strategy's ``DistributedDataParallel`` model, or None."""
    model = strategy.model
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


def no_sync(strategy: Any) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` through the strategy (a no-op context for strategies that are not parallel)."""
    if isinstance(strategy, ParallelStrategy):
        return strategy.block_backward_sync()
    return contextlib.nullcontext()


class Regime:
    """Local: one process, or no OOM retry; the base of the distributed regimes."""

    name = "local"
    distributed = False  # the other ranks take part in this attempt's agreement or fail with this rank
    agrees = False  # a failure is agreed on by every rank (the optimizer step snapshots its state then)

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.ddp = ddp_module(strategy)

    def armed(self) -> contextlib.AbstractContextManager:
        """Around all micro-batches of the attempt."""
        return contextlib.nullcontext()

    def around(self, index: int, last: bool) -> contextlib.AbstractContextManager:
        """Around micro-batch ``index`` (its forward and backward)."""
        sync = self._sync(last)
        # DDP broadcasts rank 0's buffers in the first micro-batch's forward, as an unsplit forward would,
        # and not in later ones (DDP itself stops after a `no_sync` forward, and a broadcast in a later
        # micro-batch would be a collective that a rank which ran out of memory never reaches).
        if self.ddp is not None:
            self.ddp.require_forward_param_sync = index == 0
        return sync

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else no_sync(self.strategy)

    def wrap_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch's (scaled) loss, ready for its backward."""
        return loss

    def failed(self, failure: str | None, peer: bool) -> bool:
        """Whether the attempt failed on any rank. ``failure``: this rank's error and memory, or None;
        ``peer``: another rank's failure was learned at a sync point (which was the agreement)."""
        return peer or failure is not None

    def succeeded(self) -> None:
        """After an attempt that succeeded on every rank."""


class Agreed(Regime):
    """Every micro-batch under ``no_sync``, one agreement, then gradients averaged (if ``average``).

    The agreement also carries which parameters have a gradient on each rank, so that one no rank used
    keeps ``grad=None`` after the average, as under plain DDP (``find_unused_parameters=True``).
    """

    name = "agreed"
    distributed = agrees = True

    def __init__(self, strategy: Any, *, average: bool = False) -> None:
        super().__init__(strategy)
        self.average = average
        self.sync = functools.partial(sync_point, strategy.root_device)
        self.used: list[int] | None = None

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        return no_sync(self.strategy)

    def failed(self, failure: str | None, peer: bool) -> bool:
        if not self.average:
            return peer or any_rank(failure is not None, self.strategy.root_device)
        grads = [int(p.grad is not None) for p in self.strategy.model.parameters() if p.requires_grad]
        agreed = max_over_ranks_each([int(failure is not None), *grads], self.strategy.root_device)
        self.used = agreed[1:]
        return peer or bool(agreed[0])

    def succeeded(self) -> None:
        if self.average:
            all_reduce_gradients(self.strategy.model.parameters(), used=self.used)


class Overlapped(Agreed):
    """DDP, stable: the ranks agree before the last micro-batch, which syncs gradients in its backward."""

    name = "overlapped"

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.past_sync_point = False

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        if not last:
            return no_sync(self.strategy)
        self.sync()  # the agreement on the first k-1 micro-batches
        self.past_sync_point = True
        return contextlib.nullcontext()

    def failed(self, failure: str | None, peer: bool) -> bool:
        if failure is not None and self.past_sync_point:
            # the other ranks are inside DDP's all-reduce and no agreement can reach them any more
            raise MicroBatchOOMError(
                "out of memory in the last micro-batch while DDP synchronizes gradients during backward "
                "(OOMBackoff(overlap_after=...) mode); this cannot be retried on every rank. Keep "
                f"overlap_after=None (the default) to make every OOM recoverable.\n{failure}"
            )
        if failure is None and not peer:
            return False  # the sync point before the last micro-batch was this step's agreement
        return super().failed(failure, peer)


class Sharded(Agreed):
    """FSDP2 with retry: sync points before every FSDP collective of every micro-batch, one agreement."""

    name = "sharded"

    def __init__(self, strategy: Any, sharding: Sharding) -> None:
        super().__init__(strategy)
        self.sharding = sharding

    def armed(self) -> contextlib.AbstractContextManager:
        return self.sharding.armed(self.sync)

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # FSDP2 reduce-scatters in every micro-batch's backward

    def wrap_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # sync before the backward, and before FSDP's final callback after it
        return SyncInBackward.apply(self.sync, True, loss)[0]


class Unagreed(Regime):
    """No agreement: an OOM on this rank raises ``MicroBatchOOMError`` (the others fail at their next
    collective). ``message`` says why it cannot be retried; ``tail`` follows the failure."""

    name = "unagreed"
    distributed = True

    def __init__(self, strategy: Any, message: str, tail: str = "") -> None:
        super().__init__(strategy)
        self.message, self.tail = message, tail

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # FSDP2 reduce-scatters in every micro-batch's backward

    def failed(self, failure: str | None, peer: bool) -> bool:
        if failure is not None:
            raise MicroBatchOOMError(f"{self.message}\n{failure}{self.tail}")
        return peer


def choose_regime(
    phase: Phase,
    strategy: Any,
    *,
    retry: bool,
    sharding: Sharding | None = None,
    micro_batches: int = 1,
    stable_steps: int = 0,
    overlap_after: int | None = None,
    size: int = 0,
    done: frozenset[str] = frozenset(),
) -> Regime:
    """The regime of one attempt of ``phase`` (the only place the regimes are chosen).

    Args:
        phase: What the attempt runs.
        strategy: The Trainer's strategy.
        retry: OOM retry is on (``OOMBackoff``).
        sharding: The model's FSDP2 modules (None without FSDP2).
        micro_batches: Micro-batches of the attempt (training).
        stable_steps: Steps that succeeded in a row at the current size.
        overlap_after: ``OOMBackoff(overlap_after=...)``.
        size: The micro-batch size of the attempt (for the error message).
        done: What the fit already does of the error's advice (:func:`~.errors.checklist`).
    """
    if not is_distributed():
        return Regime(strategy)
    if phase == "optimizer_step":
        if stable_steps <= 1:  # the first clean step at this size
            return Agreed(strategy)
        return Unagreed(strategy, _SETTLED_STEP, "\n" + checklist(done))
    if phase == "evaluation":
        return Sharded(strategy, sharding) if retry and sharding is not None else Agreed(strategy)
    if not retry:
        return Regime(strategy)
    stable = overlap_after is not None and stable_steps >= overlap_after
    if sharding is not None and stable:
        return Unagreed(strategy, _UNSYNCED.format(stable_steps, size, overlap_after))
    if sharding is not None:
        return Sharded(strategy, sharding)
    if stable and micro_batches >= 2 and ddp_module(strategy) is not None:
        return Overlapped(strategy)
    return Agreed(strategy, average=True)


_SETTLED_STEP = (
    "out of memory in the optimizer step on this rank under a distributed strategy, at a micro-batch size that "
    "had already stepped cleanly (the ranks agree on optimizer-step OOMs only for the first step at each "
    "size); the other ranks have stepped, so the step cannot be retried."
)
_UNSYNCED = (
    "out of memory under FSDP2 after {} clean steps at micro-batch size {}, with OOMBackoff(overlap_after={}): "
    "the sync points that let every rank retry were off, so this cannot be retried on every rank. Keep "
    "overlap_after=None (the default) to make every OOM recoverable."
)


# ---------------------------------------------------------------------- FSDP2 sync points
class SyncInBackward(torch.autograd.Function):
    """Identity on its tensors; its backward runs ``sync`` (and, with ``queue_final``, queues one more
    ``sync`` to run when the backward ends, ahead of FSDP's final callback that it precedes)."""

    @staticmethod
    def forward(ctx, sync: Callable[[], None], queue_final: bool, *tensors: torch.Tensor):
        ctx.sync, ctx.queue_final = sync, queue_final
        ctx.set_materialize_grads(False)
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        if ctx.queue_final:
            queue_backward_callback(ctx.sync)
        ctx.sync()
        return (None, None, *grads)


def find_sharding(model: torch.nn.Module) -> Sharding | None:
    """The FSDP2 (``fully_shard``) modules of ``model``; None without any (or without FSDP2)."""
    fsdp = fsdp_module_type()
    modules = [] if fsdp is None else [m for m in model.modules() if isinstance(m, fsdp)]
    return Sharding(modules) if modules else None


def drop_attempt(model: torch.nn.Module, sharding: Sharding | None) -> None:
    """Drop a failed attempt's gradients and put FSDP2 back to the start of an iteration."""
    # Gradients before the reset: a sharded module whose backward stopped between computing its
    # gradients and reduce-scattering them still has its unsharded parameters registered, so this
    # drops those gradients too. FSDP's reset_iter_state (torch 2.13) registers the sharded
    # parameters again and keeps the unsharded ones' gradients, which the retry would add to (tested).
    drop_gradients([model])
    if sharding is not None:
        sharding.reset()
        drop_gradients([model])  # and the sharded parameters registered again


class Sharding:
    """The ``fully_shard`` modules of a model, root first, found once per fit (:func:`find_sharding`)."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.modules = modules
        ids = {id(m) for m in modules}
        # The modules that manage parameters of their own: the ones whose hooks communicate.
        self.owners = []
        for m in modules:
            inner = {id(p) for c in m.modules() if c is not m and id(c) in ids for p in c.parameters()}
            if any(id(p) not in inner for p in m.parameters()):
                self.owners.append(m)

    def reset(self) -> None:
        """After an attempt that failed inside a sharded module (FSDP mid-iteration: parameters gathered,
        the forward root set): reshard and clear that state."""
        reset_fsdp_iteration(self.modules)

    @contextlib.contextmanager
    def armed(self, sync: Callable[[], None]) -> Iterator[None]:
        """Hooks that run ``sync`` before each FSDP2 all-gather and reduce-scatter of a micro-batch.

        Why the hooks come first (torch 2.13: FSDP2 prepends its pre-forward hook and appends its
        post-forward one): a prepended pre-hook runs before the forward all-gather; a prepended forward
        hook puts a tensor hook on the outputs before FSDP's pre-backward (all-gather) hook; a pre-hook
        after FSDP's wraps the inputs in :class:`SyncInBackward`, ahead of its post-backward
        reduce-scatter. Reduce-scatters in FSDP's final callback get theirs from the loss
        (:meth:`Sharded.wrap_loss`).
        """
        handles = []
        for m in self.owners:
            handles.append(m.register_forward_pre_hook(lambda *_: sync(), prepend=True))
            handles.append(
                m.register_forward_pre_hook(functools.partial(_before_reduce_scatter, sync), with_kwargs=True)
            )
            handles.append(
                m.register_forward_hook(functools.partial(_before_backward_all_gather, sync), prepend=True)
            )
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def _before_reduce_scatter(sync: Callable[[], None], module: Any, args: tuple, kwargs: dict) -> Any:
    if not torch.is_grad_enabled() or in_backward():  # no backward, or a checkpoint's recompute
        return None
    leaves, spec = tree_flatten((args, kwargs))
    index = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not index:
        return None
    synced = SyncInBackward.apply(sync, False, *(leaves[i] for i in index))
    for i, t in zip(index, synced):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def _before_backward_all_gather(sync: Callable[[], None], module: Any, args: Any, output: Any) -> None:
    if not torch.is_grad_enabled() or in_backward():
        return
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    fired = [False]

    def hook(grad: torch.Tensor) -> None:
        if not fired[0]:  # once per forward call, on whichever output's gradient comes first
            fired[0] = True
            sync()

    for t in tensors:
        t.register_hook(hook)
