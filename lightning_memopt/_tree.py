"""The tensors in a call's arguments or results (one walk for every part of the package that needs them), and
their values read back to the host together (:func:`numbers`)."""

from __future__ import annotations

import torch

__all__ = ["numbers", "tensors"]


def tensors(value, found: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in ``value`` (nested tuples, lists and dicts), in order, appended to ``found`` if given.

    Plain containers only: an op's arguments and a block's inputs nest no deeper, and a general pytree
    walk (``torch.utils._pytree``) cost a third of a ``MemoryTracker``'s time per op.

    Example::

        >>> a, b = torch.zeros(1), torch.ones(2)
        >>> [t.shape[0] for t in tensors(((a, 3), {"x": [b]}))]
        [1, 2]
    """
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            tensors(item, found)
    return found


def numbers(values: list) -> list[float]:
    """``values`` (Python numbers and one-element tensors) as floats, the tensors read back together: one
    transfer per device, not one per value (each read waits for the device's queued work, and a GPU idles
    until the next launch).

    Example::

        >>> numbers([torch.tensor(3), 0.5, torch.tensor([2.0])])
        [3.0, 0.5, 2.0]
    """
    out = [float(v) if not isinstance(v, torch.Tensor) else None for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for device, at in by_device.items():
        wide = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        read = torch.stack([values[i].detach().reshape(()).to(wide) for i in at]).tolist()
        for i, number in zip(at, read):
            out[i] = number
    return out
