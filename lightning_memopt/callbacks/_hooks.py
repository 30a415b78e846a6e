"""Running code around a LightningModule's own hooks (``configure_model``, ``on_load_checkpoint``).

A callback cannot act between ``configure_model`` and the strategy's wrapping, so the callbacks that must
(BatchNormToGroupNorm, AutoCheckpoint) wrap the module *instance's* public hook and unwrap it at teardown.
Several callbacks may wrap the same hook and tear down in any order; each removal leaves the others'
wrappers working and, once all are removed, the instance as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


def wrap_instance_hook(
    obj: Any,
    name: str,
    *,
    before: Callable[..., None] | None = None,
    after: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """Make ``obj.name(...)`` call ``before(...)`` first and ``after()`` last; returns the function that
    undoes it."""
    previous = obj.__dict__.get(name, _MISSING)
    original = getattr(obj, name)
    active = [True]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if active[0] and before is not None:
            before(*args, **kwargs)
        out = original(*args, **kwargs)
        if active[0] and after is not None:
            after()
        return out

    wrapper._memopt_wrap = (active, previous)  # type: ignore[attr-defined]
    obj.__dict__[name] = wrapper

    def remove() -> None:
        active[0] = False  # inside a chain, this wrapper now only passes the call on
        current = obj.__dict__.get(name, _MISSING)
        # Peel off every removed wrapper on top of the chain.
        while (link := getattr(current, "_memopt_wrap", None)) is not None and not link[0][0]:
            current = link[1]
        if current is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            obj.__dict__[name] = current

    return remove
