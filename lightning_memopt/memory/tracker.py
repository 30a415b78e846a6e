"""MemoryTracker: live tensor bytes by category, on any device, fake tensors included.

How it counts. While the tracker is entered, a ``TorchDispatchMode`` sees every tensor op; each
storage an op reads or writes is registered once (views and tensors sharing a storage are one entry)
and a weak reference to the storage tells when it is freed. The running total is therefore the bytes
of live storages the tracked code touched, plus the model's parameters and buffers, their gradients
and the optimizer's state, which are registered on entry. This is exact and deterministic: it does not
depend on an allocator, so it gives the same numbers on CPU, on CUDA (storages rounded up to the
caching allocator's 512-byte blocks), on ``meta`` tensors and under ``FakeTensorMode``, where nothing is
allocated at all and the tracker predicts the memory of a model that was never built.

Categories, in order of precedence (a storage takes the first that applies, and never moves down):

==================  ================================================================================
``parameters``      parameters and buffers of the tracked modules
``gradients``       ``.grad`` of those parameters (marked when autograd accumulates them)
``optimizer_state`` tensors in the tracked optimizers' ``state`` (marked after each ``step``)
``activations``     tensors autograd holds for backward (through ``saved_tensors_hooks``), while it does
``other``           everything else: inputs, outputs, temporaries
==================  ================================================================================

A storage's category is what it turns out to be: when a live storage is recognized later (a gradient
as soon as it is accumulated, optimizer state after the step that created it), the breakdown of the
peak it was part of is corrected too, so ``peak_breakdown`` always sums to ``peak``.

The output head (``peak_head``, ``current_head``). A language model's last layer turns each token into
vocabulary-sized logits, and what follows it (the loss, its gradient) holds tensors of that size. The
tracker counts them as a figure of their own, *inside* the categories (a part of ``activations`` and
``other``, not a sixth category): the bytes of live ``activations`` and ``other`` storages made by
ops while a head is *open* (not inputs first seen then, such as a batch's labels). A head opens when
the forward of a module given as ``heads`` starts, or when
:func:`~lightning_memopt.head.linear_cross_entropy` is called (the package's chunked head, which calls
:func:`open_head`); it closes when autograd has computed the gradient w.r.t. the head's input (that
gradient belongs to the model below the head and is not counted), or when the tracker is exited. So
a Hugging Face causal LM's own head counts its logits, the log-softmax ``cross_entropy`` saves, and in
backward the logits-sized gradients; the chunked head counts its one chunk's logits and the gradients it
computes in forward and holds until backward. A storage recognized later as a parameter's gradient
(the head weight's) leaves the head figure, at the peak too, as it leaves ``other``.

Costs: one Python call per tensor op while entered (a few microseconds each), so a tracked step runs
noticeably slower than an untracked one on small tensors. One difference in what runs: while any dispatch
mode is active, autograd sums the gradients of a tensor used twice (a tied embedding, a residual input)
out of place, where without one it may add the second into the first; at such a sum the tracked run holds
one gradient-sized tensor more than an untracked one (``benchmarks/head.py`` shows it on GPT-2's tied
embedding: 147 MiB at the end of backward).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from lightning_memopt._tree import tensors

__all__ = ["MemoryTracker", "CATEGORIES", "allocated_bytes", "open_head", "state_bytes", "tensor_bytes"]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")
HEAD = "head"
"""The output head's figure beside the categories (a part of two of them; module docstring)."""
_RANK = {c: i for i, c in enumerate(CATEGORIES)}
_CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to this many bytes


@dataclass
class _Entry:
    nbytes: int
    base: str  # the category the storage has when autograd does not hold it
    born: int  # clock when the storage was first seen
    saved: int = 0  # how many of autograd's saved-tensor slots hold it now
    ever_saved: bool = False  # whether autograd has held it at all (an activation once, maybe no longer)
    head: bool = False  # made by an op while an output head was open

    @property
    def category(self) -> str:
        if self.saved and _RANK[self.base] > _RANK["activations"]:
            return "activations"
        return self.base

    def head_bytes(self, category: str) -> int:
        """Its bytes in the head figure if its category is ``category`` (only activations and other count)."""
        return self.nbytes if self.head and _RANK[category] >= _RANK["activations"] else 0


