"""What exactness by verification costs: the loss observer, the learned weights, the one-time check.

Run from the repository root (about a minute on 2 CPU cores; never run by the test suite)::

    PYTHONPATH=. python benchmarks/exactness.py

One model (4 x (Linear(512) + LayerNorm + ReLU), a classifier head, cross-entropy, AdamW), batches of 256,
one thread, CPU time per training step (``time.process_time``: other processes on the machine count for
neither side). Each row alternates its two configurations step by step within one fit and prints the
ratio of their median step times:

- ``k=1``: ``AutoAccumulation`` with the whole batch as one micro-batch (the engine installed, nothing
  observed) / plain Lightning (the engine removed for that step).
- ``k=4, learned``: four micro-batches weighed by the rule learned from the loss on the first split step
  (nothing observed after it) / four micro-batches weighed by a ``count_fn`` given by the user.
- ``k=4, observed``: four micro-batches whose loss calls are recorded and decomposed every step (what a
  loss whose parts follow different rules costs: ``ce`` over tokens plus a term over samples) / the same
  with ``count_fn``.
- ``check``: the first split step (k=4), which runs its first micro-batch (64 samples) again whole and as
  two halves to compare the gradients, / the same step with ``exactness="off"`` (fits alternated, 5 each,
  medians), without dropout and with dropout (p=0.1: both runs without dropout).
"""

from __future__ import annotations

import statistics
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import AutoAccumulation

WIDTH, BATCH, CLASSES = 512, 256, 10


class Model(pl.LightningModule):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(4):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.ReLU()]
            layers.append(torch.nn.Dropout(dropout))
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, CLASSES))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Alternate(pl.Callback):
    """Puts the run in configuration ``a`` on even steps and ``b`` on odd ones (``switch(trainer, on)``)
    and times every step (CPU time); the first ``warmup`` steps are not counted."""

    def __init__(self, switch, warmup: int = 4) -> None:
        self.switch, self.warmup = switch, warmup
        self.times: dict[bool, list[float]] = {True: [], False: []}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.on = batch_idx % 2 == 0
        self.switch(trainer, self.on)
        self._t = time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup:
            self.times[self.on].append(time.process_time() - self._t)

    def ratio(self) -> float:
        return statistics.median(self.times[True]) / statistics.median(self.times[False])


class StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self._t = time.process_time()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.process_time() - self._t)


def data(steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCH, WIDTH, generator=g)
    return DataLoader(
        TensorDataset(x, torch.randint(0, CLASSES, (steps * BATCH,), generator=g)), batch_size=BATCH
    )


def fit(callbacks: list[pl.Callback], steps: int, dropout: float = 0.0) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(dropout), data(steps))


def samples(micro_batch) -> int:
    return len(micro_batch[0])


def k1(steps: int) -> float:
    auto = AutoAccumulation(micro_batch_size=BATCH, log=False)

    def switch(trainer, on):
        if on and not auto.engine.installed:
            auto.engine.install(trainer)
        elif not on and auto.engine.installed:
            auto.engine.uninstall()

    timer = Alternate(switch)
    fit([auto, timer], steps)
    return timer.ratio()


def k4(steps: int, *, observed: bool) -> float:
    auto = AutoAccumulation(micro_batch_size=BATCH // 4, log=False, exactness="off")

    def switch(trainer, on):
        weights = auto.engine.weights
        weights.count_fn = None if on else samples
        if on and observed:
            weights.learned.clear()  # learned again from the loss: every step observed

    timer = Alternate(switch)
    fit([auto, timer], steps)
    return timer.ratio()


def check(dropout: float, repeats: int = 5) -> float:
    """The first split step with the check / the first split step without it (fits alternated)."""
    first: dict[str, list[float]] = {"warn": [], "off": []}
    for _ in range(repeats):
        for exactness in first:
            timer = StepTimes()
            fit(
                [AutoAccumulation(micro_batch_size=BATCH // 4, log=False, exactness=exactness), timer],
                2,
                dropout,
            )
            first[exactness].append(timer.times[0])
    return statistics.median(first["warn"]) / statistics.median(first["off"])


def main(steps: int = 120) -> None:
    torch.set_num_threads(1)
    print(
        f"model: 4 x (Linear({WIDTH}) + LayerNorm + ReLU) + Linear({WIDTH}, {CLASSES}), cross-entropy, AdamW"
    )
    print(f"batch {BATCH}, {steps} steps per row, one thread, median CPU time per step, steps alternating\n")
    print(f"{'row':<52}{'ratio':>8}")
    print(f"{'k=1: engine installed / plain Lightning':<52}{k1(steps):>8.4f}")
    print(f"{'k=4: weights from the learned rule / from count_fn':<52}{k4(steps, observed=False):>8.4f}")
    print(f"{'k=4: loss observed every step / count_fn':<52}{k4(steps, observed=True):>8.4f}")
    print(f"{'check: first split step / without the check':<52}{check(0.0):>8.4f}")
    print(f"{'check, dropout 0.1: first split step / without it':<52}{check(0.1):>8.4f}")


if __name__ == "__main__":
    main()
