"""What a callback attaches to a LightningModule for one fit, and the one way it is taken off again.

A callback cannot act between ``configure_model`` and the strategy's wrapping, so the callbacks that must
(BatchNormToGroupNorm, AutoCheckpoint) wrap the module *instance's* public hook and unwrap it after fit.
Several callbacks may wrap the same hook and unwrap in any order; each removal leaves the others'
wrappers working and, once all are removed, the instance as it was.

After ``fit`` (Lightning calls ``teardown`` when it ends normally and only ``on_exception`` when it
raises) nothing of a callback may stay on the model: a wrapper is a local function, so a model that keeps
one cannot be pickled by ``torch.save(model)``, and a callback that keeps a reference keeps the model
(and, through ``model.trainer``, the Trainer) alive. :class:`Attachments` collects what a callback
attached and :meth:`Attachments.detach` removes all of it; :class:`ReleasingCallback` is the one place
that calls a callback's clean-up from both hooks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from typing_extensions import override

from lightning_memopt._patch import patch

# Lightning binds the module's ``log``/``log_dict`` onto every callback at the start of each run
# (CallbackConnector._attach_model_logging_functions) and never removes them: bound methods that hold the
# model. They are attached again at the next fit/validate, so dropping them after a run costs nothing.
_LIGHTNING_BOUND = ("log", "log_dict")


def wrap_instance_hook(
    obj: Any,
    name: str,
    *,
    before: Callable[..., None] | None = None,
    after: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """Make ``obj.name(...)`` call ``before(...)`` first and ``after()`` last; returns the function that
    undoes it (:func:`~lightning_memopt._patch.patch`)."""

    def wrapper(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args, **kwargs)
        out = original(*args, **kwargs)
        if after is not None:
            after()
        return out

    return patch(obj, name, wrapper)


class Attachments:
    """Everything one callback attached for one fit, removed by one :meth:`detach`.

    Example::

        self._attached = Attachments()
        self._attached.wrap(pl_module, "configure_model", after=self._swap)  # in setup
        self._attached.detach(self)  # in teardown and in on_exception
    """

    def __init__(self) -> None:
        self._undo: dict[tuple[int, str], Callable[[], None]] = {}

    def wrap(
        self,
        obj: Any,
        name: str,
        *,
        before: Callable[..., None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        """:func:`wrap_instance_hook` once per ``(obj, name)``; a second call for the same hook does nothing."""
        key = (id(obj), name)
        if key not in self._undo:
            self._undo[key] = wrap_instance_hook(obj, name, before=before, after=after)

    def detach(self, callback: Any = None) -> None:
        """Remove every wrapper (safe to call twice) and the model's methods Lightning bound on ``callback``."""
        undo, self._undo = list(self._undo.values()), {}
        for remove in undo:
            remove()
        if callback is not None:
            forget_module(callback)


def forget_module(callback: Any) -> None:
    """Drop the module's methods Lightning bound onto ``callback`` (they keep the model alive)."""
    for name in _LIGHTNING_BOUND:
        if inspect.ismethod(callback.__dict__.get(name)):
            del callback.__dict__[name]


class ReleasingCallback(Callback):
    """A callback that lets go of the model when a run ends, however it ends.

    Lightning calls ``teardown`` when a run ends normally and only ``on_exception`` when it raises; both
    call :meth:`_release` (what the subclass attached for the run: wrappers, hooks, references), then
    drop the module's methods Lightning bound onto the callback. Subclasses override :meth:`_release`
    only; it must be safe to call twice and for runs that never set anything up.
    """

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end_run()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._end_run()

    def _end_run(self) -> None:
        self._release()
        forget_module(self)

    def _release(self) -> None:
        """Undo what this callback attached for the run (override)."""
