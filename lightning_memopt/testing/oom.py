"""Deterministic out-of-memory errors, for testing code that must survive them.

A real out-of-memory error needs an accelerator that is full; a test needs one that happens at a chosen
place, for a chosen reason, every time. :class:`OOMInjector` raises ``torch.OutOfMemoryError`` (with the
message a CUDA allocator would give, so every OOM detector recognizes it, Lightning's included):

- in a module's **forward** (a forward pre-hook for a micro-batch size cap, a forward hook for a bytes
  cap, so the module's own allocations are live when bytes are read),
- in its **backward** (an identity ``torch.autograd.Function`` put on the module's output, whose backward
  raises), or
- in the optimizer **step** (an optimizer step pre-hook; on every optimizer when none is given, so it
  also catches the optimizers Lightning creates inside ``fit``),

when the micro-batch (dim 0 of the module's input) is larger than ``max_size``, or when the live bytes
read from ``memory`` (a :class:`~lightning_memopt.memory.MemoryTracker`'s ``current``, or anything with
an ``allocated()`` method such as a :class:`~lightning_memopt.memory.device.DeviceMemory`) exceed
``max_bytes``. With neither cap it raises every time its other filters allow. It can be limited to some
ranks, to some global steps and to the first ``times`` errors, and counts what it did.

It is shipped in the package, not only in its tests, so that users can check that their own training
setup recovers from an OOM before a real one costs them a run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_memopt._checks import check_positive_int
from lightning_memopt.memory.units import format_bytes, parse_bytes

__all__ = ["InjectedOOM", "OOMInjector", "injected_error", "process_rank"]

Phase = Literal["forward", "backward", "step"]
_PHASES = ("forward", "backward", "step")


@dataclass(frozen=True)
class InjectedOOM:
    """One error an :class:`OOMInjector` raised."""

    phase: str
    """``"forward"``, ``"backward"`` or ``"step"``."""
    size: int | None
    """The micro-batch size the module last saw (dim 0 of its input), None if unknown."""
    bytes: int | None
    """The live bytes read from ``memory`` when it raised, None without ``memory``."""
    step: int | None
    """``step_fn()`` when it raised, None without ``step_fn``."""
    rank: int
    """The process's rank (0 outside ``torch.distributed``)."""


def process_rank() -> int:
    """This process's rank in ``torch.distributed``; 0 outside it."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _first_tensor(tree: Any) -> torch.Tensor | None:
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf
    return None


class _RaiseInBackward(torch.autograd.Function):
    """Identity in forward; in backward, asks the injector whether to raise."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, injector: OOMInjector, size: int | None) -> torch.Tensor:
        ctx.injector, ctx.size = injector, size
        return x.view_as(x)  # a view: no new memory, so byte counts are not disturbed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.injector._check("backward", ctx.size)
        return grad, None, None


