"""What a block's forward writes besides its outputs, so that a recomputation can be told apart from it.

Recomputing a block in backward reproduces its forward only if the block reads the same state both
times. A block that writes state while it runs breaks that: a recurrent cache kept as an attribute
(RecurrentGemma's ``recurrent_states``), a quantization observer's range (I-BERT's ``x_min``, rebound;
``torch.ao`` observers, written in place), a seed drawn and kept (Reformer's reversible layers), a draw
from Python's or NumPy's random generator (torch's own generator is restored by checkpointing). Such a
block cannot be checkpointed: its recomputation would see the state its forward left, and compute other
values, or other shapes (torch's ``CheckpointError``).

:class:`Snapshot` records a block's state before a forward (every sub-module's attributes by identity,
their tensors' version counters and, where asked, copies of their values) and the random generators' states;
:meth:`Snapshot.written` names what differs afterwards; :meth:`Snapshot.restore` puts it back.

A model can also write into a block's *inputs* after the block returned: xLSTM hands each block its
recurrent state tensors and copies the block's new state into them once it returns. The block's own state
is untouched, so no snapshot of it sees the write; the inputs' version counters do. :class:`Inputs` records
a forward's tensor inputs that torch's checkpoint does not save (those in a tuple, list or dict argument,
and keyword arguments): their versions, and a copy of each that needs no gradient (a recurrent state, a
cache, a mask); it hands a recomputation the copies of those written since, so that it reads what the
forward read. A tensor passed as a positional argument of its own is saved by checkpoint, which refuses
it in backward if it was written since.
BatchNorm's running statistics are left out: a training-mode BatchNorm's output does not depend on them,
and a recomputation does not update them (``apply.py`` freezes them while it runs). So is the one attribute
this package writes on a block it treats (:data:`TREATED`, read with :func:`treatment_state`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map

from lightning_memopt._rng import RngState

__all__ = ["TREATED", "Inputs", "Snapshot", "detach_state", "treatment_state"]

TREATED = "_memopt_checkpoint"
"""The instance attribute in which ``apply.py`` keeps a treated block's state (its treatment, its calls)."""

# A module's own bookkeeping (hooks, registries), the same on every instance: not state a forward writes.
_INTERNALS = frozenset(vars(nn.Module()))
_SKIP = frozenset({"forward", TREATED, "training"})  # this package's and train()'s
_BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _mark(value: Any) -> Any:
    """What identifies ``value`` cheaply: its identity, a tensor's version counter, a container's items'."""
    if isinstance(value, torch.Tensor):
        return (id(value), value._version)
    if isinstance(value, (list, tuple)):
        return (id(value), tuple(_mark(v) if isinstance(v, torch.Tensor) else id(v) for v in value))
    if isinstance(value, dict):
        return (id(value), tuple((k, id(v)) for k, v in value.items()))
    return id(value)


def _entries(block: nn.Module) -> list[tuple[dict, str, Any]]:
    """``(namespace, key, value)`` for every attribute and buffer of ``block``'s sub-modules."""
    out = []
    for module in block.modules():
        for key, value in vars(module).items():
            if key not in _INTERNALS and key not in _SKIP and not isinstance(value, nn.Module):
                out.append((vars(module), key, value))
        stats = _BN_STATS if isinstance(module, nn.modules.batchnorm._BatchNorm) else ()
        out += [(module._buffers, k, b) for k, b in module._buffers.items() if k not in stats]
    return out


def treatment_state(block: nn.Module) -> Any:
    """The state ``apply.py`` keeps on ``block`` while a treatment is installed on it; None where none is."""
    return block.__dict__.get(TREATED)


def detach_state(block: nn.Module) -> None:
    """Rebind every tensor attribute and buffer of ``block`` that belongs to a graph (a recurrent state a
    forward left) to a detached alias: a profile run of the block alone must not backward into the graph
    of a step that already ran its backward. Undo with a :class:`Snapshot` taken before."""
    for ns, key, value in _entries(block):
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            ns[key] = value.detach()