# Every tracker entered now, in entry order. The hooks below serve them all: autograd calls only the
# innermost saved-tensor hooks, and trackers are entered and exited in any order (a callback's tracker
# spans a batch, another's only its forward), so no hook may belong to a single tracker.
_ACTIVE: list[MemoryTracker] = []
TIMING: list = []
"""Every :class:`~lightning_memopt.memory.head_time.HeadTimer` timing a step now (:func:`open_head` serves
them with the trackers)."""
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


class _Saved:
    """What autograd holds instead of a saved tensor; its death means autograd let the tensor go."""

    __slots__ = ("tensor", "holders", "__weakref__")

    def __init__(self, tensor: torch.Tensor, holders: list[tuple[MemoryTracker, list[int]]]) -> None:
        self.tensor, self.holders = tensor, holders

    def __del__(self) -> None:
        for tracker, keys in self.holders:
            tracker._release(keys)


def _pack(t: torch.Tensor) -> _Saved:
    holders = [(tracker, tracker._hold(t)) for tracker in dict.fromkeys(_ACTIVE)]
    # Detached: a tensor saved by its own grad_fn (an output) would otherwise hold its graph, which
    # holds this object: a cycle through C++ that gc cannot see, leaking every graph that never ran
    # backward (an attempt that ran out of memory).
    return _Saved(t.detach(), holders)


def _unpack(saved: _Saved) -> torch.Tensor:
    return saved.tensor


def _resize(storage: torch.UntypedStorage, size: int):
    """``resize_`` is not a dispatched op (FSDP frees unsharded parameters with it): patched while any
    tracker is entered."""
    result = _ORIGINAL_RESIZE(storage, size)
    for tracker in dict.fromkeys(_ACTIVE):
        tracker._resized(storage)
    return result


def open_head(inputs: torch.Tensor) -> None:
    """An output head starts on ``inputs`` (its features): every entered tracker counts what is created from
    now on in its head figure, until the gradient w.r.t. ``inputs`` is computed (module docstring), and
    every :class:`~lightning_memopt.memory.head_time.HeadTimer` timing a step times the head until then.

    Called by :func:`~lightning_memopt.head.linear_cross_entropy`, and by a tracker's ``heads`` modules'
    forward; a loss of your own that replaces the logits can call it too.
    """
    for watcher in dict.fromkeys([*_ACTIVE, *TIMING]):
        watcher._open_head(inputs)


class HeadHooks:
    """What opens an output head for a tracker or a timer: the forward of one of its ``heads`` modules (on
    the forward's first tensor argument) or :func:`open_head`; each subclass says in ``_open_head`` what an
    open head means to it, and closes it with a hook on the input's gradient."""

    _handles: list

    def _hook_heads(self, heads: Iterable[torch.nn.Module]) -> None:
        for head in heads:
            self._handles.append(head.register_forward_pre_hook(self._head_forward))

    def _head_forward(self, module: torch.nn.Module, args: tuple) -> None:
        self._open_head(next((a for a in args if isinstance(a, torch.Tensor)), None))

    def _open_head(self, inputs: torch.Tensor | None) -> None:
        raise NotImplementedError


def _storages(t: torch.Tensor) -> list[tuple[torch.UntypedStorage, torch.device]]:
    """The storages behind ``t``; wrapper subclasses such as DTensor are unwrapped to their locals."""
    if is_traceable_wrapper_subclass(t):
        inner_names, _ = t.__tensor_flatten__()
        out: list[tuple[torch.UntypedStorage, torch.device]] = []
        for name in inner_names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                out.extend(_storages(inner))
        return out
    try:
        return [(t.untyped_storage(), t.device)]
    except (NotImplementedError, RuntimeError):  # sparse or otherwise storage-less tensors
        return []


