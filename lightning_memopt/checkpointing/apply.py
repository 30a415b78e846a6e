"""Apply a checkpointing plan to blocks, and take it off again.

A block is never replaced by a wrapper module: its *instance* gets a ``forward`` attribute that runs the
class's forward under the chosen treatment, and the original is kept to restore. The module tree,
parameter names and ``state_dict`` keys stay exactly those of the bare model, and hooks registered on
the block (FSDP2's all-gather/reshard, DDP's) still run around the checkpointed computation, never
inside it, so recomputation in backward never re-runs a collective.

Treatments (``Choice``):

==============  ======================================================================================
``keep``        nothing: autograd saves what it saves
``selective``   non-reentrant checkpoint with torch's selective contexts: outputs of compute-heavy ops
                (matmul, convolution, attention; the ops ``FlopCounterMode`` counts) are cached, cheap
                pointwise ops are recomputed in backward. Compute ops that run after the last tensor
                the block saves for backward (a transformer block's final projection) are not cached:
                recomputation stops before them, so caching them would only hold memory
``full``        non-reentrant checkpoint: only the block's inputs are kept; the block runs again in
                backward (stopping early once everything needed is recomputed)
``offload``     tensors saved for backward are copied to CPU memory and brought back in backward;
                parameters are never offloaded. Costs transfer bytes, no FLOPs
==============  ======================================================================================

Nothing is recomputed or offloaded when the block is in ``eval()`` mode or gradients are disabled.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Literal

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import flop_registry

from lightning_memopt.checkpointing.offload import overlapped_offload

__all__ = [
    "CHOICES",
    "Choice",
    "apply_checkpointing",
    "remove_checkpointing",
    "checkpointed_blocks",
    "observe_saved",
    "is_compute_op",
]

Choice = Literal["keep", "selective", "full", "offload"]
CHOICES: tuple[str, ...] = ("keep", "selective", "full", "offload")

_STATE = "_memopt_checkpoint"  # instance attribute holding a block's _BlockState

# Attention on CPU is not in FlopCounterMode's registry but is as expensive as the matmuls around it.
_EXTRA_COMPUTE_OPS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu}

# Observers see tensors that the saved-tensor hooks of a MemoryTracker cannot: outputs cached by
# selective checkpointing ("cached") and tensors copied to CPU by offloading ("offloaded").
_OBSERVERS: list[Callable[[str, torch.Tensor], None]] = []


def is_compute_op(op) -> bool:
    """Whether ``op`` is compute-heavy (its output is worth caching rather than recomputing)."""
    packet = getattr(op, "overloadpacket", op)
    return packet in flop_registry or packet in _EXTRA_COMPUTE_OPS


@contextlib.contextmanager
def observe_saved(fn: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call ``fn(kind, tensor)`` for every tensor selective checkpointing caches (``kind="cached"``) or
    offloading copies to CPU (``kind="offloaded"``, the CPU copy) while the context is entered.

    Example::

        >>> from lightning_memopt.memory import MemoryTracker
        >>> tracker = MemoryTracker()
        >>> with tracker, observe_saved(lambda kind, t: tracker.mark(t, "activations")):
        ...     pass
    """
    _OBSERVERS.append(fn)
    try:
        yield
    finally:
        _OBSERVERS.remove(fn)


def _notify(kind: str, tensor: torch.Tensor) -> None:
    for fn in list(_OBSERVERS):
        fn(kind, tensor)


