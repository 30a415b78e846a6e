"""AutoAccumulation: the largest micro-batch that fits, with the effective batch unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_memopt.batching.distributed import max_over_ranks, min_over_ranks
from lightning_memopt.batching.errors import BATCHNORM_ADVICE, CHECKLIST, MicroBatchOOMError
from lightning_memopt.batching.shapes import ShapeModel
from lightning_memopt.batching.sizing import NoSizeFits, find_micro_batch_size, smallest_micro_batch
from lightning_memopt.callbacks._micro_batching import MicroBatchingCallback
from lightning_memopt.memory.budget import MemoryLimit, check_headroom, check_max_memory, usable_bytes
from lightning_memopt.memory.device import device_memory
from lightning_memopt.memory.units import parse_bytes

__all__ = ["AutoAccumulation"]

_FAILED = 2**62  # what a probe that ran out of memory reports to the other ranks


class AutoAccumulation(MicroBatchingCallback):
    """Run each DataLoader batch as the fewest micro-batches that fit, accumulating to the same update.

    The DataLoader batch is the optimizer batch (the effective batch never changes, unlike Lightning's
    ``BatchSizeFinder``). Before the first step, a few probe steps (forward and backward of one
    micro-batch, nothing else changed: no weight update, gradients dropped, BatchNorm statistics,
    torchmetrics states and RNGs restored) measure peak memory at a few sizes, fit a line (a parabola
    where the curve bends) to predict the largest size that fits ``max_memory * (1 - headroom)``, verify
    it with one more probe and fall back to bisection when a prediction misses
    (:func:`~lightning_memopt.batching.sizing.find_micro_batch_size`). Under DDP/FSDP every rank probes
    and all use the smallest size found. The size is saved in the checkpoint: a resumed run does not
    probe again.

    Per batch, in one process: the size is kept in padded tokens (samples x tokens per sample of the
    probed batch; :mod:`lightning_memopt.batching.shapes`), so a batch of shorter sequences runs in fewer,
    larger micro-batches and a longer one in more. Under DDP/FSDP2 the size stays in samples.

    Exact accumulation: each micro-batch's mean loss is weighted by its share of the items the batch's
    loss averages over, so the accumulated gradient equals the unsplit batch's (up to rounding), an
    uneven last micro-batch included. The items are samples, except for a batch with integer ``labels``
    holding -100 (the Hugging Face convention): then the labels ``!= -100``, after the one-position
    shift of causal language models, told from the model (:mod:`lightning_memopt.batching.counting`),
    so Hugging Face causal-LM, masked-LM and seq2seq losses with padding are exact with no user code.
    For another loss that is not a mean over samples, pass ``count_fn`` (the package warns once when
    it sees -100 in a batch it cannot read). Dropout draws different masks when a batch is split, so a
    model with dropout trains like the unsplit run, not bit-for-bit like it. Values logged with
    ``self.log`` in ``training_step`` are logged once per step, as the weighted mean over micro-batches.

    Args:
        micro_batch_size: A fixed training micro-batch size; skips probing. Default None: probe.
        eval_micro_batch_size: Samples per validation/test/predict micro-batch. Default None: probed
            separately (evaluation keeps no activations for backward, so it fits larger), up to the
            training batch size; the whole batch when nothing is probed.
        max_memory: The memory one step may use: bytes (int), a string like ``"6GiB"``, or a float in
            (0, 1], a fraction of the device's capacity (see :mod:`lightning_memopt.memory.budget`).
            Default None: the CUDA device's capacity. Bytes are required to probe on CPU (there is no
            device limit to ask); without them the CPU run is not split. Not with ``micro_batch_size``.
        headroom: Fraction of ``max_memory`` kept free for what probes cannot see (optimizer state
            created by the first step, fragmentation, longer sequences): the probes fit
            ``max_memory * (1 - headroom)``. Default 0.1.
        max_probes: Most probe steps to spend (at least 3). Default 6, as in ``find_micro_batch_size``.
        count_fn: ``count_fn(micro_batch) -> number`` of items the loss averages over, for losses that
            are a mean over something other than samples and not in the Hugging Face convention above.
            Default None: the convention, else samples. Shared with ``OOMBackoff`` (give it to one).
        split_fn: ``split_fn(batch, sizes) -> list`` for batch types the built-in splitter cannot cut
            (a LightningModule method ``split_batch(self, batch, sizes)`` works too). Default None.
            Shared with ``OOMBackoff``.
        length_fn: ``length_fn(batch) -> int``, the length every sample of the batch is padded to (the
            dimension its memory grows with), for batches where it is not dim 1 of the batch's tensors.
            Default None: :func:`~lightning_memopt.batching.shapes.tokens_per_sample`. Shared with
            ``OOMBackoff``.
        log: Log the keys below per step. Default True.

    Logged keys (per step, ``on_step=True``; shared with ``OOMBackoff``):

    ===============================  ===============================================================
    ``batching/micro_batch_size``    samples per micro-batch of this step
    ``batching/num_micro_batches``   micro-batches this step ran as
    ``batching/oom_retries``         out-of-memory retries since the fit started (cumulative count)
    ``batching/near_misses``         with ``OOMBackoff`` on a CUDA device: steps after which the
                                     allocator was found thrashing (cumulative count; each halved the
                                     size, see :mod:`lightning_memopt.batching.thrash`)
    ===============================  ===============================================================

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

    def __init__(
        self,
        *,
        micro_batch_size: int | None = None,
        eval_micro_batch_size: int | None = None,
        max_memory: MemoryLimit = None,
        headroom: float = 0.1,
        max_probes: int = 6,
        count_fn: Callable[[Any], float] | None = None,
        split_fn: Callable[[Any, list[int]], list[Any]] | None = None,
        length_fn: Callable[[Any], int] | None = None,
        log: bool = True,
    ) -> None:
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("eval_micro_batch_size", eval_micro_batch_size),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"{name} must be a positive int or None (to probe / run whole), got {value!r}"
                )
        check_max_memory(max_memory)
        if max_memory is not None and micro_batch_size is not None:
            raise ValueError(
                f"micro_batch_size={micro_batch_size!r} fixes the size, so max_memory={max_memory!r} would be "
                "ignored; pass micro_batch_size to fix the size, or max_memory to probe for it, not both"
            )
        if isinstance(max_probes, bool) or not isinstance(max_probes, int) or max_probes < 3:
            raise ValueError(
                f"max_probes must be an int >= 3 (two to fit, one to verify), got {max_probes!r}"
            )
        # bytes for an absolute limit (as before fractions were accepted), the float for a fraction
        self.max_memory = (
            max_memory if max_memory is None or isinstance(max_memory, float) else parse_bytes(max_memory)
        )
        self.headroom = check_headroom(headroom)
        self.max_probes = max_probes
        super().__init__(log=log, count_fn=count_fn, split_fn=split_fn, length_fn=length_fn)
        self.probes: list[tuple[int, int | None]] = []
        self.eval_probes: list[tuple[int, int | None]] = []
        self._fixed = micro_batch_size
        self._sizes: dict[str, Any] = {
            "micro_batch_size": micro_batch_size,
            "eval_micro_batch_size": eval_micro_batch_size,
            "probed": micro_batch_size is not None,
            "tokens_per_sample": None,  # of the probed batch: the sizes are its samples (batching/shapes.py)
            "shape_model": None,  # ShapeModel.state() of the probed fit: per-batch sizes
        }

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per training micro-batch; None runs the whole batch (before probing, or unsplit)."""
        if self._engine is not None:
            return self._engine.micro_batch_size
        return self._sizes["micro_batch_size"]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.max_memory is not None:
            self._memory_limit(trainer)  # a fraction of an unknown capacity (CPU) fails now, not at step 1

    @override
    def _installed(self) -> None:
        self._apply_sizes()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._sizes["probed"] or self._engine is None:
            return
        self._sizes["probed"] = True
        capacity = self._memory_limit(trainer)
        if capacity is None:
            return
        # The smallest device decides, and every rank must search with the same budget to take the
        # same path (the same number of probes, hence of collectives).
        capacity = min_over_ranks(capacity, trainer.strategy.root_device)
        # The probes' peaks are the largest over ranks, which the longest batch has: its length is theirs.
        width = max_over_ranks(self._engine.splitter.length(batch), trainer.strategy.root_device)
        self._sizes["tokens_per_sample"] = width  # the probed sizes are its samples
        held = self._engine.probe_base(batch)  # what the probes' peaks start from
        size = self._sizes["micro_batch_size"] = self._find_size(
            trainer, pl_module, batch, capacity, evaluation=False
        )
        whole = size == self._engine.batch_size(batch, pl_module)
        budget = usable_bytes(capacity, self.headroom, None)
        model = ShapeModel.from_probes(
            self.probes, width=width, size=size, whole=whole, budget=budget, limit=capacity, held=held
        )
        self._sizes["shape_model"] = model.state()
        if self._sizes["eval_micro_batch_size"] is None and is_overridden("validation_step", pl_module):
            self._sizes["eval_micro_batch_size"] = self._find_size(
                trainer, pl_module, batch, capacity, evaluation=True
            )
        self._apply_sizes()

    def _memory_limit(self, trainer: pl.Trainer) -> int | None:
        """``max_memory`` in bytes (the device's capacity for None or a fraction); None: cannot probe."""
        device = trainer.strategy.root_device
        capacity = device_memory(device).capacity() if device.type == "cuda" else None
        if self.max_memory is not None or capacity is not None:
            # headroom 0: the limit itself; find_micro_batch_size applies the headroom (usable_bytes again)
            return usable_bytes(self.max_memory, 0.0, capacity)
        rank_zero_warn(
            f"AutoAccumulation cannot ask a {device.type!r} device how much memory it has; pass "
            "max_memory= (e.g. '6GiB') to pick a micro-batch size. Running whole batches."
        )
        return None

    def _find_size(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        capacity: int,
        *,
        evaluation: bool,
    ) -> int:
        engine = self._engine
        assert engine is not None
        device = trainer.strategy.root_device
        max_size = min_over_ranks(engine.batch_size(batch, pl_module), device)
        min_size = min(smallest_micro_batch(pl_module, training=not evaluation), max_size)

        def probe(size: int) -> int | None:
            peak = engine.probe(batch, size, tracker=engine.probe_tracker(), evaluation=evaluation)
            # Every rank sees the largest peak of all ranks (a rank that ran out of memory reports "too
            # much"), so the search takes the same path on every rank: one 8-byte collective per probe.
            agreed = max_over_ranks(_FAILED if peak is None else peak, device)
            result = None if agreed == _FAILED else agreed
            (self.eval_probes if evaluation else self.probes).append((size, result))
            return result

        try:
            result = find_micro_batch_size(
                probe,
                max_size=max_size,
                capacity=capacity,
                headroom=self.headroom,
                min_size=min_size,
                max_probes=self.max_probes,
                # evaluation keeps no activations: try the whole batch first, one probe when it fits
                start=max_size if evaluation else None,
            )
        except NoSizeFits as error:
            advice = f"{BATCHNORM_ADVICE}\n" if min_size > 1 else ""
            raise MicroBatchOOMError(
                f"AutoAccumulation(max_memory={self.max_memory!r}, headroom={self.headroom}) found no "
                f"{'evaluation' if evaluation else 'training'} micro-batch size that fits: {error}.\n"
                f"{advice}{CHECKLIST}"
            ) from None
        return min_over_ranks(int(result.size), device)

    def _apply_sizes(self) -> None:
        engine = self._engine
        if engine is None:
            return
        engine.eval_micro_batch_size = self._sizes["eval_micro_batch_size"]
        if self._sizes.get("shape_model") is not None:  # sizes follow the shape of each batch
            engine.policy.model = ShapeModel.from_state(self._sizes["shape_model"])
        if engine.smallest_failed_size is not None:
            return  # OOMBackoff restored a size it backed off to; that one is current
        size, width = self._sizes["micro_batch_size"], self._sizes.get("tokens_per_sample")
        engine.policy.set_size("micro_batch_size", size, width)
        engine.policy.set_size("max_micro_batch_size", size, width)

    @override
    def state_dict(self) -> dict[str, Any]:
        model = self._engine.policy.model if self._engine is not None else None
        return {
            **self._sizes,
            "shape_model": model.state() if model is not None else self._sizes.get("shape_model"),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._sizes.update(state_dict)
        self._apply_sizes()