def allocated_bytes(nbytes: int, device: torch.device) -> int:
    """The bytes a storage of ``nbytes`` takes as a tracker counts them: rounded up to the CUDA caching
    allocator's 512-byte blocks on CUDA, as they are elsewhere.

    Example::

        >>> allocated_bytes(100, torch.device("cuda")), allocated_bytes(100, torch.device("cpu"))
        (512, 100)
    """
    return -(-nbytes // _CUDA_BLOCK) * _CUDA_BLOCK if device.type == "cuda" else nbytes


def _size(storage: torch.UntypedStorage, device: torch.device) -> int:
    return allocated_bytes(storage.nbytes(), device)


class _DispatchHook(TorchDispatchMode):
    """Registers every tensor an op reads or writes with every entered tracker."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        trackers = dict.fromkeys(_ACTIVE)
        if trackers:
            inputs = tensors((args, kwargs))
            outputs = tensors(out)
            for tracker in trackers:
                # Inputs first: an input seen for the first time existed before the op (a batch's labels),
                # and only storages the op made can be the output head's (an output viewing an input is
                # already registered as that input).
                for t in inputs:
                    tracker._register(t, "other")
                for t in outputs:
                    tracker._register(t, "other", made=True)
                tracker._update_peak()
        return out


class MemoryTracker(HeadHooks):
    """Count live tensor storage bytes by category while code runs.

    Args:
        modules: A module or modules whose parameters and buffers (and their gradients) are
            categorized as such. Optional: without it every byte is ``other`` or ``activations``.
        optimizers: An optimizer or optimizers whose state is categorized as ``optimizer_state``;
            Lightning's ``LightningOptimizer`` wrappers are accepted.
        heads: A module or modules that are output heads (a Hugging Face causal LM's ``lm_head``): from
            the start of their forward the tracker counts :attr:`peak_head` (module docstring). Optional:
            calls of :func:`~lightning_memopt.head.linear_cross_entropy` are counted without it.

    The tracker can be entered more than once; each entry continues the same counts. Peak and
    breakdowns are plain ``int`` bytes. See the module docstring for what is counted and what it costs.

    Example::

        >>> model = torch.nn.Linear(4, 4)
        >>> with MemoryTracker(model) as tracker:
        ...     model(torch.ones(2, 4)).sum().backward()
        >>> tracker.peak_breakdown["parameters"], tracker.current_breakdown["gradients"]
        (80, 80)
    """

    def __init__(
        self,
        modules: torch.nn.Module | Iterable[torch.nn.Module] | None = None,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        *,
        heads: torch.nn.Module | Iterable[torch.nn.Module] | None = None,
    ) -> None:
        self._modules = _modules(modules)
        self._optimizers = _optimizers(optimizers)
        self._heads = _modules(heads, name="heads")
        self._head_open = False  # whether an output head is open (module docstring)
        self._head_current = 0
        self._peak_head = 0
        self._entries: dict[int, _Entry] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._current = dict.fromkeys(CATEGORIES, 0)
        self._total = 0
        self._peak = 0
        self._peak_breakdown = dict.fromkeys(CATEGORIES, 0)
        self._peak_clock = -1
        self._most_activations = 0  # the largest ``activations`` seen since entry (or reset_peak)
        self._clock = 0
        self._handles: list = []
        self._stack: list = []

    # ------------------------------------------------------------------ results
    @property
    def current(self) -> int:
        """Bytes of tracked storages alive now."""
        return self._total

    @property
    def current_breakdown(self) -> dict[str, int]:
        """Bytes alive now, by category."""
        return dict(self._current)

    @property
    def peak(self) -> int:
        """The largest ``current`` seen since entry or the last :meth:`reset_peak`."""
        return self._peak

    @property
    def most_activations(self) -> int:
        """The most bytes of ``activations`` alive at once since entry or the last :meth:`reset_peak`: what
        a forward held when its backward began, even after a backward freed them (micro-batches)."""
        return self._most_activations

    @property
    def peak_breakdown(self) -> dict[str, int]:
        """Bytes by category at the moment of ``peak``; the values sum to ``peak``."""
        return dict(self._peak_breakdown)

    @property
    def current_head(self) -> int:
        """Bytes alive now that the output head created (module docstring); part of ``current``."""
        return self._head_current

    @property
    def peak_head(self) -> int:
        """Of ``peak``, the bytes the output head created (module docstring); part of the ``activations``
        and ``other`` of ``peak_breakdown``."""
        return self._peak_head

    @property
    def peak_figures(self) -> dict[str, int]:
        """``peak_breakdown`` and, under ``"head"``, ``peak_head``: what a memory record keeps of a peak."""
        return {**self._peak_breakdown, HEAD: self._peak_head}

    def reset_peak(self) -> None:
        """Start a new peak window from the current bytes (like ``torch.cuda.reset_peak_memory_stats``)."""
        self._peak = self._total
        self._peak_breakdown = dict(self._current)
        self._peak_head = self._head_current
        self._peak_clock = self._clock
        self._most_activations = self._current["activations"]

    def category_of(self, tensor: torch.Tensor) -> str | None:
        """The category of ``tensor``'s storage, or None if the tracker has not seen it."""
        entries = [self._entries.get(id(s)) for s, _ in _storages(tensor)]
        return entries[0].category if entries and entries[0] is not None else None

    def was_saved(self, tensor: torch.Tensor) -> bool:
        """Whether autograd has held ``tensor``'s storage for backward since the tracker saw it, now or
        before (a micro-batch's input, which its backward let go): its bytes counted as activations then."""
        entries = [self._entries.get(id(s)) for s, _ in _storages(tensor)]
        return bool(entries) and entries[0] is not None and entries[0].ever_saved

    def bytes_of(self, tensor: torch.Tensor) -> int:
        """The bytes the tracker counts for ``tensor``'s storages (the whole storages, as a CUDA allocator's
        blocks hold them; 0 for those it has not seen)."""
        entries = [self._entries.get(id(s)) for s, _ in _storages(tensor)]
        return sum(entry.nbytes for entry in entries if entry is not None)

    # ------------------------------------------------------------------ marking
    def track_modules(self, *modules: torch.nn.Module) -> None:
        """Add modules after construction (e.g. layers created in ``configure_model``)."""
        modules = tuple(_modules(modules))
        self._modules.extend(modules)
        if self._stack:
            self._mark_modules(modules)

    def track_heads(self, *modules: torch.nn.Module) -> None:
        """Add output heads after construction (see ``heads``)."""
        modules = tuple(_modules(modules, name="heads"))
        self._heads.extend(modules)
        if self._stack:
            self._hook_heads(modules)

    def track_optimizers(self, *optimizers: torch.optim.Optimizer) -> None:
        """Add optimizers after construction (Lightning creates them after the model)."""
        opts = _optimizers(optimizers)
        self._optimizers.extend(opts)
        if self._stack:
            self._mark_optimizers(opts)

    def mark(self, tensor: torch.Tensor, category: str) -> None:
        """Register ``tensor``'s storage under ``category`` (for memory this tracker cannot see itself,
        such as tensors cached by selective activation checkpointing)."""
        if category not in _RANK:
            raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
        self._register(tensor, category)
        self._update_peak()

    # ------------------------------------------------------------------ context
    def __enter__(self) -> MemoryTracker:
        # Each entry pushes a dispatch mode and saved-tensor hooks that serve every entered tracker, so
        # nested trackers each see all ops and saved tensors, and exits in any order pop equivalent hooks.
        saved = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        mode = _DispatchHook()
        if not self._stack:
            self._hook_heads(self._heads)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _resize
        _ACTIVE.append(self)
        saved.__enter__()
        mode.__enter__()
        self._stack.append((mode, saved))
        self._mark_modules(self._modules)
        self._mark_optimizers(self._optimizers)
        self._update_peak()
        return self

    def __exit__(self, *exc) -> None:
        mode, saved = self._stack.pop()
        mode.__exit__(*exc)
        saved.__exit__(*exc)
        del _ACTIVE[len(_ACTIVE) - 1 - _ACTIVE[::-1].index(self)]
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE
        if not self._stack:
            self._close_head()
            for h in self._handles:
                h.remove()
            self._handles.clear()

    # ------------------------------------------------------------------ internals
    def _mark_modules(self, modules: Iterable[torch.nn.Module]) -> None:
        for module in modules:
            for p in module.parameters():
                self._register(p, "parameters")
                if p.grad is not None:
                    self._register(p.grad, "gradients")
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))
            for b in module.buffers():
                self._register(b, "parameters")

    def _open_head(self, inputs: torch.Tensor | None) -> None:
        self._head_open = True
        if inputs is not None and inputs.requires_grad and torch.is_grad_enabled():
            # Removed at the last exit like the other hooks: a leaf's hook would stay on the tensor.
            self._handles.append(inputs.register_hook(self._input_grad))

    def _input_grad(self, grad: torch.Tensor) -> None:
        """Autograd computed the gradient w.r.t. the head's input: the head closes, without that gradient."""
        self._close_head()
        for storage, _ in _storages(grad):
            entry = self._entries.get(id(storage))
            if entry is not None and entry.head:
                self._set_head(entry, False)

    def _close_head(self) -> None:
        self._head_open = False

    def _set_head(self, entry: _Entry, head: bool) -> None:
        """Count ``entry`` in the head figure or not, now and (if it was alive then) at the peak."""
        before = entry.head_bytes(entry.category)
        entry.head = head
        change = entry.head_bytes(entry.category) - before
        self._head_current += change
        if entry.born <= self._peak_clock:
            self._peak_head += change

    def _mark_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            self._mark_state(opt)
            self._handles.append(opt.register_step_post_hook(lambda o, args, kwargs: self._mark_state(o)))
            for group in opt.param_groups:
                for p in group["params"]:
                    self._register(p, "parameters")

    def _mark_state(self, opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._register(value, "optimizer_state")
        self._update_peak()

    def _grad_hook(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._register(param.grad, "gradients")
            self._update_peak()

    def _hold(self, t: torch.Tensor) -> list[int]:
        """Autograd saved ``t``: its storages count as activations until :meth:`_release`."""
        self._register(t, "other")
        keys = [id(s) for s, _ in _storages(t)]
        for key in keys:
            entry = self._entries[key]
            before = entry.category
            entry.saved += 1
            entry.ever_saved = True
            self._moved(entry, before)
        self._update_peak()
        return keys

    def _release(self, keys: list[int]) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:  # the storage may already be gone
                before = entry.category
                entry.saved -= 1
                self._moved(entry, before, fix_peak=False)

    def _moved(self, entry: _Entry, before: str, fix_peak: bool = True) -> None:
        """Book ``entry``'s bytes under its category now instead of ``before``.

        With ``fix_peak``, a storage that was alive at the peak is re-booked there too: its category is
        what it turned out to be (a gradient was a gradient before the hook told us). When autograd
        releases a saved tensor, the peak keeps it as an activation: it was one then.
        """
        after = entry.category
        if after == before:
            return
        self._current[before] -= entry.nbytes
        self._current[after] += entry.nbytes
        self._grew(after)
        head = entry.head_bytes(after) - entry.head_bytes(before)
        self._head_current += head
        if fix_peak and entry.born <= self._peak_clock:
            self._peak_breakdown[before] -= entry.nbytes
            self._peak_breakdown[after] += entry.nbytes
            self._peak_head += head

    def _register(self, t: torch.Tensor, category: str, made: bool = False) -> None:
        """Count ``t``'s storages under ``category`` (or a category above it); ``made``: an op just made it."""
        for storage, device in _storages(t):
            key = id(storage)
            entry = self._entries.get(key)
            if entry is None:
                nbytes = _size(storage, device)
                self._clock += 1  # ticks per new storage, so "born after the peak" is exact
                entry = self._entries[key] = _Entry(
                    nbytes, category, self._clock, head=made and self._head_open
                )
                self._refs[key] = weakref.ref(storage, lambda _, key=key: self._freed(key))
                self._current[category] += nbytes
                self._grew(category)
                self._head_current += entry.head_bytes(category)
                self._total += nbytes
            elif _RANK[category] < _RANK[entry.base]:
                before = entry.category
                entry.base = category
                self._moved(entry, before)

    def _freed(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        self._refs.pop(key, None)
        if entry is not None:
            self._current[entry.category] -= entry.nbytes
            self._head_current -= entry.head_bytes(entry.category)
            self._total -= entry.nbytes

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._entries.get(id(storage))
        if entry is None:
            return
        nbytes = _size(storage, storage.device)
        self._current[entry.category] += nbytes - entry.nbytes
        self._grew(entry.category)
        self._head_current -= entry.head_bytes(entry.category)
        self._total += nbytes - entry.nbytes
        entry.nbytes = nbytes
        self._head_current += entry.head_bytes(entry.category)
        # A storage grown after the peak must not count towards the old peak's breakdown.
        self._clock += 1
        entry.born = self._clock
        self._update_peak()

    def _grew(self, category: str) -> None:
        """``category``'s bytes just grew: keep :attr:`most_activations` the largest seen."""
        if category == "activations" and self._current[category] > self._most_activations:
            self._most_activations = self._current[category]

    def _update_peak(self) -> None:
        if self._total > self._peak:
            self._peak = self._total
            self._peak_breakdown = dict(self._current)
            self._peak_head = self._head_current
            self._peak_clock = self._clock


def _modules(value, name: str = "modules") -> list[torch.nn.Module]:
    modules = _as_list(value, torch.nn.Module, name)
    for module in modules:
        # A string is iterable too: without this check MemoryTracker("model") fails only at entry.
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"{name} must be torch.nn.Module instances, got {module!r} ({type(module).__name__})"
            )
    return modules


def _optimizers(value) -> list[torch.optim.Optimizer]:
    # Lightning's LightningOptimizer wraps the torch optimizer as `_optimizer`.
    opts = [
        getattr(o, "_optimizer", o) for o in _as_list(value, (torch.optim.Optimizer, object), "optimizers")
    ]
    for opt in opts:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizers must be torch.optim.Optimizer instances, got {type(opt).__name__}")
    return opts


def _as_list(value, kind, name: str) -> list:
    if value is None:
        return []
    if isinstance(value, kind) and not isinstance(value, (list, tuple, set)):
        return [value]
    try:
        return list(value)
    except TypeError:
        raise TypeError(
            f"{name} must be one object or an iterable of them, got {type(value).__name__}"
        ) from None


def state_bytes(model, optimizers=()) -> int:
    """Bytes of ``model``'s parameters, their gradients (counted before the first backward allocates
    them) and the optimizers' state: what a training step holds besides activations."""
    with MemoryTracker(model, list(optimizers)) as tracker:
        held = tracker.current_breakdown
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return held["parameters"] + max(held["gradients"], trainable) + held["optimizer_state"]


def optimizer_state_to_come(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of state the optimizers' next step creates: what AdamW's first step allocates (two tensors per
    parameter and a step count), zero for an optimizer that holds state already (or keeps none).

    Measured, not assumed: a fresh optimizer of the same class and parameter groups steps once on fake
    tensors of the parameters' shapes (nothing allocated, no parameter changed), one per distinct shape,
    dtype and device of a group, its state counted once for each parameter of that kind (a parameter's
    state depends on the parameter alone: a 16-layer transformer has some 150 parameters of 8 kinds, and
    each fake optimizer op costs as much Python as a real one). An optimizer that cannot be rebuilt from
    its parameter groups counts 0, as before its first step.

    Example::

        >>> model = torch.nn.Linear(4, 3)  # 15 float32 parameters in two tensors
        >>> optimizer_state_to_come([torch.optim.AdamW(model.parameters())])  # 2 x 60 + 2 step counts
        128
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    total = 0
    for optimizer in optimizers:
        if optimizer.state:
            continue
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                groups, counted = [], []  # (a fake parameter of each kind, how many parameters it stands for)
                for group in optimizer.param_groups:
                    kinds: dict[tuple, int] = {}
                    for p in group["params"]:
                        local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor's shard
                        key = (tuple(local.shape), local.dtype, local.device)
                        kinds[key] = kinds.get(key, 0) + 1
                    params = []
                    for (shape, dtype, device), count in kinds.items():
                        fake = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
                        fake.grad = torch.zeros_like(fake)
                        params.append(fake)
                        counted.append((fake, count))
                    groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
                fresh = type(optimizer)(groups)
                fresh.step()
            total += sum(count * tensor_bytes(fresh.state.get(fake, {}).values()) for fake, count in counted)
        except Exception:  # a custom optimizer with other constructor arguments: as before its first step
            continue
    return total


def tensor_bytes(tensors: Iterable[object]) -> int:
    """Bytes of the tensors among ``tensors`` (other items are skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
