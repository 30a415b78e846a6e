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
``pointwise``   the outputs of the block's pointwise sub-modules (norms, activations) and of functional
                ``gelu``/``silu`` are made again in backward from their inputs, one at a time: no per-op
                dispatch (``pointwise.py``). Holds about what ``selective`` holds, or more where
                ``selective`` also drops other functional pointwise results
==============  ======================================================================================

Nothing is recomputed or offloaded when the block is in ``eval()`` mode or gradients are disabled.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint
from torch.utils.flop_counter import flop_registry

from lightning_memopt._compat import selective_checkpoint_contexts
from lightning_memopt._text import listed
from lightning_memopt._tree import tensors
from lightning_memopt.checkpointing.calls import call_signature, is_kv_cache, storage_key, without_cache
from lightning_memopt.checkpointing.costs import CHOICES
from lightning_memopt.checkpointing.dry_run import dry_run
from lightning_memopt.checkpointing.offload import overlapped_offload
from lightning_memopt.checkpointing.pointwise import Pointwise, pointwise_forward, pointwise_modules
from lightning_memopt.checkpointing.written import TREATED, Inputs, Snapshot, treatment_state

__all__ = [
    "apply_checkpointing",
    "remove_checkpointing",
    "checkpointed_blocks",
    "observe_saved",
    "is_compute_op",
    "framework_checkpointing",
]

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


@dataclass(frozen=True)
class _CachePolicy:
    """Which compute ops' outputs selective checkpointing caches, for one input signature."""

    limit: int | None
    """Cache only the first ``limit`` compute ops (None: no limit)."""
    mutated: frozenset[int] = frozenset()
    """Compute ops whose output is later changed in place (an in-place ReLU after a convolution): caching
    those would hand backward a tensor that changed since, which torch refuses; they are recomputed."""


_RECOMPUTE_ALL = _CachePolicy(0)


def _selective_contexts(cache: _CachePolicy):
    """Contexts that cache the outputs of the compute ops ``cache`` allows."""
    seen = {False: 0, True: 0}  # compute ops so far, in the forward and in a recomputation

    def policy(ctx, op, *args, **kwargs):
        if not is_compute_op(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        index = seen[ctx.is_recompute]
        seen[ctx.is_recompute] += 1
        if (cache.limit is not None and index >= cache.limit) or index in cache.mutated:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return selective_checkpoint_contexts(policy, functools.partial(_notify, "cached"))


class _CountOps(TorchDispatchMode):
    """Number the compute ops of a forward; note the count at each save and which outputs are mutated."""

    def __init__(self) -> None:
        super().__init__()
        self.compute = 0
        self.at_last_save = 0
        self.outputs: dict[int | None, int] = {}  # storage of a compute op's output -> its index
        self.mutated: set[int] = set()
        self._keep: list[torch.Tensor] = []  # outputs stay referenced: a freed storage's key could be reused

    def __torch_dispatch__(self, func, types, a=(), kw=None):
        kw = kw or {}
        if func._schema.is_mutable:
            named = dict(zip((arg.name for arg in func._schema.arguments), a)) | kw
            for arg in func._schema.arguments:
                if arg.alias_info is not None and arg.alias_info.is_write:
                    for t in tensors(named.get(arg.name)):
                        if storage_key(t) in self.outputs:
                            self.mutated.add(self.outputs[storage_key(t)])
        out = func(*a, **kw)
        if is_compute_op(func):
            for t in tensors(out):
                self.outputs[storage_key(t)] = self.compute
                self._keep.append(t)
            self.compute += 1
        return out


def _learn(block: nn.Module, state: _BlockState, fn, args, kwargs, key: Hashable) -> None:
    """Learn, for the input signature ``key``, what selective checkpointing may cache in
    ``fn(*args, **kwargs)`` (``state.cache_policies``) and which sub-modules the ``pointwise`` treatment
    recomputes (``state.pointwise``), both from one run of the forward on fake tensors
    (:func:`~lightning_memopt.checkpointing.dry_run.dry_run`): the profile puts every block through both.

    Non-reentrant checkpointing recomputes the forward only until every tensor saved for backward is
    back, so the compute ops after that point never run again and their outputs need no cache. Outputs
    changed in place later in the forward cannot be cached at all. Where the block does not run on fake
    tensors (a data-dependent op), nothing is cached: recomputing everything is always correct. Nor where
    a key/value cache is passed (a block that says it only reads it), and for ``selective`` no dry run
    runs then: one could write fake keys into the cache.
    """
    cached = any(is_kv_cache(v) for v in (*args, *kwargs.values()))
    if cached and state.choice != "pointwise":
        state.cache_policies[key] = _RECOMPUTE_ALL
        return
    count = _CountOps()
    ran = False

    def run(*, pack, mode) -> bool:
        nonlocal ran

        def packs(t):
            count.at_last_save = count.compute
            return pack(t)

        ran = dry_run(block, fn, args, kwargs, pack=packs, mode=_entered(count, mode))
        return ran

    try:
        state.pointwise[key] = pointwise_modules(block, run, is_compute=is_compute_op)
    finally:
        # The dry run's nodes hold ``packs`` and through it ``count``: the fake outputs it keeps lead back
        # to them (and to the block's parameters): a cycle through C++ no collector frees, emptied here.
        count._keep.clear()
    early_stop = getattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None) is not False
    state.cache_policies[key] = (
        _RECOMPUTE_ALL
        if cached or not ran
        else _CachePolicy(count.at_last_save if early_stop else None, frozenset(count.mutated))
    )


