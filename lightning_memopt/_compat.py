"""The private torch APIs the package relies on, each behind one guard (verified on torch 2.13; the CUDA
benchmarks ran on torch 2.11).

Every use of a torch name that starts with an underscore goes through this module, so a torch upgrade
that moves one breaks here, in one place, with a clear error, instead of in the middle of a step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_flatten, tree_unflatten  # private module; public behaviour since 1.10

__all__ = [
    "BatchNormBase",
    "fsdp_module_type",
    "in_backward",
    "install_device_guard",
    "is_dtensor",
    "mark_dynamic",
    "queue_backward_callback",
    "reset_fsdp_iteration",
    "saved_by",
    "saved_tensors_hooks_below",
    "selective_checkpoint_contexts",
    "tree_flatten",
    "tree_unflatten",
    "untracked",
    "view_base",
]

#: The base of BatchNorm1d/2d/3d, SyncBatchNorm and the lazy BatchNorm classes (private, stable since 1.0).
BatchNormBase = _BatchNorm


def in_backward() -> bool:
    """True while autograd runs a backward (e.g. an activation checkpoint recomputing its forward)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)  # private; present on torch 2.x
    return task_id is not None and task_id() != -1


def install_device_guard() -> bool:
    """Install, from this thread, the no-op CUDA device guard that torch's ``FakeTensorMode`` installs the
    first time it is entered on a CUDA build of torch without a visible GPU (PyPI's default wheel on a CPU
    machine: ``torch._C._ensureCUDADeviceGuardSet``, private; present on torch 2.x). Whether it did.

    On torch 2.11 that guard lives with the thread that installed it: once the thread has ended, the next
    ``FakeTensorMode`` entered from any other thread crashes the process (a segmentation fault; two
    threads, one after the other, each entering ``FakeTensorMode``, are enough). The package enters it in a
    fit's first step (:func:`~lightning_memopt.memory.tracker.optimizer_state_to_come`, the dry runs of
    selective and pointwise checkpointing), which may run in a thread of its own. Importing the package
    installs the guard from the main thread, which ends last; elsewhere, or with a GPU visible, nothing.
    """
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if (
        ensure is None
        or torch.version.cuda is None
        or threading.current_thread() is not threading.main_thread()
    ):
        return False
    if torch.cuda.is_available():  # the real guard is in place
        return False
    ensure()
    return True


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward ends, ahead of callbacks queued after it (FSDP's)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def fsdp_module_type() -> type | None:
    """``torch.distributed.fsdp.FSDPModule`` (FSDP2's ``fully_shard`` modules); None on a torch without it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (a sharded tensor); False on a torch without."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def saved_tensors_hooks_below() -> tuple[Callable, Callable] | None:
    """The ``(pack, unpack)`` pair of saved-tensor hooks in effect now (a ``MemoryTracker``'s, an
    offloader's), for hooks entered next to pass on what they do not handle themselves; None where none
    is, or where saved-tensor hooks are disabled (then no pair can be entered either: raises)."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # private; present on torch 2.x
        raise RuntimeError("saved-tensor hooks are disabled here")
    return torch._C._autograd._top_saved_tensors_default_hooks(False)  # private; present on torch 2.x


def reset_fsdp_iteration(sharded: list[Any]) -> None:
    """Put FSDP2 back to the start of an iteration after one that stopped half-way (``sharded``: root first).

    torch >= 2.13 has ``reset_iter_state`` on the root. Before it, the same is done here through FSDP2's
    private state (present on torch 2.4 to 2.12): resharding alone left the flag that the backward's final
    callback is queued set by the failed backward, so the next backward never queued it and the root's
    gradients (embeddings, final norm: reduced only there) were never reduce-scattered.
    """
    root = sharded[0]
    if hasattr(root, "reset_iter_state"):
        root.reset_iter_state()
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState  # private; torch 2.4+

    state = root._get_fsdp_state()  # private; torch 2.4+
    comm, shared = state._comm_ctx, state._state_ctx
    for pending in (comm.all_gather_state, comm.reduce_scatter_state):
        if pending is not None and pending.event is not None:
            state._device_handle.current_stream().wait_event(pending.event)
    comm.all_gather_state = comm.reduce_scatter_state = None
    comm.post_forward_order.clear()
    for s in shared.all_states:
        s._modules_to_run_forward.clear()
        s._training_state = TrainingState.IDLE
        group = s._fsdp_param_group  # one per state before torch 2.13
        if group is not None:
            group.finalize_backward()  # waits on its reductions, drops a gather and the prefetch order
            group._partial_reduce_output = None
            group._training_state = TrainingState.IDLE
            group.reshard()
    shared.iter_forward_root = None
    shared.post_backward_final_callback_queued = False


def untracked() -> Any:
    """A context in which no ``TorchDispatchMode`` sees the ops run (a host copy is not device memory, so
    a simulated device, :class:`~lightning_memopt.testing.MemoryCap`, must not count it)."""
    from torch.utils._python_dispatch import _disable_current_modes  # private; present on torch 2.x

    return _disable_current_modes()


def view_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of (itself where it is not a view)."""
    return t._base if t._is_view() else t  # private; public behaviour since 1.0


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Let ``torch.compile`` treat dimension ``dim`` of ``t`` as dynamic from its first call (no graph
    specialised on its size, then compiled again for the next); a hint only, no effect in eager code."""
    torch._dynamo.maybe_mark_dynamic(t, dim)  # private module; present on torch 2.x


def saved_by(node: Any, name: str) -> Any:
    """What the autograd ``node`` saved for backward as ``name`` (``self``, ``approximate``, ...)."""
    return getattr(node, f"_saved_{name}")  # private; present on torch 2.x


def _policy_sees_output() -> bool:
    import inspect

    from torch.utils.checkpoint import SelectiveCheckpointContext

    return "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


SAC_POLICY_SEES_OUTPUT = _policy_sees_output()
"""Whether torch hands selective checkpointing's policy the op's output (``ctx.op_output``, torch >= 2.12);
before, the policy runs before the op."""


def selective_checkpoint_contexts(policy: Callable, on_cached: Callable[[torch.Tensor], None]) -> tuple:
    """torch's selective-checkpoint contexts for ``policy``, calling ``on_cached(t)`` once for every tensor
    the forward caches (the outputs ``policy`` saves).

    Where the policy sees each op's output (:data:`SAC_POLICY_SEES_OUTPUT`) it is called there, at the op;
    elsewhere when the forward's context exits, from the tensors it stored (private: its ``storage``, one
    entry per op of ``_VersionWrapper`` holding ``val``; present on torch 2.4 to 2.13).
    """
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    if not SAC_POLICY_SEES_OUTPUT:
        forward, recompute = create_selective_checkpoint_contexts(policy)
        return _NotifyCachedOnExit(forward, on_cached), recompute

    def seeing(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        if not ctx.is_recompute and decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            for t in tree_flatten(ctx.op_output)[0]:
                if isinstance(t, torch.Tensor):
                    on_cached(t)
        return decision

    return create_selective_checkpoint_contexts(seeing)


class _NotifyCachedOnExit:
    """A selective checkpoint's forward context that reports the tensors it cached as it exits."""

    def __init__(self, mode: Any, on_cached: Callable[[torch.Tensor], None]) -> None:
        self.mode, self.on_cached = mode, on_cached

    def __enter__(self) -> Any:
        return self.mode.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        suppressed = self.mode.__exit__(*exc)
        for entries in self.mode.storage.values():  # private, see selective_checkpoint_contexts
            for entry in entries.values() if isinstance(entries, dict) else entries:
                for leaf in tree_flatten(entry)[0]:
                    if isinstance(getattr(leaf, "val", None), torch.Tensor):
                        self.on_cached(leaf.val)
        return suppressed


install_device_guard()  # once, as the package is imported (lightning_memopt/__init__.py imports this module)
