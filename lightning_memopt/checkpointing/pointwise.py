"""The ``pointwise`` treatment: a block's norms and activations recomputed in backward, without per-op dispatch.

Op-level selective checkpointing (``selective``) decides per op which outputs to keep: torch calls a
Python policy on every op of the forward, and replays the block's whole Python forward in backward. On a
CPU and on small blocks that machinery costs more time than the recompute it prices (on a 2-core CPU,
15-100% of a step at 1.00x FLOPs: ``benchmarks/checkpointing.py``). Most of what it drops, though, are the
outputs of a block's pointwise *sub-modules* (a LayerNorm's output, which the next linear layer saves; an
activation's) and of activations called as functions (``F.silu(w1(x)) * w3(x)``): those can be made again
from tensors autograd holds anyway, one at a time, as Megatron's ``recompute_modules`` does for modules.

Which sub-modules (found once per input signature, by one dry run on fake tensors,
:func:`pointwise_modules`): the outermost modules inside the block that

- run no compute-heavy op (matmul, convolution, attention), no random op, and write no tensor they did
  not create (an in-place op on their input, a BatchNorm's running statistics): recomputing them is
  cheap and gives the same values;
- are called once, and return one floating-point tensor of their own (not a view of an input) that
  their own ops do not save (a softmax's output is; a norm's or GELU's is not);
- whose output a later op outside them saves for backward, as it is or cast (under autocast a float32
  LayerNorm output reaches the next linear layer as a bf16 copy, which the linear saves: the copy goes,
  made again in backward by the module and the same cast); else there is nothing to drop; and whose
  inputs autograd holds anyway, or cost fewer bytes to keep than what goes (a bf16 input that an RMSNorm
  casts to float32 first: the float32 copy, the normalized tensor and the output go).

And, without a dry run, every output of ``gelu`` or ``silu`` that an op of the block saves: their own
backward keeps their input (read from the autograd node, ``_compat.saved_by``).

How (:func:`pointwise_forward`), two ways, both giving the plain run's gradients bit for bit (the same ops
on the same values):

- *Output only* (most modules: those whose own ops save, beyond their inputs and parameters, at most an
  eighth of their output's bytes, such as LayerNorm's mean and rstd; and the functional activations).
  While the block's forward runs, saved-tensor hooks give an op that saves such an output (or a view of
  it) a recipe instead of the tensor; every other tensor goes to the hooks in effect below (a
  ``MemoryTracker``'s), so they see what they would under keep. When the forward ends nothing holds the
  output. In backward, the first op that reads it runs the module's forward (or the activation) once
  more on its inputs, without grad (with grad under ``create_graph``, so second-order gradients flow
  through it), and the last lets it go. The module's own backward is the one its forward recorded.
- *Run again with grad* (modules whose own intermediates are large: a hand-written RMSNorm's normalized
  input). The module runs in the forward as it is, its autograd nodes recorded in the block's graph; the
  same hooks give each of its ops, for every tensor it saves but the module's inputs, parameters and
  buffers, a recipe naming the tensor by the order it was saved in, and the ops after it one for its
  output. The inputs are held as an op outside it would save them (one that is itself a dropped output
  stays dropped; any other goes to the hooks below, which a tracker counts). In backward, the first
  unpack runs the module once more, with grad, on those inputs (after FSDP's pre-backward hooks have
  gathered its parameters: that is when the block's backward unpacks anything), under hooks that collect
  what its ops save: one run makes the output and every saved tensor, and the last unpack lets them go.
  The forward's own nodes do the backward, so the module's input gradient sums with the block's other
  gradients in the plain graph's order (bit-equal under bf16 autocast too, where a gradient summed in
  another order can round to the neighbouring bf16 value).

An input changed in place after the forward (which keep's version check would refuse in backward) is
refused by both, naming the module; an output changed in place before an op saves it is saved as it is
(it is no longer what the module made). The treatment holds what ``selective`` holds where the block's dropped
tensors are all such outputs, plus the small tensors the output-only modules' own backward keeps, and
more where ``selective`` also drops other functional pointwise results (a residual sum, a reshaped copy):
the profile measures both, and the planner pays ``selective``'s dispatch only where it buys memory.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_memopt._compat import saved_by, saved_tensors_hooks_below, view_base
from lightning_memopt._tree import tensors
from lightning_memopt.checkpointing.calls import storage_key

__all__ = ["Pointwise", "pointwise_modules", "pointwise_forward"]


@dataclass(eq=False)  # compared by identity: `in stack`
class _Seen:
    """What the dry run saw of one sub-module."""

    calls: int = 0
    pure: bool = True
    """No compute-heavy op, no random op, no write to a tensor it did not create."""
    created: set = field(default_factory=set)
    inputs: list = field(default_factory=list)
    output: object = None
    saved_copies: dict = field(default_factory=dict)
    """Storages, with their bytes, that ops outside the module saved for backward and that are its output
    or a cast of it (autocast's bf16 copy of a LayerNorm's float32 output for the next linear layer)."""
    saved_inside: dict = field(default_factory=dict)
    """Storages the module's own ops saved for backward, with their bytes."""


