"""Will a DataLoader's workers start? Find the object that will not pickle, by its attribute path.

Under the ``spawn`` and ``forkserver`` start methods each worker receives the dataset, the collate
function and the ``worker_init_fn`` pickled (the sampler stays in the main process). A lambda or a local
function anywhere inside them fails there with an error that names the function but not where it sits
(``Can't pickle local object 'main.<locals>.<lambda>'``). :func:`find_unpicklable` pickles the same
objects before any worker starts and, when one fails, walks into it the way pickle does (the state that
``__reduce_ex__`` returns, container items, ``functools.partial`` parts, a bound method's object) to the
innermost object that fails: ``dataset.transform.transforms[1]``.

Tensors and NumPy arrays are not serialized (they always pickle, and copying a large dataset's tensors
would cost its size in memory and time): a :class:`pickle.Pickler` stands them in with nothing, and
writes into nothing. What remains costs one pickling of the dataset's Python objects (the DataLoader
itself does one per worker).
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.synchronize
import pickle
import types
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Unpicklable", "worker_start_method", "find_unpicklable", "check_picklable"]

_MAX_DEPTH = 12
_SENT_TO_WORKERS = ("dataset", "collate_fn", "worker_init_fn")


@dataclass(frozen=True)
class Unpicklable:
    """The object that will not pickle."""

    path: str
    """Where it sits, from the DataLoader: ``dataset.transform``, ``collate_fn``, ``dataset.items[3]``."""
    what: str
    """What it is (``a lambda defined at data.py:12``) and pickle's error."""

    def __str__(self) -> str:
        return f"{self.path} is {self.what}"


def worker_start_method(loader: Any) -> str:
    """How ``loader``'s workers start: ``"fork"``, ``"spawn"`` or ``"forkserver"``.

    The loader's ``multiprocessing_context`` (a name or a context) if set, else the process default,
    read without fixing it (``multiprocessing.get_start_method()`` would).
    """
    context = getattr(loader, "multiprocessing_context", None)
    if isinstance(context, str):
        return context
    if context is not None:
        return context.get_start_method()
    method = multiprocessing.get_start_method(allow_none=True)
    return method if method is not None else multiprocessing.get_context().get_start_method()


def find_unpicklable(loader: Any) -> Unpicklable | None:
    """The first object that ``loader``'s workers would fail to receive, or None if all pickle.

    Checks what the DataLoader sends to each worker: ``dataset``, ``collate_fn``, ``worker_init_fn``.
    """
    for name in _SENT_TO_WORKERS:
        obj = getattr(loader, name, None)
        if obj is not None:
            found = _culprit(obj, name, 0, set())
            if found is not None:
                return found
    return None


def check_picklable(loader: Any) -> None:
    """Raise before any worker starts if ``loader`` starts workers by pickling and something will not pickle.

    Does nothing for ``num_workers=0`` or the ``fork`` start method (workers inherit the objects).

    Raises:
        pickle.PicklingError: Naming the object's path and what it is, with the fix.
    """
    if not getattr(loader, "num_workers", 0) or worker_start_method(loader) == "fork":
        return
    found = find_unpicklable(loader)
    if found is not None:
        method = worker_start_method(loader)
        raise pickle.PicklingError(
            f"The DataLoader's workers cannot start: under the {method!r} start method every worker receives "
            f"the dataset, collate_fn and worker_init_fn pickled, and {found}. Define it at module level "
            "(a def, or a class with __call__; functools.partial of a module-level function also pickles), "
            "or pass multiprocessing_context='fork' where the platform has fork, or num_workers=0."
        )


class _NullPickler(pickle.Pickler):
    """Pickles into nothing; tensors and arrays are stood in by ``None`` (they always pickle)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) or _is_ndarray(obj):
            return (type(None), ())
        if isinstance(obj, multiprocessing.synchronize.SemLock):
            # Locks and semaphores travel to spawned workers only if made in a spawn-like context.
            if getattr(obj, "_is_fork_ctx", False):
                raise RuntimeError(
                    "a multiprocessing lock made in the 'fork' context cannot reach spawned workers; make it with "
                    "multiprocessing.get_context('spawn')"
                )
            return (type(None), ())
        return NotImplemented


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)


def _is_ndarray(obj: Any) -> bool:
    return type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray"


def _pickle_error(obj: Any) -> Exception | None:
    try:
        _NullPickler(_Sink(), protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    except RuntimeError as error:
        # multiprocessing locks and queues refuse plain pickling but travel fine while a worker spawns.
        return None if "through inheritance" in str(error) else error
    except Exception as error:  # pickle raises PicklingError, TypeError, AttributeError, ...
        return error
    return None


def _culprit(obj: Any, path: str, depth: int, seen: set[int]) -> Unpicklable | None:
    error = _pickle_error(obj)
    if error is None:
        return None
    if depth < _MAX_DEPTH and id(obj) not in seen:
        seen.add(id(obj))
        for child_path, child in _children(obj, path):
            found = _culprit(child, child_path, depth + 1, seen)
            if found is not None:
                return found
    return Unpicklable(path, _describe(obj, error))


def _children(obj: Any, path: str) -> list[tuple[str, Any]]:
    """What pickle serializes for ``obj``, each with its path."""
    if isinstance(obj, dict):
        return [(f"{path}[{key!r}]", value) for key, value in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"{path}[{i}]", value) for i, value in enumerate(obj)]
    if isinstance(obj, functools.partial):
        parts = [(f"{path}.func", obj.func)] + [(f"{path}.args[{i}]", a) for i, a in enumerate(obj.args)]
        return parts + [(f"{path}.keywords[{k!r}]", v) for k, v in obj.keywords.items()]
    if isinstance(obj, types.MethodType):
        return [(f"{path}.__self__", obj.__self__), (f"{path}.__func__", obj.__func__)]
    if isinstance(obj, (types.FunctionType, type)):
        return []  # pickled by reference: the function itself is the culprit
    try:
        reduced = obj.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    except Exception:
        return []  # the object itself refuses (a lock, an open file): it is the culprit
    if not isinstance(reduced, tuple):
        return []
    children = [(f"{path}.<arg {i}>", a) for i, a in enumerate(reduced[1]) if not isinstance(a, type)]
    state = reduced[2] if len(reduced) > 2 else None
    # State is the instance's __dict__, or (__dict__, slots) for classes with __slots__.
    for part in state if isinstance(state, tuple) else (state,):
        if isinstance(part, dict):
            children += [(f"{path}.{key}", value) for key, value in part.items()]
        elif part is not None:
            children.append((f"{path}.<state>", part))
    return children


def _describe(obj: Any, error: Exception) -> str:
    reason = f"{type(error).__name__}: {error}"
    if isinstance(obj, (types.FunctionType, type)):
        code = getattr(obj, "__code__", None)
        where = f" defined at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""
        if obj.__name__ == "<lambda>":
            return f"a lambda{where} ({reason})"
        if "<locals>" in obj.__qualname__:
            kind = "class" if isinstance(obj, type) else "function"
            return f"a local {kind} {obj.__qualname__}{where} ({reason})"
    cls = type(obj)
    if "<locals>" in cls.__qualname__:
        return f"an instance of the local class {cls.__qualname__} ({reason})"
    return f"a {cls.__module__}.{cls.__qualname__} object that does not pickle ({reason})"
