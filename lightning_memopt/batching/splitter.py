"""How the engine cuts a batch and weighs its parts: the user's ``split_fn`` / ``count_fn``, or the defaults.

The defaults are :func:`~lightning_memopt.batching.split.split_batch` and the loss convention that
:func:`~lightning_memopt.batching.counting.choose_count` reads from the batch and the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_memopt.batching.counting import causal_shift, choose_count
from lightning_memopt.batching.shapes import tokens_per_sample
from lightning_memopt.batching.split import batch_size, micro_batch_weights, split_batch

__all__ = ["Splitter"]

_UNKNOWN = object()  # the model's loss convention, before the first split step looked at it


class Splitter:
    """Cuts batches into micro-batches and weighs them by their share of the items the loss averages over.

    Args:
        count_fn: ``count_fn(micro_batch) -> number`` of loss elements; None: :func:`choose_count`'s default.
        split_fn: ``split_fn(batch, sizes) -> list`` for batch types the built-in splitter cannot cut; None:
            the LightningModule's ``split_batch(batch, sizes)`` if it has one, else the built-in splitter.
        length_fn: ``length_fn(batch) -> int``, the length each sample of ``batch`` is padded to, which
            its memory grows with; None: :func:`~.shapes.tokens_per_sample`.
    """

    def __init__(
        self,
        count_fn: Callable[[Any], float] | None = None,
        split_fn: Callable[[Any, list[int]], list[Any]] | None = None,
        length_fn: Callable[[Any], int] | None = None,
    ) -> None:
        self.count_fn = count_fn
        self.split_fn = split_fn
        self.length_fn = length_fn
        self._shift: Any = _UNKNOWN  # counting.causal_shift of the module, found on the first split step
        self._warned = False

    def forget_model(self) -> None:
        """The next fit may train another model: look at its loss convention again."""
        self._shift = _UNKNOWN

    def batch_size(self, batch: Any, module: Any) -> int:
        """Samples in ``batch``; ``len(batch)`` for batches only the user's ``split_fn`` can cut."""
        try:
            return batch_size(batch)
        except (TypeError, ValueError):
            if self._split_fn(module) is None:
                raise
            return len(batch)

    def length(self, batch: Any) -> int:
        """Tokens (or other units) per sample of ``batch``: the shape per-batch sizing follows.

        Raises:
            ValueError: If ``length_fn`` returns something other than a positive int.
        """
        if self.length_fn is None:
            return tokens_per_sample(batch)
        length = self.length_fn(batch)
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(
                f"length_fn(batch) must return a positive int (tokens per sample), got {length!r}"
            )
        return length

    def split(self, batch: Any, sizes: list[int], module: Any) -> list[Any]:
        """``batch`` cut into parts of ``sizes`` samples."""
        return split_batch(batch, sizes, split_fn=self._split_fn(module))

    def cut(self, batch: Any, sizes: list[int], module: Any) -> tuple[list[Any], list[float]]:
        """``batch`` cut into parts of ``sizes`` samples, and each part's weight (:meth:`weights`)."""
        parts = self.split(batch, sizes, module)
        return parts, self.weights(batch, parts, sizes, module)

    def weights(self, batch: Any, parts: list[Any], sizes: list[int], module: Any) -> list[float]:
        """Each micro-batch's share of the items its loss averages over (:mod:`~.counting` says which)."""
        if len(parts) == 1:
            return [1.0]
        if self.count_fn is not None:
            return micro_batch_weights(parts, sizes, self.count_fn)
        if self._shift is _UNKNOWN:
            self._shift = causal_shift(module)
        count_fn, warning = choose_count(batch, self._shift, check_ignored=not self._warned)
        if warning is not None and not self._warned:
            self._warned = True
            rank_zero_warn(warning)
        if count_fn is not None and count_fn(batch) == 0:
            count_fn = None  # nothing counted in the whole batch: its loss is NaN either way
        return micro_batch_weights(parts, sizes, count_fn)

    def _split_fn(self, module: Any) -> Callable | None:
        if self.split_fn is not None:
            return self.split_fn
        hook = getattr(module, "split_batch", None)
        return hook if callable(hook) else None
