"""Max-tokens batching: batches of similar-length samples, each filled up to ``max_tokens`` padded tokens.

A fixed number of samples per batch makes the memory of a step follow the longest sample in it: with
lengths from 16 to 2,048 tokens, one batch of 32 holds 512 padded tokens and the next 65,536. What
memory sees is the *padded* batch, ``samples x longest sample``, so this module keeps that constant
instead: :class:`MaxTokensBatchSampler` groups samples of similar length (little padding) and adds
samples to a batch while ``len(batch) * max(length in batch) <= max_tokens``. Short samples come many to
a batch, long ones few: the effective batch in *padded tokens* is what stays (roughly) constant, not the
sample count. With a loss that is a mean over tokens, pass the token count to
:class:`~lightning_memopt.AutoAccumulation`'s ``count_fn`` so that micro-batches are weighted by tokens.

:func:`pad_collate` turns a list of samples into padded ``input_ids``, ``attention_mask`` and ``labels``
(Hugging Face's convention: ``-100`` labels are ignored by the loss), and :func:`padding_tokens` counts
what a list of batches wastes on padding.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from lightning_memopt._checks import check_positive_int

__all__ = ["MaxTokensBatchSampler", "pad_collate", "padding_tokens"]


def _check_lengths(lengths: Any) -> list[int]:
    """``lengths`` as a list of positive Python ints, or a ValueError/TypeError naming the bad value."""
    if hasattr(lengths, "__array__") and not isinstance(lengths, torch.Tensor):
        lengths = torch.as_tensor(lengths)  # a numpy array: checked as a tensor
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.is_floating_point() or lengths.is_complex():
            raise TypeError(
                f"lengths must be a 1-D integer tensor or a sequence of ints, got a {lengths.dtype} tensor of "
                f"shape {tuple(lengths.shape)}"
            )
        lengths = lengths.tolist()
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise TypeError(
            f"lengths must be a sequence of ints (one token count per sample), got {type(lengths).__name__}"
        )
    if len(lengths) == 0:
        raise ValueError("lengths is empty: the dataset has no samples to batch")
    out = []
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int):
            try:  # numpy integers and 0-d integer tensors are ints too
                as_int = int(n)
            except (TypeError, ValueError):
                as_int = None
            if as_int is None or as_int != n or isinstance(n, float):
                raise TypeError(f"lengths[{i}] must be an int (a token count), got {n!r}")
            n = as_int
        if n < 1:
            raise ValueError(f"lengths[{i}] must be >= 1 token, got {n}; drop empty samples from the dataset")
        out.append(n)
    return out


class MaxTokensBatchSampler(Sampler[list[int]]):
    """Yield batches of dataset indices of similar length, each holding at most ``max_tokens`` padded tokens.

    The bound is on **padded** tokens, what a step's memory sees: a batch is full when adding the next
    sample would make ``len(batch) * max(lengths[i] for i in batch)`` exceed ``max_tokens``. So the padded
    tokens per batch stay roughly constant (each batch is within one sample of the bound) while the
    number of samples varies: many short samples, or a few long ones. A sample longer than ``max_tokens``
    cannot meet the bound; it gets a batch of its own (the only batches over the bound), and the
    constructor warns once with how many there are and the longest, so that the user can raise the bound
    or truncate.

    How an epoch is built, the same on every rank: the indices are shuffled (seeded with
    ``seed + epoch``) and cut into chunks of ``bucket_size``; each chunk is sorted by length (ties in
    shuffled order) and cut greedily into batches; then the batches of all chunks are shuffled. Larger
    chunks give less padding and less randomness in which samples share a batch. With ``shuffle=False``
    nothing is shuffled: chunks are consecutive indices, batches come in the order they are made.

    Distributed: rank ``r`` of ``num_replicas`` takes batches ``r, r + num_replicas, ...`` of the epoch's
    list, so every rank runs the same number of steps (DDP's collectives need that). When the number of
    batches is not a multiple of ``num_replicas``, ``drop_last=False`` repeats the first batches of the
    list to fill the last round (as ``DistributedSampler`` repeats samples: those few samples are seen
    twice that epoch), and ``drop_last=True`` drops the last, incomplete round (its samples are not seen
    that epoch).

    Resuming mid-epoch: :meth:`state_dict` holds the epoch and how many batches this rank's iterator has
    handed out; after :meth:`load_state_dict`, the next iteration skips those and yields exactly the rest
    of the uninterrupted sequence. A ``DataLoader`` with workers, and Lightning (one batch ahead), fetch
    batches before training uses them: for an exact resume, set ``"batches_done"`` in the saved state to
    the number of batches the training loop consumed.

    With Lightning, pass it as a DataLoader's ``batch_sampler`` (and ``collate_fn=pad_collate()``). Under a
    distributed strategy create the Trainer with ``use_distributed_sampler=False``: Lightning would
    otherwise try to rebuild this sampler around a ``DistributedSampler`` (and fail), and this sampler
    already splits the batches between ranks. Lightning calls ``set_epoch`` on a DataLoader's
    ``batch_sampler.sampler``; :attr:`sampler` is this object, so each epoch is shuffled anew with no code.

    Args:
        lengths: Token count of each sample of the dataset (positive ints; a list or a 1-D int tensor).
        max_tokens: The most padded tokens per batch (``samples x longest``).
        shuffle: Shuffle which samples share a chunk and the order of batches. Default True.
        seed: Seed of the shuffles; the same on every rank. Default 0.
        num_replicas: Number of ranks. Default: ``torch.distributed``'s world size when it is initialized,
            otherwise 1.
        rank: This process's rank. Default: ``torch.distributed``'s rank when initialized, otherwise 0.
        drop_last: Drop the last round of batches when it cannot give every rank one, instead of repeating
            batches. Default False.
        bucket_size: Samples per chunk sorted by length. Default 4096; ``None`` sorts the whole dataset
            (least padding, and only the batch order changes between epochs).

    Raises:
        ValueError: If ``max_tokens`` or ``bucket_size`` is not a positive int, ``lengths`` is empty or
            holds a length below 1, ``num_replicas < 1``, or ``rank`` is not in ``[0, num_replicas)``.
        TypeError: If ``lengths`` is not a sequence of ints.

    Example::

        >>> from lightning_memopt.data.token_batching import MaxTokensBatchSampler
        >>> sampler = MaxTokensBatchSampler([5, 60, 7, 64, 6, 8], max_tokens=128, shuffle=False)
        >>> list(sampler)  # 4 short samples padded to 8 tokens, 2 long ones padded to 64
        [[0, 4, 2, 5], [1, 3]]
    """

    def __init__(
        self,
        lengths: Sequence[int] | torch.Tensor,
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        bucket_size: int | None = 4096,
    ) -> None:
        self.lengths = _check_lengths(lengths)
        check_positive_int("max_tokens", max_tokens, meaning="padded tokens per batch")
        self.max_tokens = max_tokens
        if bucket_size is not None:
            check_positive_int("bucket_size", bucket_size, meaning="samples sorted together; None for all")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        initialized = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialized else 1
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        check_positive_int("num_replicas", num_replicas, meaning="the number of ranks")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank must be an int in [0, num_replicas={num_replicas}), got {rank!r}; "
                "pass this process's rank (torch.distributed.get_rank())"
            )
        self.shuffle, self.seed, self.drop_last = bool(shuffle), seed, bool(drop_last)
        self.num_replicas, self.rank, self.bucket_size = num_replicas, rank, bucket_size
        self.epoch = 0
        self._batches_done = 0  # batches of this epoch handed out by the current (or last) iterator
        self._resume_at = 0  # batches to skip at the next __iter__ (set by load_state_dict)
        self._cache: tuple[int, list[list[int]]] | None = None  # (epoch, this rank's batches)
        oversized = [n for n in self.lengths if n > self.max_tokens]
        if oversized:
            warnings.warn(
                f"MaxTokensBatchSampler: {len(oversized)} sample(s) are longer than max_tokens="
                f"{self.max_tokens} (the longest: {max(oversized)} tokens); each gets a batch of its own, "
                "over max_tokens. Raise max_tokens or truncate those samples.",
                stacklevel=2,
            )

    @property
    def sampler(self) -> MaxTokensBatchSampler:
        """This sampler: where Lightning looks (``batch_sampler.sampler``) for ``set_epoch``."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffles of ``epoch`` from the next iteration on (call it before each epoch).

        Setting the epoch a resumed state is in keeps the resume position; another epoch starts at its
        beginning.
        """
        if epoch != self.epoch:
            self._resume_at = 0
        self.epoch = epoch

    def _epoch_batches(self) -> list[list[int]]:
        """Every batch of this epoch, for all ranks, in order (the same list on every rank)."""
        n = len(self.lengths)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=generator).tolist() if self.shuffle else list(range(n))
        size = n if self.bucket_size is None else self.bucket_size
        batches: list[list[int]] = []
        for start in range(0, n, size):
            # A stable sort keeps the shuffled order among samples of equal length.
            chunk = sorted(order[start : start + size], key=self.lengths.__getitem__)
            batches += _fill(chunk, self.lengths, self.max_tokens)
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        return batches

    def _rank_batches(self) -> list[list[int]]:
        """This rank's batches of the current epoch (computed once per epoch)."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        batches = self._epoch_batches()
        rounds = len(batches) // self.num_replicas
        if self.drop_last or len(batches) % self.num_replicas == 0:
            batches = batches[: rounds * self.num_replicas]
        else:
            missing = (rounds + 1) * self.num_replicas - len(batches)
            batches = batches + [batches[i % len(batches)] for i in range(missing)]
        mine = batches[self.rank :: self.num_replicas]
        self._cache = (self.epoch, mine)
        return mine

    def __len__(self) -> int:
        """Batches this rank gets in the current epoch (the whole epoch, also when resuming in it)."""
        return len(self._rank_batches())

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._rank_batches()
        start, self._resume_at = self._resume_at, 0
        self._batches_done = start
        for batch in batches[start:]:
            self._batches_done += 1
            yield list(batch)

    def state_dict(self) -> dict[str, int]:
        """``{"seed", "epoch", "batches_done"}``: where this rank is in the epoch (plain ints).

        ``batches_done`` counts the batches this rank's iterator handed out this epoch; a prefetching
        DataLoader hands them out before training uses them (see the class docstring).
        """
        return {"seed": self.seed, "epoch": self.epoch, "batches_done": self._batches_done}

    def load_state_dict(self, state_dict: Mapping[str, int]) -> None:
        """Continue where ``state_dict`` was taken: its epoch, skipping its ``batches_done`` batches.

        Raises:
            ValueError: If a key is missing, the state was saved with another seed (the sequence would differ), or
                ``batches_done`` is negative or more than this rank has in that epoch.
        """
        missing = {"seed", "epoch", "batches_done"} - set(state_dict)
        if missing:
            raise ValueError(
                f"the state misses {sorted(missing)}; pass what MaxTokensBatchSampler.state_dict() returned"
            )
        if state_dict["seed"] != self.seed:
            raise ValueError(
                f"the state was saved with seed={state_dict['seed']}, this sampler has seed={self.seed}; "
                "create the sampler with the saved seed to resume the same sequence"
            )
        self.epoch = int(state_dict["epoch"])
        done = int(state_dict["batches_done"])
        if not 0 <= done <= len(self):
            raise ValueError(
                f"batches_done={done} is outside [0, {len(self)}], the batches of epoch {self.epoch} on rank "
                f"{self.rank}; was the state saved with another dataset, max_tokens or num_replicas?"
            )
        self._resume_at = self._batches_done = done


def _fill(sorted_indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Cut indices sorted by increasing length into batches of at most ``max_tokens`` padded tokens."""
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in sorted_indices:
        # Lengths increase, so the newcomer is the longest: the padded size would be (count + 1) * lengths[i].
        if batch and (len(batch) + 1) * lengths[i] > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)  # alone in a batch, a sample over max_tokens still gets one
    if batch:
        batches.append(batch)
    return batches


def padding_tokens(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> tuple[int, int]:
    """``(padding tokens, padded tokens)`` of ``batches`` of indices right-padded to their longest sample.

    Example::

        >>> padding_tokens([[0, 1], [2]], [3, 5, 4])  # batch 0: 2 x 5 tokens, 2 of them padding
        (2, 14)
    """
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches if len(b))
    real = sum(lengths[i] for b in batches for i in b)
    return padded - real, padded


def pad_collate(
    pad_value: int = 0, label_pad: int = -100
) -> Callable[[Sequence[Any]], dict[str, torch.Tensor]]:
    """A ``collate_fn`` that right-pads token sequences into ``input_ids``, ``attention_mask`` and ``labels``.

    Each sample is a 1-D integer tensor or list of token ids, or a mapping with ``"input_ids"`` and
    optionally ``"labels"`` (same length). ``labels`` default to the ``input_ids`` (a causal language
    model shifts them itself, as Hugging Face models do); padding positions get ``label_pad`` there, which
    the loss ignores, ``pad_value`` in ``input_ids`` and 0 in ``attention_mask``.

    Args:
        pad_value: Token id written at padding positions of ``input_ids``. Default 0.
        label_pad: Label at padding positions. Default -100 (``cross_entropy``'s ``ignore_index``).

    Example::

        >>> batch = pad_collate()([[5, 6, 7], [8]])
        >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["labels"].tolist()
        ([[5, 6, 7], [8, 0, 0]], [[1, 1, 1], [1, 0, 0]], [[5, 6, 7], [8, -100, -100]])
    """

    def collate(samples: Sequence[Any]) -> dict[str, torch.Tensor]:
        if len(samples) == 0:
            raise ValueError("pad_collate got an empty batch")
        ids, labels = [], []
        for sample in samples:
            if isinstance(sample, Mapping):
                tokens = torch.as_tensor(sample["input_ids"])
                target = torch.as_tensor(sample.get("labels", tokens))
            else:
                tokens = target = torch.as_tensor(sample)
            if tokens.dim() != 1 or target.shape != tokens.shape:
                raise ValueError(
                    f"pad_collate needs 1-D token sequences with labels of the same length, got input_ids of "
                    f"shape {tuple(tokens.shape)} and labels of shape {tuple(target.shape)}"
                )
            ids.append(tokens)
            labels.append(target)
        longest = max(len(t) for t in ids)
        input_ids = torch.full((len(ids), longest), pad_value, dtype=torch.long)  # (B, T)
        out_labels = torch.full((len(ids), longest), label_pad, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(ids), longest), dtype=torch.long)  # (B, T)
        for row, (tokens, target) in enumerate(zip(ids, labels)):
            input_ids[row, : len(tokens)] = tokens
            out_labels[row, : len(tokens)] = target
            mask[row, : len(tokens)] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": out_labels}

    return collate
