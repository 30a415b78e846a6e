"""Build a LightningModule and one batch on fake tensors: nothing is allocated, shapes and dtypes are real.

Under ``FakeTensorMode`` every tensor a constructor creates (parameters, buffers, initialisations) has a
shape, a dtype and a device but no data, so a 7B-parameter model builds in seconds on a laptop. The batch
comes from the config's DataModule (its first training batch, made for real, then converted: token ids
are small) or from shapes given on the command line (:func:`parse_batch_spec`).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._pytree import tree_map

__all__ = [
    "FakeBuildError",
    "load_class",
    "fake_mode",
    "build_fake",
    "fake_batch",
    "parse_batch_spec",
    "module_context",
]

# Errors that mean "this needs real data or a real kernel", raised by fake tensors.
_FAKE_ERRORS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
_DTYPES = {
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "bool": torch.bool,
}
_FIX = (
    "Fixes: give the batch as shapes (--batch 'input_ids=8x512:int64') so no data decides the control "
    "flow; build large layers in configure_model; or register a fake (meta) implementation for the "
    "custom op (torch.library.register_fake)."
)


class FakeBuildError(RuntimeError):
    """The model or its training step cannot run on fake tensors; the message names the module and a fix."""


def load_class(spec: str) -> type:
    """Import ``"package.module:Class"`` (or ``"package.module.Class"``).

    Raises:
        ValueError: If ``spec`` names no importable class.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"expected 'package.module:Class', got {spec!r}")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"cannot import {spec!r}: {exc}; pass 'package.module:Class' on the Python path"
        ) from exc
    if not isinstance(obj, type):
        raise ValueError(f"{spec!r} is a {type(obj).__name__}, not a class")
    return obj


def fake_mode() -> FakeTensorMode:
    """A fake-tensor mode that converts stray real tensors (module constants) instead of refusing them."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def build_fake(mode: FakeTensorMode, factory: Callable[[], nn.Module], *, what: str) -> nn.Module:
    """Call ``factory()`` on the meta device, then the module's ``configure_model`` (Lightning's hook) if it
    has one, and turn every parameter and buffer into a fake CPU tensor of ``mode``.

    Why meta first: constructors run no kernel there (initialisation is free), and ``module.to(dtype)``
    in a constructor works, which it does not on fake parameters (torch swaps those, and the swap refuses
    a tensor the fake mode holds a weak reference to). Tied parameters stay tied.

    Raises:
        FakeBuildError: If construction reads tensor values or runs an op without a meta implementation.
    """
    try:
        with torch.device("meta"):
            module = factory()
            if hasattr(module, "configure_model"):
                module.configure_model()
    except (*_FAKE_ERRORS, NotImplementedError, RuntimeError) as exc:
        if "meta" not in str(exc) and not isinstance(exc, _FAKE_ERRORS):
            raise
        raise FakeBuildError(
            f"building {what} without allocating failed: {type(exc).__name__}: {exc}. The constructor must not "
            f"read tensor values; move that setup into configure_model. {_FIX}"
        ) from exc
    _to_fake(module, mode)
    return module


def _to_fake(module: nn.Module, mode: FakeTensorMode) -> None:
    converted: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in converted:
            if t.device.type == "meta":
                new = mode.fake_tensor_converter.from_meta_and_device(mode, t, torch.device("cpu"))
            else:  # created with an explicit device: a real tensor, converted as is
                new = mode.from_tensor(t)
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            converted[id(t)] = new
        return converted[id(t)]

    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = fake(p)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = fake(b)


def fake_batch(mode: FakeTensorMode, batch: Any) -> Any:
    """``batch`` with every tensor replaced by a fake one of the same shape, dtype and device."""
    return tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)


_SHAPE = re.compile(
    r"^(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)=)?(?P<shape>\d+(?:x\d+)*)(?::(?P<dtype>[a-z0-9]+))?$"
)


def parse_batch_spec(specs: Sequence[str], mode: FakeTensorMode) -> Any:
    """Fake tensors from shape specs: ``"8x512"`` (int64), ``"x=8x3x224x224:float32"``.

    All named: a dict; all unnamed: a tuple (one spec alone: that tensor). Values are zeros, never read.

    Raises:
        ValueError: For a malformed spec, an unknown dtype, or named and unnamed specs mixed.
    """
    parsed = []
    for spec in specs:
        m = _SHAPE.match(spec.strip())
        if m is None:
            raise ValueError(
                f"batch spec {spec!r} is not NAME=DxDx...[:dtype] or DxD...[:dtype]; e.g. 'input_ids=8x512:int64'"
            )
        dtype_name = m["dtype"] or "int64"
        if dtype_name not in _DTYPES:
            raise ValueError(
                f"unknown dtype {dtype_name!r} in batch spec {spec!r}; use one of {sorted(_DTYPES)}"
            )
        shape = tuple(int(d) for d in m["shape"].split("x"))
        parsed.append((m["name"], shape, _DTYPES[dtype_name]))
    named = {name is not None for name, _, _ in parsed}
    if len(named) > 1:
        raise ValueError(f"batch specs {list(specs)} mix named and unnamed tensors; name all or none")
    with mode:
        tensors = [(name, torch.zeros(shape, dtype=dtype)) for name, shape, dtype in parsed]
    if named == {True}:
        return dict(tensors)
    return tensors[0][1] if len(tensors) == 1 else tuple(t for _, t in tensors)


@contextlib.contextmanager
def module_context(model: nn.Module, what: str) -> Iterator[None]:
    """Turn a fake-tensor failure inside ``model`` into a :class:`FakeBuildError` naming the innermost module."""
    stack: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}

    def push(module, args) -> None:
        if id(module) in names:
            stack.append(names[id(module)])

    def pop(module, args, output) -> None:  # returns None: a forward hook's result would replace the output
        if id(module) in names and stack:
            stack.pop()

    enter = nn.modules.module.register_module_forward_pre_hook(push)
    leave = nn.modules.module.register_module_forward_hook(pop)
    try:
        yield
    except (*_FAKE_ERRORS, RuntimeError) as exc:
        if isinstance(exc, FakeBuildError):
            raise
        where = stack[-1] if stack else "(outside any submodule)"
        kind = type(dict(model.named_modules()).get(where, model)).__name__
        why = (
            "Its Python control flow reads tensor values (or it calls an op without a fake kernel)."
            if isinstance(exc, _FAKE_ERRORS)
            else "If the same step runs on real tensors, an op's fake (meta) implementation differs from its "
            "real kernel."
        )
        raise FakeBuildError(
            f"{what} cannot run on fake tensors: module {where!r} ({kind}) raised {type(exc).__name__}: {exc}. "
            f"{why} {_FIX}"
        ) from exc
    finally:
        enter.remove()
        leave.remove()
