"""A variable-length corpus made in code, shared by the token-batching tests and benchmark."""

from __future__ import annotations

import math

import torch


def long_tailed_lengths(
    n: int, *, low: int = 16, high: int = 2048, median: int = 128, seed: int = 0
) -> list[int]:
    """``n`` sequence lengths, log-normal (most near ``median``, a long tail) clipped to ``[low, high]``.

    ``sigma = 1`` puts about 1 sample in 40 above ``median * e^2`` (~950 tokens for the default median).
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(math.log(median) + torch.randn(n, generator=g, dtype=torch.float64))
    return lengths.round().clamp(low, high).long().tolist()


def token_sequences(lengths: list[int], *, vocab: int = 256, seed: int = 0) -> list[torch.Tensor]:
    """One random token sequence (``int64``, values in ``[1, vocab)``; 0 is the padding id) per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g) for n in lengths]


def random_batches(n: int, batch_size: int, *, seed: int = 0) -> list[list[int]]:
    """Shuffled indices cut into batches of ``batch_size`` (the last one may be smaller): random batching."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]
