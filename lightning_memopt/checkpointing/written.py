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
BatchNorm's running statistics are left out: a training-mode BatchNorm's output does not depend on them,
and a recomputation does not update them (``apply.py`` freezes them while it runs). So is the one attribute
this package writes on a block it treats (:data:`TREATED`, read with :func:`treatment_state`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_memopt._rng import RngState

__all__ = ["TREATED", "Snapshot", "detach_state", "treatment_state"]

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
