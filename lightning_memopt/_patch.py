"""The one way the package replaces a method of an object for a while, and puts it back.

Lightning looks up the hooks and step methods it calls by name on the instance (``trainer.strategy``,
the LightningModule, a DataModule), so an instance attribute of the same name wins over the class's
method. :func:`patch` installs such an attribute and returns the function that removes it. Several
patches of one method stack; each may be removed in any order: a removed patch in the middle of a stack
only passes calls on, and once every patch is removed the instance is as it was (no attribute left
behind, so nothing of the package keeps the object or pickling of it busy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["patch"]

_MISSING = object()


def patch(obj: Any, name: str, wrapper: Callable[..., Any]) -> Callable[[], None]:
    """Make ``obj.name(*args, **kwargs)`` call ``wrapper(original, *args, **kwargs)``; return the undo.

    Args:
        obj: The instance whose method is replaced (on the instance only; the class is untouched).
        name: The method's name.
        wrapper: Called with the method as it was (bound, or the previous patch) and the call's
            arguments; its result is the call's result.

    Returns:
        A function that removes this patch (safe to call twice). While patched, the method counts as
        overridden for Lightning's ``is_overridden``, so a hook the user did not write (``configure_model``)
        is still called.
    """
    original = getattr(obj, name)
    previous = vars(obj).get(name, _MISSING)
    state = {"active": True}

    def patched(*args: Any, **kwargs: Any) -> Any:
        if state["active"]:
            return wrapper(original, *args, **kwargs)
        return original(*args, **kwargs)

    patched._memopt_patch = (state, previous)  # type: ignore[attr-defined]
    vars(obj)[name] = patched

    def undo() -> None:
        state["active"] = False  # inside a stack, this patch now only passes calls on
        current = vars(obj).get(name, _MISSING)
        # Peel off every removed patch on top of the stack.
        while (link := getattr(current, "_memopt_patch", None)) is not None and not link[0]["active"]:
            current = link[1]
        if current is _MISSING:
            vars(obj).pop(name, None)
        else:
            vars(obj)[name] = current

    return undo
