"""HeadTimer: the seconds of a training step, and the output head's part of them.

The output head opens and closes as :class:`~lightning_memopt.memory.MemoryTracker` counts its bytes:
from the start of its forward (a ``heads`` module's, such as a Hugging Face causal LM's ``lm_head``, or a
call of :func:`~lightning_memopt.head.linear_cross_entropy`) until autograd has computed the gradient
w.r.t. its input. So a model's own head is timed with the loss after its logits and the backward of both,
and the chunked head with the gradients it computes in its forward. A head's seconds are the clock's
between those two points: what runs between the end of the forward and the start of the backward
(Lightning's hooks around ``backward``) is inside them, the rest of the model is not. The heads of one
step (one per micro-batch) add up; a head that never closes in its step (no backward through it) counts
nothing. A head opened while one is open is a part of it while the open one's input is still held (a
chunked loss called inside a head module's forward), else a new head (the open one's forward ended and its
backward never came: it ran out of memory, say). Heads on fake or meta tensors (predictions) are not timed.

The clock is the device's (:func:`~lightning_memopt.data.clock.step_clock`): CUDA events on CUDA, the
host's ``perf_counter`` elsewhere. Ended steps are read together, when asked (:meth:`HeadTimer.read`: on
CUDA one wait for the device, for the last of them), so timing never makes the loop wait at a step's end.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from lightning_memopt.data.clock import Clock, step_clock
from lightning_memopt.memory.tracker import TIMING, HeadHooks

__all__ = ["HeadTimer"]


class HeadTimer(HeadHooks):
    """Time training steps and the output heads in them (module docstring).

    Args:
        device: Where the steps run (its clock: CUDA events on CUDA, host time elsewhere).
        heads: The output head modules (a Hugging Face causal LM's ``lm_head``); calls of
            :func:`~lightning_memopt.head.linear_cross_entropy` are timed without them.
        clock: The clock (default: ``device``'s); tests pass a fake one.

    Example::

        >>> model, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 10)
        >>> timer = HeadTimer("cpu", [head])
        >>> timer.step_start()
        >>> torch.nn.functional.cross_entropy(head(model(torch.ones(2, 4))), torch.tensor([1, 2])).backward()
        >>> timer.step_end()
        >>> [(step, in_head)] = timer.read()
        >>> 0 < in_head < step
        True
        >>> timer.stop()
    """

    def __init__(
        self, device: torch.device | str, heads: Sequence[torch.nn.Module] = (), clock: Clock | None = None
    ):
        self.clock = clock if clock is not None else step_clock(device)
        self._heads = list(heads)
        self._handles: list = []  # the heads' forward pre-hooks, from the first step until stop()
        self._grad_hooks: list = []  # the open heads' input-gradient hooks, removed at each step's end
        self._step: Any = None  # the step's start mark; None outside a step
        self._open: tuple[Any, weakref.ref] | None = None  # the open head's start mark and input
        self._spans: list[tuple[Any, Any]] = []  # the step's closed heads: (start, end) marks
        self._ended: list[tuple[Any, Any, list[tuple[Any, Any]]]] = []  # ended steps' marks, not read yet

    def step_start(self) -> None:
        """A training step starts now; one still open (it never ended) is dropped."""
        self.drop()
        if not self._handles:
            self._hook_heads(self._heads)
        TIMING.append(self)
        self._step = self.clock.mark()

    def step_end(self) -> None:
        """The step ends now; :meth:`read` gives its seconds.

        Raises:
            RuntimeError: If no step was started.
        """
        if self._step is None:
            raise RuntimeError("step_end needs a step started; call step_start first")
        self._ended.append((self._step, self.clock.mark(), self._spans))
        self._spans = []
        self.drop()

    def read(self) -> list[tuple[float, float]]:
        """The seconds of each step ended since the last call, and of the output heads in it, in order
        (on CUDA after waiting for the last step's end on the device)."""
        if not self._ended:
            return []
        self.clock.settle(self._ended[-1][1])
        seconds = self.clock.seconds
        times = [
            (seconds(start, end), sum(seconds(a, b) for a, b in spans)) for start, end, spans in self._ended
        ]
        self._ended = []
        return times

    def stop(self) -> None:
        """Stop timing: drop an open step and the ended steps not read, and remove every hook (the end of a
        run; safe twice)."""
        self.drop()
        self._ended = []
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def drop(self) -> None:
        """Forget an open step, if any (one skipped before its end); nothing is timed until the next."""
        if self in TIMING:
            TIMING.remove(self)
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()
        self._step = self._open = None
        self._spans = []

    def _open_head(self, inputs: torch.Tensor | None) -> None:
        if self._step is None or (self._open is not None and self._open[1]() is not None):
            return  # outside a step, or inside the open head
        if inputs is None or not inputs.requires_grad or not torch.is_grad_enabled():
            return  # no backward will close it
        if isinstance(inputs, FakeTensor) or inputs.device.type == "meta":
            return
        self._open = (self.clock.mark(), weakref.ref(inputs))
        self._grad_hooks.append(inputs.register_hook(self._input_grad))

    def _input_grad(self, grad: torch.Tensor) -> None:
        if self._open is not None:
            self._spans.append((self._open[0], self.clock.mark()))
            self._open = None