class _Watch(TorchDispatchMode):
    """Attribute every op of the dry run to the sub-modules running it."""

    def __init__(self, stack: list[_Seen], is_compute: Callable) -> None:
        super().__init__()
        self.stack, self.is_compute = stack, is_compute
        self.keep: list = []  # every op's output stays referenced: a freed storage's key could be reused
        self.casts: dict = {}  # storage of a dtype cast's result -> storage of what it cast

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = []
        if func._schema.is_mutable:
            named = dict(zip((arg.name for arg in func._schema.arguments), args)) | kwargs
            written = [
                storage_key(t)
                for arg in func._schema.arguments
                if arg.alias_info is not None and arg.alias_info.is_write
                for t in tensors(named.get(arg.name))
            ]
        out = func(*args, **kwargs)
        self.keep.append(out)
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
            self.casts[storage_key(out)] = storage_key(args[0])
        impure = self.is_compute(func) or torch.Tag.nondeterministic_seeded in func.tags
        for seen in self.stack:
            seen.pure = seen.pure and not impure and all(k in seen.created for k in written)
            seen.created.update(storage_key(t) for t in tensors(out))
        return out


@dataclass(frozen=True)
class Pointwise:
    """The sub-modules (names relative to the block) the ``pointwise`` treatment recomputes in one block."""

    names: tuple[str, ...] = ()
    """All of them, in the order the forward first calls them."""
    rerun: tuple[str, ...] = ()
    """Those run again with grad in backward, so that their own intermediates go too (a hand-written
    RMSNorm's normalized input); the others only lose their output, recomputed without grad."""

    def __bool__(self) -> bool:
        return bool(self.names)


