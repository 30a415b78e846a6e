"""Splitting one optimizer batch into micro-batches along dim 0, and weighting their losses.

Tensors, mappings, lists, tuples, namedtuples and dataclasses are split; plain values go to every
micro-batch, or are split when a list holds one per sample. Other objects need the module's
``split_batch(self, batch, sizes)`` hook or a ``split_fn``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_memopt._text import listed
from lightning_memopt._tree import numbers

__all__ = [
    "batch_size",
    "describe_split",
    "distinct_micro_batches",
    "largest_micro_batch",
    "micro_batch_sizes",
    "micro_batch_weights",
    "split_batch",
    "tensors_of",
]

_SCALARS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)


def _hook_hint(obj: Any) -> str:
    return (
        f"cannot split a batch containing {type(obj).__qualname__!r} into micro-batches; define "
        "`split_batch(self, batch, sizes)` on your LightningModule (return one batch per size, split "
        "along the sample dimension), or pass `split_fn=` to the callback"
    )


def tensors_of(batch: Any, path: str = "batch", *, strict: bool = True) -> list[tuple[str, torch.Tensor]]:
    """All tensors in ``batch`` with their paths (``batch['x']``, ``batch[1]``, ``batch.x``), in a fixed order.

    Raises:
        TypeError: For an object this module cannot look into (``strict=False``: it is skipped).
    """
    if isinstance(batch, torch.Tensor):
        return [(path, batch)]
    if isinstance(batch, Mapping):
        return [
            t for key, value in batch.items() for t in tensors_of(value, f"{path}[{key!r}]", strict=strict)
        ]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return [
            t
            for name, value in zip(batch._fields, batch)
            for t in tensors_of(value, f"{path}.{name}", strict=strict)
        ]
    if isinstance(batch, (list, tuple)):
        return [t for i, value in enumerate(batch) for t in tensors_of(value, f"{path}[{i}]", strict=strict)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [
            t
            for f in dataclasses.fields(batch)
            for t in tensors_of(getattr(batch, f.name), f"{path}.{f.name}", strict=strict)
        ]
    if isinstance(batch, _SCALARS) or not strict:
        return []
    raise TypeError(_hook_hint(batch))


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: dim 0 of its first tensor that has dims (as Lightning counts).

    Raises:
        TypeError: If the batch holds an object this module cannot look into.
        ValueError: If it holds no tensor with a dim 0.
    """
    for _, t in tensors_of(batch):
        if t.dim() > 0:
            return t.shape[0]
    raise ValueError(
        "cannot tell the number of samples in the batch: it has no tensor with a sample dimension; "
        "define `split_batch(self, batch, sizes)` on your LightningModule"
    )


def _check_rows(batch: Any, total: int) -> None:
    """Raise unless every tensor with dims in ``batch`` has ``total`` rows (one per sample)."""
    rows = [(path, t.shape[0]) for path, t in tensors_of(batch) if t.dim() > 0]
    odd = [f"{path} has {n}" for path, n in rows if n != total]
    if not odd:
        return
    raise ValueError(
        f"the batch's tensors disagree on dim 0, the sample dimension: {rows[0][0]} has {total} rows (the "
        f"batch size), but {', '.join(odd)}. To be split into micro-batches every tensor with dims must hold "
        "one row per sample; make a tensor that all samples share 0-dim or a module attribute, or define "
        "`split_batch(self, batch, sizes)` on your LightningModule (or pass `split_fn=` to the callback)"
    )


