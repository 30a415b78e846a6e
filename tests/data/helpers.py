"""A fake clock and datasets whose items cost a known (fake) time: exact timings without sleeping."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class FakeClock:
    """Marks are the fake time ``now``; the code under test advances it where work would take time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.settles = 0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def mark(self) -> float:
        return self.now

    def settle(self, last: float) -> None:
        self.settles += 1

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CostlyItems(Dataset):
    """``n`` items ``[i, i, i, i]``; each ``__getitem__`` advances ``clock`` by ``cost`` seconds."""

    def __init__(self, clock: FakeClock | None = None, cost: float = 0.0, n: int = 64) -> None:
        self.clock, self.cost, self.n = clock, cost, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.clock is not None:
            self.clock.advance(self.cost)
        return torch.full((4,), float(index))