def pointwise_modules(block: nn.Module, dry_run: Callable[..., bool], *, is_compute: Callable) -> Pointwise:
    """The sub-modules of ``block`` the ``pointwise`` treatment recomputes (the rule: this module's
    docstring), learnt from one run of its forward on fake tensors.

    ``dry_run(pack=, mode=)`` runs the forward once with ``pack`` as its saved-tensor pack hook and the
    dispatch ``mode`` entered, and says whether it ran
    (:func:`~lightning_memopt.checkpointing.dry_run.dry_run`, the block and its inputs bound). Where the
    block does not run on fake tensors, none (the treatment then drops only the functional activations'
    outputs). ``is_compute(op)`` tells a compute-heavy op
    (:func:`~lightning_memopt.checkpointing.apply.is_compute_op`).
    """
    stack: list[_Seen] = []
    seen: dict[str, _Seen] = {}
    saved: set = set()
    kept: list = []  # saved tensors stay referenced (fake: no memory), so that no key is reused
    handles = []

    def pre(name):
        def hook(module, a, kw):
            s = seen.setdefault(name, _Seen())
            s.calls += 1
            s.inputs = tensors((a, kw))
            stack.append(s)

        return hook

    def post(module, a, kw, out):
        stack.pop().output = out

    def pack(t):
        key = storage_key(t)
        saved.add(key)
        kept.append(t)
        for s in stack:
            s.saved_inside[key] = _nbytes(t)
        made_from = {key, watch.casts.get(key)}
        for s in seen.values():
            if s not in stack and isinstance(s.output, torch.Tensor) and storage_key(s.output) in made_from:
                s.saved_copies[key] = _nbytes(t)

    watch = _Watch(stack, is_compute)
    for name, module in block.named_modules():
        if module is not block:
            handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        if not dry_run(pack=pack, mode=watch):  # a data-dependent op, an op fake tensors do not support
            return Pointwise()
        own = {storage_key(t) for t in (*block.parameters(), *block.buffers())}
        chosen = [n for n, s in seen.items() if _qualifies(s, saved, own)]
        # A module whose input only it would hold gives way to its own parts that qualify: they recompute
        # from what autograd holds anyway (FNet's output block: its LayerNorm alone, not the sum before it).
        chosen = [
            n
            for n in chosen
            if not (_newly_held(seen[n], saved, own) and any(c.startswith(n + ".") for c in chosen))
        ]
        names = tuple(n for n in chosen if not any(n.startswith(c + ".") for c in chosen))
        return Pointwise(names, tuple(n for n in names if not _holds_little(seen[n], own)))
    finally:
        for h in handles:
            h.remove()
        # The dry run's autograd nodes hold ``pack``, and through it what it reaches: the fake tensors,
        # whose nodes lead back (and to the block's real parameters, by their AccumulateGrad nodes). A
        # cycle through C++ no collector frees: emptied, the graph goes when the run's tensors do.
        for reached in (seen, kept, stack, watch.keep, watch.casts):
            reached.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _inside(s: _Seen, own: set) -> int:
    """Bytes the module's own ops save beyond its inputs and the block's parameters."""
    inputs = {storage_key(t) for t in s.inputs} | own
    return sum(b for k, b in s.saved_inside.items() if k not in inputs)


def _holds_little(s: _Seen, own: set) -> bool:
    """Whether the module's own ops save at most an eighth of its output's bytes (a LayerNorm's mean and
    rstd; nothing for a GELU): then dropping its output alone frees nearly what running it again with grad
    would."""
    return 8 * _inside(s, own) <= _nbytes(s.output)


def _qualifies(s: _Seen, saved: set, own: set) -> bool:
    out = s.output
    if s.calls != 1 or not s.pure or not isinstance(out, torch.Tensor) or not out.is_floating_point():
        return False
    key = storage_key(out)
    # Recomputing keeps the inputs: where autograd would not hold one anyway (a bf16 input that an RMSNorm
    # casts to float32 first), it must cost less than what goes: the output, and the module's own
    # intermediates where it runs again with grad.
    dropped = sum(s.saved_copies.values()) + (0 if _holds_little(s, own) else _inside(s, own))
    return (
        bool(s.saved_copies)
        and key in s.created
        and key not in s.saved_inside  # its recomputed output is only copied back, then dropped
        and key not in {storage_key(t) for t in s.inputs}
        and key not in own
        and dropped > _newly_held(s, saved, own)
    )


def _newly_held(s: _Seen, saved: set, own: set) -> int:
    """Bytes of the module's inputs that autograd would not hold but recomputing it keeps."""
    inputs = {storage_key(t): _nbytes(t) for t in s.inputs}
    return sum(b for k, b in inputs.items() if k not in saved and k not in own)


def _autocast_state(device: str) -> tuple[str, torch.dtype, bool]:
    """The autocast state a module ran under on ``device``, to run it again under the same."""
    return device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)


def _autocast_as(state: tuple[str, torch.dtype, bool]):
    """A context that runs under the autocast ``state`` (:func:`_autocast_state`); none where that is the
    state now (recomputing in backward, off in both: entering autocast costs more than a norm's op)."""
    device, dtype, enabled = state
    if torch.is_autocast_enabled(device) == enabled and (
        not enabled or torch.get_autocast_dtype(device) == dtype
    ):
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=dtype, enabled=enabled)