class Snapshot:
    """A block's state at one moment (see the module's docstring).

    Args:
        block: The block.
        values: Also copy the values of its tensors (buffers, tensor attributes), so that :meth:`restore`
            can undo in-place writes; otherwise only rebinding is undone.

    Example::

        >>> lin = nn.Linear(2, 2)
        >>> snap = Snapshot(lin)
        >>> lin.cache = torch.zeros(1)
        >>> snap.written()
        ['cache']
        >>> snap.restore()
        >>> hasattr(lin, "cache")
        False
    """

    def __init__(self, block: nn.Module, *, values: bool = False) -> None:
        self.block = block
        self.entries = [(ns, k, v, _mark(v)) for ns, k, v in _entries(block)]
        self.keys = {(id(ns), k) for ns, k, _, _ in self.entries}
        self.values = {
            id(v): v.detach().clone() for _, _, v, _ in self.entries if values and isinstance(v, torch.Tensor)
        }
        self.generators = RngState.capture()

    def written(self) -> list[str]:
        """What changed since the snapshot: attribute names (qualified from the block), and ``random``
        (Python's or NumPy's generator drew)."""
        names = {id(vars(m)): n for n, m in self.block.named_modules()} | {
            id(m._buffers): n for n, m in self.block.named_modules()
        }
        changed = [
            (ns, k) for ns, k, v, mark in self.entries if ns.get(k, _MISSING) is not v or _mark(v) != mark
        ]
        changed += [(ns, k) for ns, k, _ in _entries(self.block) if (id(ns), k) not in self.keys]
        out = [f"{names[id(ns)]}.{k}".lstrip(".") for ns, k in changed]
        if not RngState.capture().same_host(self.generators):
            out.append("random (Python's or NumPy's generator)")
        return sorted(set(out))

    def restore(self) -> None:
        """Put every attribute and buffer back as it was (values too, where copied); remove new ones."""
        for ns, k, _ in _entries(self.block):
            if (id(ns), k) not in self.keys:
                del ns[k]
        with torch.no_grad():
            for ns, k, v, mark in self.entries:
                ns[k] = v
                if id(v) in self.values and _mark(v) != mark:
                    v.copy_(self.values[id(v)])
        self.generators.restore_host()  # torch's own generator: checkpointing restores it


_MISSING = object()


class Inputs:
    """The tensor inputs of one forward of a block that checkpoint does not save, as the forward read them
    (the module's docstring).

    ``call`` runs the forward and, later, its recomputation: the first call is the forward's; a later one
    gets a copy of every such input written since (version counter moved) in its place. An input that needs
    a gradient is not copied (an activation: written after the block ran, no copy of it could take part in
    the graph): written, it raises.

    Args:
        args: The forward's positional arguments.
        kwargs: Its keyword arguments.

    Example::

        >>> state = torch.zeros(2)
        >>> inputs = Inputs(((state,),), {})
        >>> inputs.call(lambda s: s[0] + 1, ((state,),), {})  # the forward
        tensor([1., 1.])
        >>> _ = state.fill_(5.0)  # the model writes the block's input after the block returned
        >>> inputs.call(lambda s: s[0] + 1, ((state,),), {})  # the recomputation reads what the forward read
        tensor([1., 1.])
        >>> inputs.written
        ['args[0][0]']
    """

    def __init__(self, args: tuple, kwargs: dict) -> None:
        nested = {f"args[{i}]": a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}
        self.seen: list[tuple[str, torch.Tensor, int, torch.Tensor | None]] = []
        for path, t in tree_flatten_with_path({**nested, **kwargs})[0]:
            if isinstance(t, torch.Tensor) and all(t is not other for _, other, _, _ in self.seen):
                name = path[0].key + keystr(path[1:])  # args[1][0], state, position_embeddings[0]
                self.seen.append((name, t, t._version, None if t.requires_grad else _copy_of(t)))
        self.calls = 0
        self.written: list[str] = []
        """The inputs written between the forward and the last recomputation, by path (``args[1][0]``)."""

    def call(self, fn, args: tuple, kwargs: dict):
        """``fn(*args, **kwargs)``, the copies of inputs written since the forward in their place."""
        self.calls += 1
        if self.calls == 1:
            return fn(*args, **kwargs)
        changed = {id(t): (name, copy) for name, t, version, copy in self.seen if t._version != version}
        self.written = sorted({name for name, _ in changed.values()})
        stuck = [name for name, copy in changed.values() if copy is None]
        if stuck:
            raise RuntimeError(
                f"the model wrote the checkpointed block's input {', '.join(stuck)} in place after the block "
                "ran, and it needs a gradient: its recomputation cannot read what its forward read; leave "
                "the block out of checkpointing (AutoCheckpoint(blocks=...) or its plan)"
            )
        if not changed:
            return fn(*args, **kwargs)
        swap = {key: copy for key, (_, copy) in changed.items()}
        args, kwargs = tree_map(
            lambda v: swap.get(id(v), v) if isinstance(v, torch.Tensor) else v, (args, kwargs)
        )
        return fn(*args, **kwargs)


# One copy of a tensor many blocks are handed (a mask, rotary tables) per version, while a record holds it.
_COPIES: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}


def _copy_of(t: torch.Tensor) -> torch.Tensor:
    hit = _COPIES.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        copy = hit[2]()
        if copy is not None:
            return copy
    copy = t.detach().clone()
    key = id(t)

    def gone(ref: weakref.ref, key: int = key) -> None:
        if _COPIES.get(key, (None, None, None))[2] is ref:
            del _COPIES[key]

    _COPIES[key] = (weakref.ref(t), t._version, weakref.ref(copy, gone))
    return copy