def _selective_contexts(cached: int | None):
    """Contexts that cache the outputs of the first ``cached`` compute ops (all of them if None)."""
    seen = {False: 0, True: 0}  # compute ops so far, in the forward and in a recomputation

    def policy(ctx, op, *args, **kwargs):
        if not is_compute_op(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        index = seen[ctx.is_recompute]
        seen[ctx.is_recompute] += 1
        if cached is not None and index >= cached:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if not ctx.is_recompute:
            for t in _tensors(ctx.op_output):
                _notify("cached", t)
        return CheckpointPolicy.MUST_SAVE

    return create_selective_checkpoint_contexts(policy)


def _compute_ops_before_last_save(block: nn.Module, fn, args, kwargs) -> int | None:
    """How many compute ops of ``fn(*args, **kwargs)`` run before autograd saves its last tensor.

    Non-reentrant checkpointing recomputes the forward only until every tensor saved for backward is
    back, so the compute ops after that point never run again and their outputs need no cache. Found by
    running the forward once on fake tensors (no memory, no FLOPs, no RNG or buffer change; modes the
    caller entered, such as memory trackers and FLOP counters, do not see it). None when it cannot be
    known: early stopping is off, or the block does not run on fake tensors.
    """
    if getattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None) is False:
        return None
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.compute = 0
            self.at_last_save = 0

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            self.compute += is_compute_op(func)
            return out

    buffers = [(b, b.detach().clone()) for b in block.buffers()]
    count = Count()

    def pack(t):
        count.at_last_save = count.compute
        return None

    # Autocast caches the casts of parameters while its region lasts: a cast made on fake tensors must
    # not be found by the real forward (nor change which casts the real forward and its recomputation run).
    autocast_cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with _disable_current_modes(), torch.random.fork_rng(devices=[]):
            mode = detect_fake_mode(_tensors((args, kwargs))) or FakeTensorMode(allow_non_fake_inputs=True)
            with mode:

                def fake(v):
                    if not isinstance(v, torch.Tensor):
                        return v
                    f = v.detach() if mode.is_our_fake(v) else mode.from_tensor(v.detach())
                    return f.requires_grad_(v.requires_grad)

                fargs, fkwargs = tree_map(fake, (args, kwargs))
                with (
                    torch.enable_grad(),
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None),
                    count,
                ):
                    fn(*fargs, **fkwargs)
    except Exception:  # a data-dependent op, an op fake tensors do not support: cache every compute op
        return None
    finally:
        torch.set_autocast_cache_enabled(autocast_cache)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return count.at_last_save


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None


class _OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Like ``torch.autograd.graph.save_on_cpu``, but parameters stay where they are.

    The copy is made even when the tensor already is on the CPU, so that the same bytes leave the
    block's device tensors as would leave an accelerator (on a CPU-only machine this saves no memory:
    the copy lands on the same device; the plan counts it as transfer bytes).
    """

    def __init__(self, block: nn.Module) -> None:
        keep = {_storage_key(p) for p in block.parameters()} | {_storage_key(b) for b in block.buffers()}
        pin = torch.cuda.is_available()

        def pack(t: torch.Tensor):
            if isinstance(t, nn.Parameter) or _storage_key(t) in keep:
                return t, None
            cpu = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin and t.is_cuda)
            cpu.copy_(t)  # a copy, even from CPU: see the class docstring
            _notify("offloaded", cpu)
            return cpu, t.device

        def unpack(packed):
            t, device = packed
            return t if device is None else t.to(device, non_blocking=pin)

        super().__init__(pack, unpack)


class _BlockState:
    """What :func:`apply_checkpointing` leaves on a block: the choice, and how to restore it."""

    def __init__(self, choice: str, own_forward) -> None:
        self.choice = choice
        self.own_forward = own_forward  # an instance-level ``forward`` the block had before, or None
        # selective: per input signature, how many compute ops' outputs to cache (None: all)
        self.cached_ops: dict[str, int | None] = {}


def _signature(value) -> str:
    """What the op sequence of a forward may depend on: the inputs' shapes, dtypes and devices."""

    def meta(v):
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), v.dtype, v.device.type, v.requires_grad)
        return repr(v)

    return str(tree_map(meta, value))