def _check_unchanged(label: str, inputs: list[torch.Tensor], versions: list[int]) -> None:
    """Refuse to recompute from inputs changed in place since the forward (keep's version check would
    refuse them in backward too)."""
    if [t._version for t in inputs] != versions:
        raise RuntimeError(
            f"an input of {label} was modified in place after its forward; the pointwise treatment "
            "cannot recompute it. Use 'selective' or 'full' for this block."
        )


def pointwise_forward(block: nn.Module, fn: Callable, args: tuple, kwargs: dict, found: Pointwise) -> object:
    """``fn(*args, **kwargs)`` (``block``'s forward) with the sub-modules ``found`` recomputed in backward
    (:func:`pointwise_modules`), and the outputs of functional activations (how: this module's docstring)."""
    recipes: dict = {}  # storage key of a dropped output -> its _Recipe (or _Rerun)
    running: list = []  # the _Rerun of each run-again module being called (None where grad is off)
    held = {storage_key(t) for t in tensors((args, kwargs))}
    try:
        below = saved_tensors_hooks_below() or (_hold, _unhold)
    except RuntimeError:  # saved-tensor hooks disabled here: nothing can be dropped
        return fn(*args, **kwargs)
    drops = _DroppedSaves(recipes, held, running, below, bool(found.rerun))
    with contextlib.ExitStack() as stack:
        for name in found.names:
            module = block.get_submodule(name)
            if name in found.rerun:
                hooks = _rerun_hooks(recipes, running, module, drops.hold)
                stack.callback(module.register_forward_pre_hook(hooks[0], with_kwargs=True).remove)
                stack.callback(module.register_forward_hook(hooks[1], with_kwargs=True).remove)
            else:
                record = functools.partial(_record, recipes, _own_forward(module))
                stack.callback(module.register_forward_hook(record, with_kwargs=True).remove)
        stack.enter_context(drops)
        out = None
        try:
            out = fn(*args, **kwargs)
        finally:
            # Every node that saved a tensor in the block holds the hooks, and through them ``recipes``,
            # whose recipes hold tensors leading back to those nodes: a cycle through C++ that no collector
            # frees. A backward breaks it (it lets each saved tensor go); a graph that never runs one (an
            # attempt that ran out of memory, which OOMBackoff retries; a forward only) would stay. So the
            # forward's end, raised or not, settles each recipe and lets ``recipes`` go; the packs keep
            # their own recipe.
            kept = {storage_key(t) for t in tensors(out)} | held
            for key, recipe in recipes.items():
                recipe.settle(keep=key in kept)
            recipes.clear()
    return out


def _own_forward(module: nn.Module) -> Callable:
    """The module's forward without its hooks: an instance ``forward`` where it has one, else its class's."""
    own = module.__dict__.get("forward")
    return own if own is not None else functools.partial(type(module).forward, module)


