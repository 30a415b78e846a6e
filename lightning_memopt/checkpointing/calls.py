"""A block's call as values: its tensors' storages, what its op sequence may depend on, and its inputs
without a key/value cache (the tensors in it: :func:`lightning_memopt._tree.tensors`).

Shared by ``apply.py`` (which runs a block under a treatment), ``pointwise.py`` (which drops and remakes
the outputs of a block's sub-modules), ``dry_run.py`` (which runs a block on fake tensors) and
``capture.py`` (which records a block's inputs for profiling): all must agree on what a call's tensors
are, when two tensors are one storage, and which inputs a block runs on.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["call_signature", "is_kv_cache", "storage_key", "without_cache"]


def storage_key(t: torch.Tensor) -> int | None:
    """What identifies ``t``'s storage (views of one storage share it); None for tensors without one."""
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None


def call_signature(value) -> Hashable:
    """What the op sequence of a forward may depend on: the inputs' shapes, dtypes and devices, and the
    other arguments as ``repr`` shows them. It runs on every forward of a block under ``selective`` or
    ``pointwise``, so plain tuples, lists and dicts are walked here; other containers through pytree."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.device.type, value.requires_grad)
    kind = type(value)
    if kind is tuple or kind is list:
        return (kind.__name__, *map(call_signature, value))
    if kind is dict:
        return ("dict", *((k, call_signature(v)) for k, v in value.items()))
    if value is None or kind in (bool, int, float, str):
        return repr(value)
    leaves, spec = tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:  # a leaf
        return repr(value)
    return (str(spec), *map(call_signature, leaves))


def is_kv_cache(value) -> bool:
    """Whether ``value`` is a Hugging Face cache the block writes into (looked up only where transformers is
    loaded): a ``cache_utils.Cache``, or a model's own cache class (VoxtralRealtime's convolution padding
    cache is no ``Cache``, and a recomputation read the frames its forward had stored there)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return False
    kind = type(value)
    return isinstance(value, cache_utils.Cache) or (
        kind.__module__.startswith("transformers.") and kind.__name__.endswith("Cache")
    )


def without_cache(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The block's inputs with any key/value cache replaced by None and ``use_cache`` off.

    Hugging Face models default to ``use_cache=True``: every block appends its keys and values to a cache
    object passed in. A recomputation would append them again (the cache grows, attention sees twice the
    keys), and the cache would keep the very tensors checkpointing frees. Training never reads the cache,
    so a checkpointed block runs without it, as transformers' own gradient checkpointing does; blocks that
    declare they only read it (``_can_checkpoint_with_cache``) keep it.
    """
    if getattr(block, "_can_checkpoint_with_cache", False):
        return args, kwargs
    args = tuple(None if is_kv_cache(a) else a for a in args)
    kwargs = {k: None if is_kv_cache(v) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs
