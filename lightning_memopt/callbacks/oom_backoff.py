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

    The DataLoader batch stays the optimizer batch: a step that runs out of memory (forward, backward or
    optimizer step; on any rank) is thrown away — its gradients dropped, BatchNorm statistics,
    torchmetrics states, RNGs and the GradScaler put back as they were at the step's start — and the
    same batch runs again as twice as many micro-batches, whose gradients accumulate to the same update.
    Under DDP and FSDP2 (``ModelParallelStrategy``) every rank retries with the same size, wherever the
    OOM happened on whichever rank, so no rank waits in a collective that another will never reach:
    the ranks agree with small all-reduces (under FSDP2 before each of FSDP's collectives), counted per
    step and strategy in one place, :mod:`lightning_memopt.batching.regime`; the first optimizer step at
    each size is agreed on too, and undone on every rank if one failed. Validation, test and predict
    steps halve their own micro-batch likewise. At one sample per micro-batch (two for a model with
    BatchNorm layers in training mode, which cannot normalize one sample) it raises :class:`~lightning_memopt.MicroBatchOOMError` with the step's memory breakdown
    and a checklist of what to do.

    The retried step is exact: micro-batch losses are weighted as ``AutoAccumulation`` weighs them (by
    their share of what the loss divides by, learned from the loss functions ``training_step`` calls;
    see :mod:`lightning_memopt.batching.loss`) and the first split step is checked against another split
    (``exactness``), so after a back-off the update equals the unsplit batch's up to rounding or a
    :class:`~lightning_memopt.SplitNotExactWarning` says why not; dropout draws different masks in a
    split batch.

    In one process, an out-of-memory error lowers a budget in padded tokens (samples x tokens per
    sample; :mod:`lightning_memopt.batching.shapes`), not a size in samples: later batches of the length
    that failed run smaller micro-batches, shorter batches run in fewer, and growth stays below the
    padded size that failed. Under DDP/FSDP2 the size is in samples, for every batch.

    On one CUDA device it also lowers the size before any out-of-memory error: when the caching allocator
    keeps freeing its cache and retrying allocations step after step (thrashing, a large slowdown without
    an error; the rule and why: :mod:`lightning_memopt.batching.thrash`), the next steps run at half the
    size, as after an out-of-memory error but without retrying the step; ``engine.near_misses`` counts
    these. At the smallest micro-batch it warns once and trains on.

    Works with :class:`~lightning_memopt.AutoAccumulation` (which picks the starting size; both share one
    engine) or alone (starting from the whole batch).

    Only out-of-memory errors are caught (``torch.OutOfMemoryError`` and the device and CPU allocators'
    messages, see :func:`~lightning_memopt.batching.errors.is_out_of_memory`); any other error propagates.

    Args:
        grow_after: After this many steps in a row without an out-of-memory error at a reduced size, try
            twice the size again (never above the starting size, nor up to a size that already failed).
            Default None: never grow back.
        overlap_after: Under DDP, after this many steps in a row without an OOM at one size, and when a
            step runs as 2 or more micro-batches, the ranks agree after the first k-1 micro-batches and
            the last one synchronizes gradients inside its backward, as DDP does without this callback
            (communication overlaps backward again; one 8-byte all-reduce per step). The price: an OOM
            in that last micro-batch cannot be retried on every rank and ends the run with
            :class:`~lightning_memopt.MicroBatchOOMError`. Under FSDP2, after this many
            steps in a row without an OOM at one size (any number of micro-batches), the micro-batches
            run without sync points and without agreement (no extra collective at all); any OOM then
            ends the run with ``MicroBatchOOMError`` on that rank, and the other ranks fail at their
            next collective. Default None: always agree first (safe).
        count_fn: ``count_fn(micro_batch) -> number`` of items the loss averages over, or ``"sum"``;
            replaces what the engine learns from the loss. Default None: learned. Shared with
            ``AutoAccumulation`` (give it to one of them).
        split_fn: ``split_fn(batch, sizes) -> list`` for batch types the built-in splitter cannot cut.
            Default None. Shared with ``AutoAccumulation``.
        length_fn: ``length_fn(batch) -> int``, the length every sample of the batch is padded to (the
            dimension its memory grows with), for batches where it is not dim 1 of the batch's tensors.
            Default None: :func:`~lightning_memopt.batching.shapes.tokens_per_sample`. Shared with
            ``AutoAccumulation``.
        exactness: ``"warn"``, ``"raise"`` or ``"off"``: the one-time check of ``AutoAccumulation``'s
            ``exactness``. Shared with ``AutoAccumulation``.
        log: Log the ``batching/*`` keys from the training step. Default True. They are the same keys
            as :class:`~lightning_memopt.AutoAccumulation`'s (one engine drives both; its docstring has
            the table), and on one CUDA device ``batching/near_misses``: steps after which the allocator
            was found thrashing, since the fit started (cumulative count).

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

    retry_on_oom = True

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per training micro-batch now; None runs the whole batch."""
        return None if self.engine is None else self.engine.sizes.micro_batch_size

    @override
    def _sizes(self) -> dict[str, Any]:
        return {"grow_after": self.grow_after}

    @override
    def _engine_options(self) -> dict[str, Any]:
        return {"retry_on_oom": True, "overlap_after": self.overlap_after}