class _Recipe:
    """How to make a dropped output again: ``run(*args, **kwargs)`` on tensors autograd holds anyway.

    Made once per output; every op that saved the output (or a view of it) holds a :class:`_Packed` of
    it. The first to be unpacked in backward runs the recipe, the last lets the result go.
    """

    def __init__(
        self, label: str, run: Callable, args: tuple, kwargs: dict, output: torch.Tensor | None, autocast
    ) -> None:
        self.label, self.run, self.args, self.kwargs, self.autocast = label, run, args, kwargs, autocast
        self.inputs = tensors((args, kwargs))
        self.versions = [t._version for t in self.inputs]
        self.output: torch.Tensor | None = None  # until the forward ends (settle)
        self.offset = self.version = 0
        self.node = None  # what a cast of the output (autocast's) points back to
        self.pending = 0  # packs not unpacked yet
        self.made: tuple | None = None  # (output, the tensors its own ops saved) while packs are pending
        if output is not None:
            self.produced(output)

    def produced(self, output: torch.Tensor) -> None:
        """The output the module returned in the forward."""
        self.output, self.node = output, output.grad_fn
        self.offset, self.version = output.storage_offset(), output._version

    def settle(self, keep: bool) -> None:
        """At the end of the block's forward: an output the block passes on (or was given) stays held and
        is never recomputed; any other goes (the packs alone held it). No cast of it comes any more: the
        recipe lets its autograd node go."""
        self.node = None
        if not keep:
            self.output = None
        elif self.output is not None:  # its graph would lead back to the nodes holding this recipe
            self.output = self.output.detach()

    def value(self, index: int | None = None) -> torch.Tensor:
        """The output (``index`` None), or the ``index``-th tensor the module's own ops saved."""
        kept = index is None and self.output is not None
        made = self.made
        if made is None and not kept:
            _check_unchanged(self.label, self.inputs, self.versions)
            made = self._make()
        self.pending -= 1
        self.made = made if self.pending > 0 else None
        if kept:
            return self.output
        return made[0] if index is None else made[1][index]

    def _make(self) -> tuple:
        with _autocast_as(self.autocast):  # grad only under create_graph
            return self.run(*self.args, **self.kwargs), ()


class _Rerun(_Recipe):
    """A module whose own saved tensors go too: in backward one run of it, with grad, makes its output and
    every tensor its ops saved, matched to the forward's by the order they were saved in. The forward's
    autograd nodes stay in the graph, so its gradients sum as in the plain graph. Its inputs are held as
    the block's hooks hold what an op saves (``hold``: a dropped output as its recipe, any other tensor
    through the hooks below, where a tracker counts it as it counts what keep saves)."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, hold: tuple) -> None:
        leaves, self.spec = tree_flatten((args, kwargs))
        inputs = [v for v in leaves if isinstance(v, torch.Tensor)]
        device = inputs[0].device.type if inputs else "cpu"
        super().__init__(type(module).__name__, _own_forward(module), (), {}, None, _autocast_state(device))
        self.own = {storage_key(t) for t in (*inputs, *module.parameters(), *module.buffers())}
        self.leaves = [None if isinstance(v, torch.Tensor) else v for v in leaves]  # the other arguments
        self.held = [  # (argument, handle, version, requires_grad): hooks may hand back a detached tensor
            (i, hold[0](v), v._version, v.requires_grad)
            for i, v in enumerate(leaves)
            if isinstance(v, torch.Tensor)
        ]
        self.unhold, self.ours = hold[1], hold[2]
        self.saves = 0  # the forward's saves so far: the index of the next

    def _make(self) -> tuple:
        leaves = list(self.leaves)
        graph = torch.is_grad_enabled()  # create_graph: the tensors made stay differentiable
        for i, handle, version, grad in self.held:
            # held by _hold (no hooks below): its version is checked here, naming the module
            t = handle[0] if self.ours and type(handle) is tuple else self.unhold(handle)
            _check_unchanged(self.label, [t], [version])
            # without create_graph, a graph of its own, dropped once its saved tensors are read
            leaves[i] = t if graph and t.requires_grad == grad else t.detach().requires_grad_(grad)
        args, kwargs = tree_unflatten(leaves, self.spec)
        saved: list = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            # The rerun's nodes hold this hook as long as they live: what it keeps must not lead back to
            # them (a tensor with its grad_fn would: a cycle through C++ that no collector frees, every
            # step's tensors leaked). So ``saved`` is emptied below, and the node keeps a detached alias
            # (autograd attaches the graph again where a second-order gradient unpacks it).
            saved.append((t, t._version))
            return t.detach()

        with (
            torch.enable_grad(),
            _autocast_as(self.autocast),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            out = self.run(*args, **kwargs)
        made = list(saved)
        saved.clear()
        if len(made) != self.saves:
            raise RuntimeError(
                f"{self.label} saved {len(made)} tensors for backward when run again, {self.saves} in its "
                "forward; the pointwise treatment cannot recompute it. Use 'selective' or 'full' for this block."
            )
        if any(t._version != version for t, version in made):
            raise RuntimeError(
                f"{self.label} changes in place a tensor that one of its ops saved for backward; the "
                "pointwise treatment cannot recompute it (as keep, it would fail in backward)."
            )
        if graph:
            return out, [t for t, _ in made]
        return out.detach(), [t.detach() for t, _ in made]


def _rerun_hooks(recipes: dict, running: list, module: nn.Module, hold: tuple) -> tuple[Callable, Callable]:
    """Forward pre-hook and hook of a run-again module: a :class:`_Rerun` for each call with grad, in
    ``running`` while the call lasts, then under its output's storage in ``recipes``."""

    def pre(module, args, kwargs):
        running.append(_Rerun(module, args, kwargs, hold) if torch.is_grad_enabled() else None)

    def post(module, args, kwargs, out):
        rerun = running.pop()
        if rerun is not None and isinstance(out, torch.Tensor):
            rerun.produced(out)
            recipes[storage_key(out)] = rerun

    return pre, post


