"""Snapshot and restore of everything a training step changes besides weights and optimizer state.

A step that runs out of memory half-way has already moved state that the retry must find as it was:
BatchNorm running statistics (module buffers), torchmetrics accumulators, random number generators
(dropout masks) and the GradScaler. :class:`StepState` captures them at the start of a step and puts
them back, so a retried step is bit for bit the step that would have run at the smaller size first.
Gradients are not captured: the engine zeroes them at the start of every step, so "as they were" is
"none" (:func:`drop_gradients`).

Plain torch; torchmetrics metrics are recognized by their attributes, not imported.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["StepState", "drop_gradients"]

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
        self._rng: dict[str, Any] = {}
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._metrics: list[tuple[torch.nn.Module, dict[str, Any]]] = []
        self._scaler: tuple[Any, dict[str, Any]] | None = None

    @classmethod
    def capture(cls, modules: Iterable[torch.nn.Module], scaler: Any = None) -> StepState:
        """Capture the current state of ``modules`` and the process's random number generators."""
        state = cls()
        state._rng = _rng_state()
        seen: set[int] = set()
        for module in modules:
            for buffer in module.buffers():
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
        _set_rng_state(self._rng)
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

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor copies this snapshot holds (buffers and metric states)."""
        total = sum(saved.numel() * saved.element_size() for _, saved in self._buffers)
        for _, saved in self._metrics:
            for value in saved.values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
        return total


def drop_gradients(modules: Iterable[torch.nn.Module]) -> None:
    """Set every parameter's ``.grad`` to None, freeing a failed attempt's partial gradients."""
    for module in modules:
        for p in module.parameters():
            p.grad = None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:  # numpy is optional
        pass
    if (
        torch.cuda.is_available() and torch.cuda.is_initialized()
    ):  # RNG, not memory: device.py is not concerned
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    if not state:
        return
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