@contextlib.contextmanager
def _entered(*modes) -> Iterator[None]:
    """Enter ``modes`` in order (the last one sees each op first)."""
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield


class _OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Like ``torch.autograd.graph.save_on_cpu``, but parameters stay where they are.

    The copy is made even when the tensor already is on the CPU, so that the same bytes leave the
    block's device tensors as would leave an accelerator (on a CPU-only machine this saves no memory:
    the copy lands on the same device; the plan counts it as transfer bytes).
    """

    def __init__(self, block: nn.Module) -> None:
        keep = {storage_key(p) for p in block.parameters()} | {storage_key(b) for b in block.buffers()}
        pin = torch.cuda.is_available()

        def pack(t: torch.Tensor):
            if isinstance(t, nn.Parameter) or storage_key(t) in keep:
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
        # selective: per input signature, which compute ops' outputs to cache
        self.cache_policies: dict[Hashable, _CachePolicy] = {}
        # pointwise: per input signature, which sub-modules to recompute
        self.pointwise: dict[Hashable, Pointwise] = {}
        self.calls = 0  # forwards run through the instance ``forward`` (also ``block.forward(...)``)
        self.verified = False  # a recomputing forward ran and wrote no state (written.py)
        self.unrepeatable: str | None = None  # why a recomputation cannot reproduce the forward
        self.recompute: Snapshot | None = None  # the state a recomputation starts from, where written


def _checkpointed_forward(block: nn.Module, *args, **kwargs):
    state: _BlockState = block.__dict__[TREATED]
    fn = state.own_forward if state.own_forward is not None else functools.partial(type(block).forward, block)
    choice = state.choice
    state.calls += 1
    if choice == "keep" or state.unrepeatable or not block.training or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    args, kwargs = without_cache(block, args, kwargs)
    if choice == "offload":
        # offload.py: on CUDA, copies overlap compute on side streams; elsewhere the plain copy below.
        hooks = overlapped_offload(block, (args, kwargs), functools.partial(_notify, "offloaded"))
        with hooks or _OffloadHooks(block):
            return fn(*args, **kwargs)
    # Until a recomputing forward of this block was seen to write no state, and (full, selective) its
    # recomputation to find its inputs as the forward read them, each is watched (written.py): one that
    # writes state, or whose inputs the model writes after it ran, is recomputed from the state and inputs
    # it started from, and kept from then on.
    before = None if state.verified else Snapshot(block, values=choice != "pointwise")
    if choice == "pointwise":
        key = call_signature((args, kwargs))
        if key not in state.pointwise:
            _learn(block, state, fn, args, kwargs, key)
        out = pointwise_forward(block, fn, args, kwargs, state.pointwise[key])
        inputs = None
    else:
        inputs = None if before is None else Inputs(args, kwargs)
        out = _recomputed(block, state, fn, args, kwargs, inputs)
    if before is not None:
        _watched(block, state, before, verified=inputs is None)
    return out


def _recomputed(block: nn.Module, state: _BlockState, fn, args: tuple, kwargs: dict, inputs: Inputs | None):
    """``fn`` under non-reentrant checkpointing (``full``, or ``selective``'s cache policy); ``inputs``: a
    watched forward's (:func:`_as_read`)."""
    if state.choice == "selective":
        key = call_signature((args, kwargs))
        if key not in state.cache_policies:
            _learn(block, state, fn, args, kwargs, key)
        contexts = functools.partial(_selective_contexts, state.cache_policies[key])
    else:
        contexts = _noop_contexts

    def context_fn():
        forward_ctx, recompute_ctx = contexts()
        return forward_ctx, _Recompute(block, state, recompute_ctx)

    if inputs is not None:
        fn = functools.partial(_as_read, state, inputs, fn)
    # Non-reentrant only: reentrant checkpoint breaks with kwargs, DDP and inputs that need no grad.
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _as_read(state: _BlockState, inputs: Inputs, fn, /, *args, **kwargs):
    """``fn`` on a watched forward's inputs; its recomputation on them as the forward read them
    (:class:`~.written.Inputs`), which ends the watch: the block is verified where no input was written
    since (and its forward wrote no state), else unrepeatable, and kept from then on."""
    try:
        return inputs.call(fn, args, kwargs)
    finally:
        if inputs.calls > 1:  # a recomputation (which may stop early, by raising)
            if inputs.written:
                state.unrepeatable = (
                    state.unrepeatable
                    or f"the model writes its inputs after it ran ({listed(inputs.written)})"
                )
            elif state.unrepeatable is None:
                state.verified = True


def _watched(block: nn.Module, state: _BlockState, before: Snapshot, verified: bool = True) -> None:
    """After a watched forward: verified (where ``verified``: no recomputation must confirm it), or
    unrepeatable (recomputed from ``before``, kept afterwards)."""
    written = before.written()
    if not written:
        state.verified = verified
        return
    state.unrepeatable = f"its forward writes state ({listed(written)})"  # profile.py says what follows
    state.recompute = before


def _noop_contexts():
    return contextlib.nullcontext(), contextlib.nullcontext()


class _Recompute:
    """Around a block's recomputation in backward: its BatchNorms' running statistics stay as the forward
    left them (updated once per step, by the forward: momentum 0 and no batch count while it runs, so
    nothing is copied), and a block whose forward wrote state (:mod:`written`) recomputes from the state
    it started from, which is put back as it is now afterwards."""

    def __init__(self, block: nn.Module, state: _BlockState, inner) -> None:
        self.block, self.state, self.inner = block, state, inner
        self.norms: list[tuple[nn.Module, object, object]] = []
        self.now: Snapshot | None = None

    def __enter__(self):
        for m in self.block.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats:
                self.norms.append((m, m.momentum, m._buffers.get("num_batches_tracked")))
                m.momentum, m._buffers["num_batches_tracked"] = 0.0, None
        if self.state.recompute is not None:
            self.now = Snapshot(self.block, values=True)
            self.state.recompute.restore()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            for m, momentum, count in self.norms:
                m.momentum, m._buffers["num_batches_tracked"] = momentum, count
            if self.now is not None:
                self.now.restore()
                self.state.recompute = None  # one recomputation per forward: nothing to hold on to


def apply_checkpointing(model: nn.Module, plan) -> None:
    """Make every block of ``plan`` run under its choice.

    Applying again only updates the choices: a block is never wrapped twice. The model's module tree,
    parameter names and ``state_dict`` keys do not change. Works on plain blocks and on blocks that are
    already ``fully_shard``-ed (FSDP2) or will be: the block's hooks run outside the checkpointed region.

    Args:
        model: The model holding the blocks.
        plan: A :class:`~lightning_memopt.checkpointing.Plan`, or a mapping from a block's qualified name
            (as in ``model.named_modules()``) to one of :data:`CHOICES` (``"keep"``, ``"selective"``, ``"full"``, ``"offload"``, ``"pointwise"``).

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
        state = treatment_state(block)
        if state is None:
            state = _BlockState(choice, block.__dict__.get("forward"))
            block.__dict__[TREATED] = state
            block.__dict__["forward"] = types.MethodType(_checkpointed_forward, block)
        state.choice = choice


def remove_checkpointing(model: nn.Module) -> None:
    """Restore every block of ``model`` that :func:`apply_checkpointing` touched, exactly as it was."""
    for module in model.modules():
        state = module.__dict__.pop(TREATED, None)
        if state is None:
            continue
        if state.own_forward is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = state.own_forward


# Attributes by which other libraries mark checkpointing they do themselves: transformers' models
# (``gradient_checkpointing_enable()`` sets ``is_gradient_checkpointing`` on the model and
# ``gradient_checkpointing`` on each ``GradientCheckpointingLayer``) and timm's (``set_grad_checkpointing()``).
_FRAMEWORK_FLAGS = ("is_gradient_checkpointing", "gradient_checkpointing", "grad_checkpointing")


def framework_checkpointing(model: nn.Module) -> str | None:
    """The first module of ``model`` that checkpoints activations by its library's own means, as
    ``"name (ClassName.flag)"``, or None. Checkpointing a block twice recomputes it twice for nothing.

    Example::

        >>> framework_checkpointing(nn.Sequential(nn.Linear(2, 2))) is None
        True
    """
    for name, module in model.named_modules():
        for flag in _FRAMEWORK_FLAGS:
            if getattr(module, flag, False) is True:
                return f"{name or 'the model'} ({type(module).__name__}.{flag})"
    return None


def checkpointed_blocks(model: nn.Module) -> dict[str, str]:
    """The blocks of ``model`` that carry a choice, by qualified name: ``{"h.0": "full", ...}``."""
    return {name: m.__dict__[TREATED].choice for name, m in model.named_modules() if TREATED in m.__dict__}
