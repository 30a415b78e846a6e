"""AutoAccumulation: the largest micro-batch that fits, with the effective batch unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_memopt._checks import check_positive_int
from lightning_memopt.batching.engine import Exactness
from lightning_memopt.callbacks._micro_batching import MicroBatching
from lightning_memopt.memory.device import device_memory
from lightning_memopt.memory.limit import MemoryLimit, check_headroom, check_max_memory, usable_bytes
from lightning_memopt.memory.units import parse_bytes

__all__ = ["AutoAccumulation"]


class AutoAccumulation(MicroBatching):
    """Run each DataLoader batch as the fewest micro-batches that fit, accumulating to the same update.

    The DataLoader batch is the optimizer batch: the effective batch never changes (unlike Lightning's
    ``BatchSizeFinder``). Before the first step a few probes find the largest micro-batch whose peak fits
    ``max_memory * (1 - headroom)`` (:func:`~lightning_memopt.batching.size_search.find_micro_batch_size`); later
    batches are sized for their own length. Each micro-batch's loss is weighted by its share of what the
    batch's loss divides by, learned from the loss functions ``training_step`` calls, and the first split
    of each batch structure is checked: its leading micro-batches against another split (``exactness``). How:
    ``docs/micro_batching.md``. The size is saved in the checkpoint: a resumed run does not probe again.

    Args:
        micro_batch_size: A fixed training micro-batch size; skips probing. Default None: probe.
        eval_micro_batch_size: Samples per validation/test/predict micro-batch. Default None: probed
            separately (evaluation keeps no activations for backward, so it fits larger), up to the
            training batch size; the whole batch when nothing is probed.
        max_memory: The memory one step may use: bytes (int), a string like ``"6GiB"``, or a float in
            (0, 1], a fraction of the device's capacity (see :mod:`lightning_memopt.memory.limit`).
            Default None: the CUDA device's capacity. Bytes are required to probe on CPU (there is no
            device limit to ask); without them the CPU run is not split. Not with ``micro_batch_size``.
        headroom: Fraction of ``max_memory`` kept free for what probes cannot see (optimizer state
            created by the first step, fragmentation, longer sequences): the probes fit
            ``max_memory * (1 - headroom)``. Default 0.1.
        max_probes: Most probe steps to spend (at least 3). Default 6, as in ``find_micro_batch_size``.
        count_fn: ``count_fn(micro_batch) -> number`` of items the loss averages over, or ``"sum"`` for a
            loss that is a sum (every micro-batch weighs 1): replaces what the engine learns from the loss.
            Default None: learned. Shared with ``OOMBackoff`` (give it to one).
        split_fn: ``split_fn(batch, sizes) -> list`` for batch types the built-in splitter cannot cut
            (a LightningModule method ``split_batch(self, batch, sizes)`` works too). Default None.
            Shared with ``OOMBackoff``.
        length_fn: ``length_fn(batch) -> int``, the length every sample of the batch is padded to (the
            dimension its memory grows with), for batches where it is not dim 1 of the batch's tensors.
            Default None: :func:`~lightning_memopt.batching.shape_model.tokens_per_sample`. Shared with
            ``OOMBackoff``.
        exactness: ``"warn"`` (default): check once per batch structure that a split step gives the
            unsplit gradient and warn with the cause when it does not; ``"raise"``: raise
            :class:`~lightning_memopt.SplitNotExactError` instead; ``"off"``: do not check (the check runs
            the step's leading micro-batches, at least 8 samples, twice more: whole and as another split;
            where they are the whole batch, once, twice with dropout). Shared with
            ``OOMBackoff``.
        log: Log the keys below per step. Default True.

    Logged keys (per step, ``on_step=True``; shared with ``OOMBackoff``):

    ======================================  ===============================================================
    ``batching/micro_batch_size``           samples per micro-batch of this step
    ``batching/num_micro_batches``          micro-batches this step ran as
    ``batching/oom_retries``                out-of-memory retries since the fit started (cumulative count)
    ``batching/step_seconds_predicted``     with ``AutoCheckpoint``, where the first batch's search timed it:
                                            seconds per optimizer step at the size and treatment chosen,
                                            its micro-steps' forward and backward together (measured in
                                            the trial, or predicted from the search's timed probes)
    ``batching/step_seconds``               every ``log_every_n_steps``: the mean wall-clock seconds of the
                                            optimizer steps since the last log (one training step's end to
                                            the next: optimizer, data loading, forward and backward; a
                                            validation run between two steps is left out)
    ``batching/near_misses``                with ``OOMBackoff`` on a CUDA device: steps after which the
                                            allocator was found thrashing (cumulative count; each halved the
                                            size)
    ======================================  ===============================================================

    Attributes:
        probes: ``(size, peak bytes or None)`` of each training probe this fit ran (empty on resume).
        eval_probes: The same for the evaluation size (probed with ``validation_step`` under ``no_grad``
            on the first training batch, when the module has a ``validation_step``).

    Raises:
        ValueError: For a bad argument (see the message), or ``max_memory`` with ``micro_batch_size``.
        TypeError: If ``count_fn``, ``split_fn`` or ``length_fn`` is not callable, or ``log`` is not a bool.
        MisconfigurationException: In ``setup`` for manual optimization, DeepSpeed, or
            ``accumulate_grad_batches > 1``, or a different ``count_fn``/``split_fn``/``length_fn`` on ``OOMBackoff``.
        MicroBatchOOMError: At the first step, when even the smallest micro-batch does not fit.

    Example::

        >>> from lightning_memopt import AutoAccumulation
        >>> trainer = pl.Trainer(callbacks=[AutoAccumulation(max_memory="6GiB")], logger=False)
    """

    splits_from_the_start = True

    def __init__(
        self,
        *,
        micro_batch_size: int | None = None,
        eval_micro_batch_size: int | None = None,
        max_memory: MemoryLimit = None,
        headroom: float = 0.1,
        max_probes: int = 6,
        count_fn: Callable[[Any], float] | Literal["sum"] | None = None,
        split_fn: Callable[[Any, list[int]], list[Any]] | None = None,
        length_fn: Callable[[Any], int] | None = None,
        exactness: Exactness = "warn",
        log: bool = True,
    ) -> None:
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("eval_micro_batch_size", eval_micro_batch_size),
        ):
            check_positive_int(name, value, meaning="samples per micro-batch", none_ok=True)
        check_max_memory(max_memory)
        if max_memory is not None and micro_batch_size is not None:
            raise ValueError(
                f"micro_batch_size={micro_batch_size!r} fixes the size, so max_memory={max_memory!r} would be "
                "ignored; pass micro_batch_size to fix the size, or max_memory to probe for it, not both"
            )
        check_positive_int("max_probes", max_probes, minimum=3, meaning="two to fit, one to verify")
        # bytes for an absolute limit, the float for a fraction of the device's capacity
        self.max_memory = (
            max_memory if max_memory is None or isinstance(max_memory, float) else parse_bytes(max_memory)
        )
        self.headroom = check_headroom(headroom)
        self.max_probes = max_probes
        self.fixed_size = micro_batch_size
        self.eval_micro_batch_size = eval_micro_batch_size
        super().__init__(
            log=log, count_fn=count_fn, split_fn=split_fn, length_fn=length_fn, exactness=exactness
        )

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per training micro-batch; None runs the whole batch (before probing, or unsplit)."""
        return self.fixed_size if self.engine is None else self.engine.sizes.micro_batch_size

    @property
    def probes(self) -> list[tuple[int, int | None]]:
        """``(size, peak bytes or None)`` of each training probe this fit ran (empty on resume)."""
        return [] if self.engine is None else self.engine.sizes.probes

    @property
    def eval_probes(self) -> list[tuple[int, int | None]]:
        """The same for the evaluation size (probed with ``validation_step`` under ``no_grad``)."""
        return [] if self.engine is None else self.engine.sizes.eval_probes

    @override
    def _options(self, trainer: pl.Trainer) -> tuple[dict[str, Any], dict[str, Any]]:
        sizes = {"micro_batch_size": self.fixed_size, "eval_micro_batch_size": self.eval_micro_batch_size}
        limit = self._limit(trainer)
        return {**sizes, "headroom": self.headroom, "max_probes": self.max_probes, "max_memory": limit}, {}

    def _limit(self, trainer: pl.Trainer) -> int | None:
        """``max_memory`` in bytes (None: the CUDA device's capacity; a fraction: of it); None for a fixed
        size, or with a warning where the device cannot say how much it has (CPU without ``max_memory``)."""
        if self.fixed_size is not None:
            return None
        device = trainer.strategy.root_device
        capacity = device_memory(device).capacity() if device.type == "cuda" else None
        if self.max_memory is not None or capacity is not None:
            return usable_bytes(self.max_memory, 0.0, capacity)  # the limit; the search takes the headroom
        rank_zero_warn(
            f"AutoAccumulation cannot ask a {device.type!r} device how much memory it has; pass max_memory= "
            "(e.g. '6GiB') to pick a micro-batch size. Running whole batches."
        )
        return None