class _Packed:
    """What an op saved instead of a dropped tensor: the recipe, and where the tensor lies in the output,
    or, for a cast of the whole output (autocast's copy for a matmul; ``cast``: its dtype and shape), the
    cast; or, for a tensor the module's own ops saved (``index``), which of them."""

    __slots__ = ("recipe", "size", "stride", "offset", "cast", "index")

    def __init__(
        self, recipe: _Recipe, t: torch.Tensor, cast: torch.Tensor | None = None, index: int | None = None
    ) -> None:
        recipe.pending += 1
        self.recipe, self.size, self.stride, self.index = recipe, t.size(), t.stride(), index
        self.cast = None if cast is None else (cast.dtype, cast.shape)
        self.offset = t.storage_offset() - (recipe.offset if cast is None else cast.storage_offset())

    def unpack(self) -> torch.Tensor:
        if self.index is not None:
            return self.recipe.value(self.index)
        made = self.recipe.value()
        if self.cast is not None:  # the same ops, on the same values, as in the forward
            dtype, shape = self.cast
            made = made.view(shape).to(dtype)
        return made.as_strided(self.size, self.stride, made.storage_offset() + self.offset)


def _cast_of(cast: torch.Tensor, node, recipes: dict) -> _Recipe | None:
    """The recipe whose whole output (or a reshaping ``view`` of all of it, as GPT-2's ``Conv1D`` takes)
    ``cast`` is a dtype cast of, made just now (``node``: the cast's ``ToCopyBackward0``; autocast casts
    right before the op that saves the copy); a cast of part of the output, or of an output changed in
    place since, is not one. Else None."""
    if cast._version != 0 or not cast.is_contiguous():
        return None
    source = node.next_functions[0][0]
    if type(source).__name__ == "ViewBackward0":
        source = source.next_functions[0][0]  # a contiguous view of all of a contiguous output: a reshape
    for recipe in recipes.values():
        out = recipe.output
        if (
            recipe.node is source
            and out is not None
            and out._version == recipe.version
            and out.is_contiguous()
            and (out.numel(), out.device, out.layout) == (cast.numel(), cast.device, cast.layout)
        ):
            return recipe
    return None


def _record(recipes: dict, run: Callable, module: nn.Module, args: tuple, kwargs: dict, out) -> None:
    """Forward hook of a sub-module whose output alone is dropped: its recipe, found by the saving op."""
    if isinstance(out, torch.Tensor) and torch.is_grad_enabled():
        autocast = _autocast_state(out.device.type)
        recipes[storage_key(out)] = _Recipe(type(module).__name__, run, args, kwargs, out, autocast)


# Functional activations whose backward keeps their input: (name, how to run it again from its node).
_ACTIVATIONS: dict[str, tuple[str, Callable]] = {
    "GeluBackward0": (
        "gelu",
        lambda node: functools.partial(
            torch.ops.aten.gelu.default, approximate=saved_by(node, "approximate")
        ),
    ),
    "SiluBackward0": ("silu", lambda node: torch.ops.aten.silu.default),
}