class OOMInjector:
    """Raise a deterministic ``torch.OutOfMemoryError`` in forward, backward or the optimizer step.

    Install it with ``with OOMInjector(...):`` or :meth:`install` / :meth:`remove`; removing it takes away
    every hook it added, and an injector can be installed again after.

    Args:
        module: The module to watch. Its input's dim 0 is the micro-batch size; ``"forward"`` raises in
            its forward, ``"backward"`` in the backward of its output. Required for those two phases, and
            for ``"step"`` with ``max_size`` (the size is the module's last training input).
        phase: Where to raise: ``"forward"`` (default), ``"backward"`` or ``"step"``.
        optimizer: For ``"step"``: the optimizer whose ``step`` raises. Default None: every optimizer
            (torch's global step pre-hook), which also reaches optimizers created after install.
        max_size: Raise when the micro-batch size is larger than this. Default None: no size cap.
        max_bytes: Raise when the live bytes read from ``memory`` are more than this (int bytes or a
            string such as ``"64MiB"``). Default None: no bytes cap. Needs ``memory``.
        memory: Where live bytes are read: a ``MemoryTracker`` (its ``current``) or an object with an
            ``allocated()`` method. In forward it is read after the module ran, in backward when the
            gradient reaches the module's output, in step before the step runs.
        ranks: Raise only on these ranks (``torch.distributed.get_rank()``; 0 when not distributed).
            Default None: every rank.
        steps: Raise only when ``step_fn()`` returns one of these, e.g. ``steps={3}`` with
            ``step_fn=lambda: trainer.global_step``. Default None: any step.
        step_fn: Returns the current global step; required with ``steps``.
        times: Raise at most this many times, then never again until :meth:`reset`. Default None.
        training_only: For ``"forward"`` and ``"backward"``: only while the module is in training mode,
            so validation and prediction run untouched. Default True.

    With neither ``max_size`` nor ``max_bytes`` every watched call raises (subject to ``ranks``, ``steps``
    and ``times``): "the first forward of step 3 fails once" is
    ``OOMInjector(model, steps={3}, step_fn=..., times=1)``.

    Attributes:
        calls: How many times the hook ran (before any filter).
        raised: How many errors it raised.
        events: One :class:`InjectedOOM` per error raised.

    Raises:
        ValueError: For a bad argument (see each message).

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> with OOMInjector(model, max_size=8) as injector:
        ...     _ = model(torch.ones(8, 4))  # fits
        ...     try:
        ...         model(torch.ones(9, 4))
        ...     except torch.OutOfMemoryError as error:
        ...         print(str(error).split(".")[0])
        CUDA out of memory
        >>> injector.raised, injector.calls
        (1, 2)
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        *,
        phase: Phase = "forward",
        optimizer: torch.optim.Optimizer | None = None,
        max_size: int | None = None,
        max_bytes: int | str | None = None,
        memory: Any = None,
        ranks: Iterable[int] | None = None,
        steps: Iterable[int] | None = None,
        step_fn: Callable[[], int] | None = None,
        times: int | None = None,
        training_only: bool = True,
    ) -> None:
        optimizer = _check_target(module, phase, optimizer, max_size)
        max_bytes = _check_measure(max_size, max_bytes, memory)
        if steps is not None and step_fn is None:
            raise ValueError(
                "steps needs step_fn, a callable returning the global step (e.g. lambda: trainer.global_step)"
            )
        check_positive_int("times", times, meaning="how many errors to raise at most", none_ok=True)

        self.module = module
        self.phase = phase
        self.optimizer = optimizer
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.memory = memory
        self.ranks = None if ranks is None else frozenset(int(r) for r in ranks)
        self.steps = None if steps is None else frozenset(int(s) for s in steps)
        self.step_fn = step_fn
        self.times = times
        self.training_only = training_only
        self.calls = 0
        self.raised = 0
        self.events: list[InjectedOOM] = []
        self._last_size: int | None = None
        self._handles: list = []

    # ------------------------------------------------------------------ install / remove
    @property
    def installed(self) -> bool:
        """Whether the injector's hooks are in place."""
        return bool(self._handles)

    def install(self) -> OOMInjector:
        """Add the hooks; returns the injector. Installing twice is an error (it would raise twice)."""
        if self._handles:
            raise RuntimeError("this OOMInjector is already installed; call remove() first")
        module = self.module
        if self.phase == "forward":
            self._handles.append(module.register_forward_pre_hook(self._forward_pre, with_kwargs=True))
            if self.max_bytes is not None:
                self._handles.append(module.register_forward_hook(self._forward_post, with_kwargs=True))
        elif self.phase == "backward":
            self._handles.append(module.register_forward_hook(self._insert_backward, with_kwargs=True))
        else:
            if module is not None:
                self._handles.append(module.register_forward_pre_hook(self._remember_size, with_kwargs=True))
            if self.optimizer is not None:
                self._handles.append(self.optimizer.register_step_pre_hook(self._step_pre))
            else:
                self._handles.append(register_optimizer_step_pre_hook(self._step_pre))
        return self

    def remove(self) -> None:
        """Take away every hook this injector added (safe to call when not installed)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> None:
        """Zero the counters and the event list, so ``times`` counts again from zero."""
        self.calls = 0
        self.raised = 0
        self.events.clear()

    def __enter__(self) -> OOMInjector:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ------------------------------------------------------------------ hooks
    def _size_of(self, args: tuple, kwargs: dict) -> int | None:
        t = _first_tensor((args, kwargs))
        return None if t is None else int(t.shape[0])

    def _watching(self) -> bool:
        return not self.training_only or self.module.training

    def _forward_pre(self, module, args, kwargs) -> None:
        if not self._watching():
            return
        size = self._size_of(args, kwargs)
        self._last_size = size
        # With a bytes cap the decision waits for the forward hook, when the module's memory is live.
        if self.max_bytes is None:
            self._check("forward", size)

    def _forward_post(self, module, args, kwargs, output) -> None:
        if self._watching():
            self._check("forward", self._last_size)

    def _insert_backward(self, module, args, kwargs, output):
        if not self._watching() or not torch.is_grad_enabled():
            return None
        leaves, spec = tree_flatten(output)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                # One tensor only: a backward that reaches it once raises (or not) once.
                leaves[i] = _RaiseInBackward.apply(leaf, self, self._size_of(args, kwargs))
                return tree_unflatten(leaves, spec)
        return None

    def _remember_size(self, module, args, kwargs) -> None:
        if self._watching():
            self._last_size = self._size_of(args, kwargs)

    def _step_pre(self, optimizer, args, kwargs) -> None:
        self._check("step", self._last_size)

    # ------------------------------------------------------------------ decision
    def _read_bytes(self) -> int | None:
        memory = self.memory
        if memory is None:
            return None
        return int(memory.allocated() if hasattr(memory, "allocated") else memory.current)

    def _check(self, phase: str, size: int | None) -> None:
        self.calls += 1
        if self.times is not None and self.raised >= self.times:
            return
        rank = process_rank()
        if self.ranks is not None and rank not in self.ranks:
            return
        step = self.step_fn() if self.step_fn is not None else None
        if self.steps is not None and step not in self.steps:
            return
        live = self._read_bytes()
        reasons = []
        if self.max_size is not None and size is not None and size > self.max_size:
            reasons.append(f"micro-batch size {size} > max_size {self.max_size}")
        if self.max_bytes is not None and live > self.max_bytes:
            reasons.append(f"live bytes {live} > max_bytes {self.max_bytes}")
        capped = self.max_size is not None or self.max_bytes is not None
        if capped and not reasons:
            return
        self.raised += 1
        self.events.append(InjectedOOM(phase, size, live, step, rank))
        where = f"{phase} of {type(self.module).__name__}" if phase != "step" else "optimizer step"
        over = self.max_bytes is not None and live > self.max_bytes
        raise injected_error(
            rank,
            f"OOMInjector in {where}",
            "; ".join(reasons) or "unconditional",
            over=live - self.max_bytes if over else None,
            capacity=self.max_bytes if over else None,
        )


def injected_error(
    rank: int, where: str, reason: str, *, over: int | None = None, capacity: int | None = None
) -> torch.OutOfMemoryError:
    """The error, with what a CUDA allocator would say: the bytes over the cap, and the cap as capacity."""
    if over is not None:
        text = (
            f"Tried to allocate {format_bytes(over)}. GPU {rank} has a total capacity "
            f"of {format_bytes(capacity)} of which 0 bytes is free."
        )
    else:
        text = f"Tried to allocate 2.00 MiB. GPU {rank} has 0 bytes free."
    return torch.OutOfMemoryError(
        f"CUDA out of memory. {text} (Injected by lightning_memopt {where}: {reason}.)"
    )


def _check_target(
    module: Any, phase: str, optimizer: Any, max_size: int | None
) -> torch.optim.Optimizer | None:
    """Check where the injector watches (``module``, ``phase``, ``optimizer``); the unwrapped optimizer."""
    if phase not in _PHASES:
        raise ValueError(f"phase must be one of {_PHASES}, got {phase!r}")
    if module is not None and not isinstance(module, torch.nn.Module):
        raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if module is None and phase != "step":
        raise ValueError(f"phase={phase!r} needs the module to watch; pass module=")
    if module is None and max_size is not None:
        raise ValueError(
            "max_size needs a module whose input gives the micro-batch size; pass module= "
            "(for phase='step', the module's last training input is used)"
        )
    if optimizer is not None:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if phase != "step":
            raise ValueError(f"optimizer is only used with phase='step', got phase={phase!r}")
    return optimizer


def _check_measure(max_size: int | None, max_bytes: int | str | None, memory: Any) -> int | None:
    """Check what the injector compares (a size, or live bytes read from ``memory``); ``max_bytes`` in bytes."""
    check_positive_int(
        "max_size", max_size, minimum=0, meaning="the largest micro-batch that fits", none_ok=True
    )
    if max_bytes is not None:
        max_bytes = parse_bytes(max_bytes, name="max_bytes")
        if memory is None:
            raise ValueError(
                "max_bytes needs somewhere to read live bytes from; pass memory= (a MemoryTracker, "
                "or an object with an allocated() method)"
            )
    if memory is not None and not (hasattr(memory, "allocated") or hasattr(memory, "current")):
        raise ValueError(
            f"memory must be a MemoryTracker or have an allocated() method, got {type(memory).__name__}"
        )
    return max_bytes
