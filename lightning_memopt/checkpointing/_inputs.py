"""A block's call as values: the tensors in it and their storages.

Shared by ``apply.py`` (which runs a block under a treatment), ``pointwise.py`` (which drops and remakes
the outputs of a block's sub-modules) and ``dry_run.py`` (which runs a block on fake tensors): all must
agree on what a call's tensors are and when two tensors are one storage.
"""

from __future__ import annotations

import torch

__all__ = ["storage_key", "tensors"]


def tensors(value) -> list[torch.Tensor]:
    """The tensors in ``value`` (nested tuples, lists and dicts), in order; the first is the primary one."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    return []


def storage_key(t: torch.Tensor) -> int | None:
    """What identifies ``t``'s storage (views of one storage share it); None for tensors without one."""
    try:
        return t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None
