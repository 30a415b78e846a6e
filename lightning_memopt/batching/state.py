"""Snapshot and restore of everything a training step changes besides weights and optimizer state, so a
retried step runs exactly as the step at the smaller size would have (plain torch).

Gradients are not captured: the engine zeroes them at the start of every step (:func:`drop_gradients`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch

from lightning_memopt._compat import untracked
from lightning_memopt._rng import RngState
from lightning_memopt.memory.tracker import tensor_bytes

__all__ = ["OptimizerSnapshot", "StepState", "drop_gradients", "host_copy", "local_tensor"]

# What a torchmetrics Metric keeps besides its registered states (``_defaults``); only those stored on
# the instance are restored (some versions make ``_update_called`` a read-only property).
_METRIC_EXTRAS = ("_update_count", "_computed", "_forward_cache", "_update_called")


def _is_metric(module: torch.nn.Module) -> bool:
    return (
        hasattr(module, "_defaults") and hasattr(module, "_reductions") and hasattr(module, "_update_count")
    )


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):  # list states ("cat" metrics): the tensors are never changed in place
        return list(value)
    return copy.copy(value)


class StepState:
    """The state of one step's start: RNGs, module buffers, torchmetrics states and a GradScaler.

    Args:
        modules: Modules whose buffers (BatchNorm statistics, ...) and torchmetrics submodules are
            captured; usually the LightningModule.
        scaler: A ``torch.amp.GradScaler`` (the precision plugin's) to capture, or None.

    Example::

        >>> bn = torch.nn.BatchNorm1d(3)
        >>> state = StepState.capture([bn])
        >>> _ = bn(torch.randn(4, 3))
        >>> state.restore()
        >>> bool(bn.running_mean.eq(0).all()), int(bn.num_batches_tracked)
        (True, 0)
    """

    def __init__(self) -> None:
        self._rng: RngState | None = None
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._metrics: list[tuple[torch.nn.Module, dict[str, Any]]] = []
        self._scaler: tuple[Any, dict[str, Any]] | None = None

    @classmethod
    def capture(
        cls, modules: Iterable[torch.nn.Module], scaler: Any = None, written: Iterable[torch.Tensor] = ()
    ) -> StepState:
        """Capture the current state of ``modules`` and the process's random number generators; ``written``:
        parameters the step writes in place (an EMA teacher), restored like buffers."""
        state = cls()
        state._rng = RngState.capture()
        seen: set[int] = set()
        for module in modules:
            for buffer in [*module.buffers(), *written]:
                if id(buffer) not in seen:  # a buffer shared by two modules is restored once
                    seen.add(id(buffer))
                    state._buffers.append((buffer, buffer.detach().clone()))
            for sub in module.modules():
                if _is_metric(sub):
                    saved = {name: _clone(getattr(sub, name)) for name in sub._defaults}
                    saved.update(
                        {name: _clone(getattr(sub, name)) for name in _METRIC_EXTRAS if name in vars(sub)}
                    )
                    state._metrics.append((sub, saved))
        if scaler is not None and getattr(scaler, "is_enabled", lambda: False)():
            state._scaler = (scaler, scaler.state_dict())
        return state

    def restore(self) -> None:
        """Put everything captured back in place (the captured copies stay valid for another restore)."""
        if self._rng is not None:
            self._rng.restore()
        with torch.no_grad():
            for buffer, saved in self._buffers:
                buffer.copy_(saved)
        for metric, saved in self._metrics:
            for name, value in saved.items():
                setattr(metric, name, _clone(value))
        if self._scaler is not None:
            scaler, saved = self._scaler
            scaler.load_state_dict(saved)
            # A step that failed after ``unscale_`` leaves the scaler believing this optimizer's gradients
            # are unscaled; the retry scales them again, so that record must go.
            per_optimizer = getattr(scaler, "_per_optimizer_states", None)
            if per_optimizer is not None:
                per_optimizer.clear()

    def drawn_since(self) -> bool:
        """Whether a random number has been drawn since this capture (or its restore)."""
        return self._rng is not None and not RngState.capture().same(self._rng)

    def same_rng(self, other: StepState) -> bool:
        """Whether no random number was drawn between ``other``'s capture and this one's."""
        return self._rng is not None and other._rng is not None and self._rng.same(other._rng)

    def tensors(self) -> list[torch.Tensor]:
        """The tensor copies this snapshot holds (buffers and metric states)."""
        copies = [saved for _, saved in self._buffers]
        for _, saved in self._metrics:
            copies += [value for value in saved.values() if isinstance(value, torch.Tensor)]
        return copies

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor copies this snapshot holds (buffers and metric states)."""
        return tensor_bytes(self.tensors())


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a sharded DTensor's local shard (its storage: copying into it writes the shard)."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is None:
        return tensor
    with torch.no_grad():
        return to_local()


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` (a DTensor's local shard) in host memory, which does not count as the device's,
    not even on a simulated one (:func:`~lightning_memopt._compat.untracked`)."""
    with untracked():
        return local_tensor(tensor).detach().to("cpu", copy=True)


class _Saved:
    """A host copy of an optimizer state tensor and the device it lives on."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.copy = host_copy(tensor)
        self.device = local_tensor(tensor).device


class OptimizerSnapshot:
    """Copies of optimizers' parameters and state, in host memory, to undo an optimizer step on every rank
    (each rank's local shard under FSDP2). State the step created is removed on restore.

    Args:
        optimizers: The optimizers whose parameters and state to copy.

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> before = model.weight.detach().clone()
        >>> snapshot = OptimizerSnapshot.capture([optimizer])
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> optimizer.step()
        >>> snapshot.restore()
        >>> torch.equal(model.weight, before), len(optimizer.state)
        (True, 0)
    """

    def __init__(self) -> None:
        self._params: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._states: list[tuple[Any, dict[Any, dict[str, Any]]]] = []

    @classmethod
    def capture(cls, optimizers: Iterable[torch.optim.Optimizer]) -> OptimizerSnapshot:
        """Copy the parameters of every param group of ``optimizers`` and their state."""
        snapshot = cls()
        seen: set[int] = set()
        for optimizer in optimizers:
            optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        snapshot._params.append((p, host_copy(p)))
            state = {
                p: {k: _Saved(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in st.items()}
                for p, st in optimizer.state.items()
            }
            snapshot._states.append((optimizer, state))
        return snapshot

    def restore(self) -> None:
        """Put the parameters and optimizer state back (the copies stay valid for another restore)."""
        with torch.no_grad():
            for p, saved in self._params:
                local_tensor(p).copy_(saved)
            for optimizer, state in self._states:
                for p in [p for p in optimizer.state if p not in state]:
                    del optimizer.state[p]  # created by the undone step
                for p, saved_state in state.items():
                    current = optimizer.state[p]
                    for key in [k for k in current if k not in saved_state]:
                        del current[key]
                    for key, saved in saved_state.items():
                        value = current.get(key)
                        if isinstance(saved, _Saved) and isinstance(value, torch.Tensor):
                            local_tensor(value).copy_(saved.copy)
                        elif isinstance(saved, _Saved):  # replaced by a non-tensor: put a tensor back
                            current[key] = saved.copy.to(saved.device, copy=True)
                        else:
                            current[key] = copy.deepcopy(saved)

    @property
    def nbytes(self) -> int:
        """Host bytes of the copies (parameters and optimizer state)."""
        total = sum(saved.numel() * saved.element_size() for _, saved in self._params)
        for _, state in self._states:
            for saved_state in state.values():
                for value in saved_state.values():
                    if isinstance(value, _Saved):
                        total += value.copy.numel() * value.copy.element_size()
        return total


def drop_gradients(modules: Iterable[torch.nn.Module]) -> None:
    """Set every parameter's ``.grad`` to None, freeing a failed attempt's partial gradients."""
    for module in modules:
        for p in module.parameters():
            p.grad = None