def micro_batch_sizes(total: int, micro: int, *, smallest: int = 1, count: int | None = None) -> list[int]:
    """Sizes of the micro-batches that run ``total`` samples at most ``micro`` at a time: the fewest, as
    even as possible, the larger ones last (the last forward is the largest, which ``AutoCheckpoint``
    profiles). None has fewer than ``smallest`` samples, even if one then exceeds ``micro``; ``count``
    (agreed over ranks) fixes their number where ``total`` and ``smallest`` allow.

    Example::

        >>> micro_batch_sizes(10, 4), micro_batch_sizes(5, 2, smallest=2), micro_batch_sizes(10, 4, count=4)
        ([3, 3, 4], [2, 3], [2, 2, 3, 3])
    """
    if total < 1 or micro < 1:
        raise ValueError(f"need total >= 1 and micro >= 1, got total={total}, micro={micro}")
    count = min(-(-total // micro) if count is None else count, max(total // smallest, 1))
    base, extra = divmod(total, count)
    return [base] * (count - extra) + [base + 1] * extra


def largest_micro_batch(total: int, micro: int) -> int:
    """The largest of :func:`micro_batch_sizes` ``(total, micro)``: what a batch of ``total`` samples runs
    at ``micro`` samples at most, split evenly (12 for 15 of 48: 4 micro-batches).

    Example::

        >>> largest_micro_batch(48, 15), largest_micro_batch(48, 38), largest_micro_batch(48, 48)
        (12, 24, 48)
    """
    return -(-total // -(-total // micro))


def distinct_micro_batches(total: int) -> list[int]:
    """Every size at which a batch of ``total`` samples runs in fewer micro-batches than at any smaller
    size, largest first: ``ceil(total / n)`` for ``n`` micro-batches.

    Example::

        >>> distinct_micro_batches(48)
        [48, 24, 16, 12, 10, 8, 7, 6, 5, 4, 3, 2, 1]
    """
    return sorted({largest_micro_batch(total, n) for n in range(1, total + 1)}, reverse=True)


def _split(batch: Any, sizes: Sequence[int], total: int) -> list[Any]:
    n = len(sizes)
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return [batch] * n  # a scalar: every micro-batch gets it
        return list(torch.split(batch, list(sizes)))
    if isinstance(batch, Mapping):
        parts = {key: _split(value, sizes, total) for key, value in batch.items()}
        return (
            [type(batch)({key: parts[key][i] for key in batch}) for i in range(n)] if parts else [batch] * n
        )
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        parts = [_split(value, sizes, total) for value in batch]
        return [type(batch)(*(p[i] for p in parts)) for i in range(n)]
    if isinstance(batch, (list, tuple)):
        if len(batch) == total and not tensors_of(batch):  # one plain value per sample (e.g. strings)
            starts = [sum(sizes[:i]) for i in range(n)]
            return [type(batch)(batch[a : a + s]) for a, s in zip(starts, sizes)]
        parts = [_split(value, sizes, total) for value in batch]
        return [type(batch)(p[i] for p in parts) for i in range(n)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        names = [f.name for f in dataclasses.fields(batch) if f.init]
        parts = {name: _split(getattr(batch, name), sizes, total) for name in names}
        return [dataclasses.replace(batch, **{name: parts[name][i] for name in names}) for i in range(n)]
    if isinstance(batch, _SCALARS):
        return [batch] * n
    raise TypeError(_hook_hint(batch))


def split_batch(
    batch: Any, sizes: Sequence[int], *, split_fn: Callable[[Any, list[int]], list[Any]] | None = None
) -> list[Any]:
    """Split ``batch`` into ``len(sizes)`` micro-batches of those numbers of samples.

    Args:
        batch: The optimizer batch.
        sizes: Samples per micro-batch; must sum to the batch's size.
        split_fn: The user's own splitter (the LightningModule's ``split_batch`` hook or the callback's
            ``split_fn``), used instead of the built-in one when given.

    Raises:
        TypeError: If the batch holds an object that cannot be split and no ``split_fn`` is given.
        ValueError: If ``sizes`` does not add up to the batch size, the batch's tensors disagree on dim 0,
            or ``split_fn`` returns the wrong number of micro-batches.

    Example::

        >>> x, y = torch.arange(10.0), torch.arange(10)
        >>> [len(mb["x"]) for mb in split_batch({"x": x, "y": y}, [4, 3, 3])]
        [4, 3, 3]
    """
    sizes = [int(s) for s in sizes]
    if split_fn is not None:
        parts = list(split_fn(batch, sizes))
        if len(parts) != len(sizes):
            raise ValueError(
                f"split_fn returned {len(parts)} micro-batches for sizes {sizes}; return one per size"
            )
        return parts
    total = batch_size(batch)
    if sum(sizes) != total or min(sizes) < 1:
        raise ValueError(f"micro-batch sizes {sizes} must be positive and add up to the batch size {total}")
    if len(sizes) == 1:
        return [batch]
    _check_rows(batch, total)
    return _split(batch, sizes, total)


def describe_split(batch: Any, sizes: Sequence[int]) -> str:
    """One line: how the built-in splitter cut ``batch`` into micro-batches of ``sizes``, and how to say
    otherwise. Added to an error raised while a split step runs: a tensor that all samples share (a
    projection matrix beside as many samples as it has rows) passes the splitter's checks, is cut, and
    fails deep in the model. Which tensor that is, its shape cannot tell (a projection of 8 x 8 beside 8
    samples of 8 features): every cut tensor is named, with its shape.

    Example::

        >>> x, proj = torch.zeros(8, 4), torch.eye(8)
        >>> print(describe_split((x, proj), [4, 4]))  # doctest: +ELLIPSIS
        micro-batching ran this batch of 8 samples as micro-batches of [4, 4], cutting along dim 0: batch[0] (8, 4), batch[1] (8, 8); ...
    """
    total = sum(sizes)
    names = [f"{path} {tuple(t.shape)}" for path, t in tensors_of(batch, strict=False) if t.dim() > 0]
    return (
        f"micro-batching ran this batch of {total} samples as micro-batches of {list(sizes)}, cutting along dim 0: "
        f"{listed(names)}; if a tensor holds something all samples share rather than one row per sample, "
        "define `split_batch(self, batch, sizes)` on your LightningModule or pass `split_fn=` to the "
        "callback (return one batch per size, that tensor whole in each), or make it a module attribute"
    )


def micro_batch_weights(
    micro_batches: Sequence[Any], sizes: Sequence[int], count_fn: Callable[[Any], float] | None = None
) -> list[float]:
    """Weights that turn per-micro-batch mean losses into the mean loss of the whole batch: each
    micro-batch's share of the samples, or of ``count_fn(micro_batch)`` (the items its mean averages
    over, e.g. non-padding tokens; 0 is allowed).

    Raises:
        ValueError: If the counts are negative or all zero.
    """
    values = [count_fn(mb) for mb in micro_batches] if count_fn is not None else list(sizes)
    shapes = [tuple(v.shape) for v in values if isinstance(v, torch.Tensor) and v.numel() != 1]
    if shapes:
        raise ValueError(
            f"count_fn must return one number per micro-batch, got a tensor of shape {shapes[0]}; return the "
            "number of items its mean loss averages over, e.g. (labels != -100).sum()"
        )
    counts = numbers(values)
    total = sum(counts)
    if total <= 0 or min(counts) < 0:
        raise ValueError(
            f"count_fn must return non-negative counts with a positive sum, got {counts}; it returns the "
            "number of items (samples, tokens) a micro-batch's mean loss averages over (or pass "
            "count_fn='sum' for a loss that is a sum)"
        )
    return [c / total for c in counts]