def _checkpointed_forward(block: nn.Module, *args, **kwargs):
    state: _BlockState = block.__dict__[_STATE]
    fn = state.own_forward if state.own_forward is not None else functools.partial(type(block).forward, block)
    choice = state.choice
    if choice == "keep" or not block.training or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if choice == "offload":
        # offload.py: on CUDA, copies overlap compute on side streams; elsewhere the plain copy below.
        hooks = overlapped_offload(block, (args, kwargs), functools.partial(_notify, "offloaded"))
        with hooks or _OffloadHooks(block):
            return fn(*args, **kwargs)
    if choice == "selective":
        key = _signature((args, kwargs))
        if key not in state.cached_ops:
            state.cached_ops[key] = _compute_ops_before_last_save(block, fn, args, kwargs)
        contexts = functools.partial(_selective_contexts, state.cached_ops[key])
    else:
        contexts = _noop_contexts
    buffers = [b for b in block.buffers() if b.is_floating_point() or b.dtype == torch.long]

    def context_fn():
        forward_ctx, recompute_ctx = contexts()
        if not buffers:
            return forward_ctx, recompute_ctx
        return forward_ctx, _RestoreBuffers(buffers, recompute_ctx)

    # Non-reentrant only: reentrant checkpoint breaks with kwargs, DDP and inputs that need no grad.
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _noop_contexts():
    return contextlib.nullcontext(), contextlib.nullcontext()


class _RestoreBuffers:
    """Around recomputation: put the block's buffers back as they were, so BatchNorm's running statistics
    are updated once per step (by the forward), not twice (forward and recomputation)."""

    def __init__(self, buffers: list[torch.Tensor], inner) -> None:
        self.buffers, self.inner = buffers, inner

    def __enter__(self):
        self.saved = [b.detach().clone() for b in self.buffers]
        return self.inner.__enter__()

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            with torch.no_grad():
                for b, saved in zip(self.buffers, self.saved):
                    b.copy_(saved)


def apply_checkpointing(model: nn.Module, plan) -> None:
    """Make every block of ``plan`` run under its choice.

    Applying again only updates the choices: a block is never wrapped twice. The model's module tree,
    parameter names and ``state_dict`` keys do not change. Works on plain blocks and on blocks that are
    already ``fully_shard``-ed (FSDP2) or will be: the block's hooks run outside the checkpointed region.

    Args:
        model: The model holding the blocks.
        plan: A :class:`~lightning_memopt.checkpointing.Plan`, or a mapping from a block's qualified name
            (as in ``model.named_modules()``) to ``"keep"``, ``"selective"``, ``"full"`` or ``"offload"``.

    Raises:
        ValueError: If a name is not a module of ``model`` or a choice is unknown.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> apply_checkpointing(model, {"0": "full", "1": "selective"})
        >>> sorted(checkpointed_blocks(model).items())
        [('0', 'full'), ('1', 'selective')]
        >>> remove_checkpointing(model)
        >>> checkpointed_blocks(model)
        {}
    """
    choices: Mapping[str, str] = getattr(plan, "choices", plan)
    if not isinstance(choices, Mapping):
        raise ValueError(
            f"plan must be a Plan or a mapping of block name to choice, got {type(plan).__name__}"
        )
    modules = dict(model.named_modules())
    for name, choice in choices.items():
        if choice not in CHOICES:
            raise ValueError(f"choice for block {name!r} must be one of {CHOICES}, got {choice!r}")
        if name not in modules:
            raise ValueError(
                f"block {name!r} is not a module of {type(model).__name__}; names come from model.named_modules()"
            )
    for name, choice in choices.items():
        block = modules[name]
        state = block.__dict__.get(_STATE)
        if state is None:
            state = _BlockState(choice, block.__dict__.get("forward"))
            block.__dict__[_STATE] = state
            block.__dict__["forward"] = types.MethodType(_checkpointed_forward, block)
        state.choice = choice


def remove_checkpointing(model: nn.Module) -> None:
    """Restore every block of ``model`` that :func:`apply_checkpointing` touched, exactly as it was."""
    for module in model.modules():
        state = module.__dict__.pop(_STATE, None)
        if state is None:
            continue
        if state.own_forward is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = state.own_forward


def checkpointed_blocks(model: nn.Module) -> dict[str, str]:
    """The blocks of ``model`` that carry a choice, by qualified name: ``{"h.0": "full", ...}``."""
    return {name: m.__dict__[_STATE].choice for name, m in model.named_modules() if _STATE in m.__dict__}
