"""Helpers the checkpointing tests share."""

import gc
import weakref

import torch


def live_tensors() -> int:
    """How many tensors are alive now, after a collection (those earlier tests left included)."""
    gc.collect()
    return len(_tensors())


class LiveTensors:
    """Counts, when called, the tensors alive then (after a collection) that were not alive when it was
    made: a step that leaves any behind (held by a cycle through autograd's C++ nodes, which no collector
    frees) makes the count grow. Tensors an earlier test left, which a later collection frees, do not
    count, so the count does not depend on the tests run before."""

    def __init__(self) -> None:
        gc.collect()
        self._before = {id(t): weakref.ref(t) for t in _tensors()}

    def __call__(self) -> int:
        gc.collect()
        return sum(1 for t in _tensors() if (ref := self._before.get(id(t))) is None or ref() is not t)


def _tensors() -> list[torch.Tensor]:
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