def _activation_recipe(base: torch.Tensor, key, node, make: tuple[str, Callable]) -> _Recipe | None:
    """A recipe for ``base``, the output of a functional activation (``key``: its storage; ``node``: its
    autograd node; ``make``: its label and how to run it again from the node, from ``_ACTIVATIONS``), or
    None where it cannot be made again."""
    if base._version != 0:  # changed in place since the op made it (under no_grad)
        return None
    source = saved_by(node, "self")
    if storage_key(source) == key:  # computed in place
        return None
    label, run = make
    device = base.device.type  # the op ran on ``source`` as it is: no autocast around it again
    return _Recipe(label, run(node), (source,), {}, base, (device, torch.get_autocast_dtype(device), False))


def _hold(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A tensor saved as it is, where no hooks are below, with its version: autograd checks no version of
    a tensor that saved-tensor hooks packed, so :func:`_unhold` does, as autograd would without them (a
    tensor changed in place after an op saved it fails backward, as under keep, instead of giving another
    gradient). A tensor a recorded op made is held detached (an op's own output would lead back to the
    node holding it: a cycle); one without a ``grad_fn`` (a parameter, a dropout mask) as it is, as nothing
    leads back from it. A tuple, not an object: this runs for every tensor the block saves."""
    return (t if t.grad_fn is None else t.detach()), t._version


def _unhold(held: tuple[torch.Tensor, int]) -> torch.Tensor:
    t, version = held
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.dtype} {list(t.shape)}] is at version {t._version}; expected version "
            f"{version} instead (a tensor saved in a block under the pointwise treatment)"
        )
    return t


class _DroppedSaves(torch.autograd.graph.saved_tensors_hooks):
    """While the block's forward runs: an op that saves a dropped output (or a view or cast of it) saves
    its :class:`_Packed` instead, and so does every op of a run-again module (``running``; ``reruns``:
    whether the block has any) for what it creates; every other tensor goes to the hooks in effect below
    (``below``: a tracker's, else :func:`_hold`), so that they see what they would under keep. ``hold``:
    how a run-again module holds its inputs (as an op outside it saves them: a dropped output stays
    dropped), and gets them back."""

    def __init__(self, recipes: dict, held: set, running: list, below: tuple, reruns: bool) -> None:
        below_pack, below_unpack = below

        def outside(t: torch.Tensor):
            # Runs for every tensor an op of the block saves: one look at its storage, and at the node
            # that made it only where no recipe has it (a leaf, such as a weight, has none).
            key = storage_key(t)
            recipe = recipes.get(key)
            if recipe is None:
                if key in held:
                    return below_pack(t)
                base = view_base(t)
                node = base.grad_fn
                if node is None:
                    return below_pack(t)
                kind = type(node).__name__
                if kind in _ACTIVATIONS:
                    recipe = _activation_recipe(base, key, node, _ACTIVATIONS[kind])
                    if recipe is None:
                        return below_pack(t)
                    recipes[key] = recipe
                elif kind == "ToCopyBackward0" and recipes:
                    recipe = _cast_of(base, node, recipes)
                    return below_pack(t) if recipe is None else _Packed(recipe, t, base)
                else:
                    return below_pack(t)
            if t._version != recipe.version:  # changed in place since: not the recipe's
                return below_pack(t)
            return _Packed(recipe, t)

        def pack(t: torch.Tensor):
            rerun = running[-1] if running else None
            if rerun is not None:
                rerun.saves += 1
                if storage_key(t) not in rerun.own:
                    return _Packed(rerun, t, index=rerun.saves - 1)
            return outside(t)

        def unpack(packed):
            return packed.unpack() if type(packed) is _Packed else below_unpack(packed)

        self.hold = (outside, unpack, below_unpack is _unhold)
        super().__init__(pack if reruns else outside, unpack)
