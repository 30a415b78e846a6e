"""OOMBackoff: retry a step that ran out of memory with more, smaller micro-batches, on every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from typing_extensions import override

from lightning_memopt._checks import check_positive_int
from lightning_memopt.batching.engine import Exactness
from lightning_memopt.callbacks._micro_batching import MicroBatching

__all__ = ["OOMBackoff"]


class OOMBackoff(MicroBatching):
    """Catch out-of-memory errors in a step, restore the step's start, split the batch further and retry.

    The DataLoader batch stays the optimizer batch: the failed attempt is dropped, the step's start
    restored (gradients, buffers, torchmetrics states, RNGs, GradScaler) and the same batch runs as twice
    as many micro-batches, weighted and checked as ``AutoAccumulation``'s are. Under DDP and FSDP2 every
    rank retries together, whichever rank failed. Evaluation steps halve their own micro-batch likewise.
    At the smallest micro-batch (one sample, two with BatchNorm in training mode) it raises
    :class:`~lightning_memopt.MicroBatchOOMError` with the step's memory and a checklist. On one CUDA
    device a thrashing allocator lowers the size too, without a retry. Only out-of-memory errors are
    caught (:func:`~lightning_memopt.memory.device.is_out_of_memory`). How:
    ``docs/micro_batching.md``. Works alone (from the whole batch) or with
    :class:`~lightning_memopt.AutoAccumulation`, which picks the starting size (one engine for both).

    Args:
        grow_after: After this many steps in a row without an out-of-memory error at a reduced size, try
            twice the size again (never above the starting size, nor up to a size that already failed).
            Default None: never grow back.
        overlap_after: After this many steps in a row without an OOM at one size, trade recovery for
            speed: under DDP the last micro-batch (of 2 or more) synchronizes gradients inside its
            backward again, under FSDP2 the micro-batches run without sync points; an OOM where the ranks
            no longer agree then ends the run with :class:`~lightning_memopt.MicroBatchOOMError`. Default
            None: always agree first (safe). The collectives each way costs: ``docs/micro_batching.md``.
        count_fn: ``count_fn(micro_batch) -> number`` of items the loss averages over, or ``"sum"``;
            replaces what the engine learns from the loss. Default None: learned. Shared with
            ``AutoAccumulation`` (give it to one of them).
        split_fn: ``split_fn(batch, sizes) -> list`` for batch types the built-in splitter cannot cut.
            Default None. Shared with ``AutoAccumulation``.
        length_fn: ``length_fn(batch) -> int``, the length every sample of the batch is padded to (the
            dimension its memory grows with), for batches where it is not dim 1 of the batch's tensors.
            Default None: :func:`~lightning_memopt.batching.shape_model.tokens_per_sample`. Shared with
            ``AutoAccumulation``.
        exactness: ``"warn"``, ``"raise"`` or ``"off"``: the one-time check of ``AutoAccumulation``'s
            ``exactness``. Shared with ``AutoAccumulation``.
        log: Log the ``batching/*`` keys of :class:`~lightning_memopt.AutoAccumulation`'s table (one
            engine drives both). Default True.

    The micro-batch sizes and the count of clean steps towards ``grow_after`` are saved in checkpoints:
    a resumed run continues exactly as the uninterrupted one.

    Raises:
        ValueError: If ``grow_after`` is not a positive int, or ``overlap_after`` not an int >= 0.
        TypeError: If ``count_fn``, ``split_fn`` or ``length_fn`` is not callable, or ``log`` is not a bool.
        MisconfigurationException: In ``setup`` for manual optimization, DeepSpeed, or
            ``accumulate_grad_batches > 1`` (make the DataLoader batch the optimizer batch instead), or a
            different ``count_fn``/``split_fn``/``length_fn`` on ``AutoAccumulation``.

    Example::

        >>> from lightning_memopt import OOMBackoff
        >>> trainer = pl.Trainer(callbacks=[OOMBackoff(grow_after=100)], logger=False)
    """

    def __init__(
        self,
        *,
        grow_after: int | None = None,
        overlap_after: int | None = None,
        count_fn: Callable[[Any], float] | Literal["sum"] | None = None,
        split_fn: Callable[[Any, list[int]], list[Any]] | None = None,
        length_fn: Callable[[Any], int] | None = None,
        exactness: Exactness = "warn",
        log: bool = True,
    ) -> None:
        check_positive_int(
            "grow_after", grow_after, meaning="clean steps before trying a larger micro-batch", none_ok=True
        )
        check_positive_int(
            "overlap_after",
            overlap_after,
            minimum=0,
            meaning="clean steps before overlapping DDP's gradient sync with the last micro-batch's backward",
            none_ok=True,
        )
        super().__init__(
            log=log, count_fn=count_fn, split_fn=split_fn, length_fn=length_fn, exactness=exactness
        )
        self.grow_after = grow_after
        self.overlap_after = overlap_after

    @override
    def _options(self, trainer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"grow_after": self.grow_after}, {"retry_on_oom": True, "overlap_after": self.overlap_after}
