"""Step-time overhead of the micro-batch engine at k=1 (one micro-batch per step), as a ratio.

One fit, steps alternating between Lightning with the engine installed (OOMBackoff, no OOM happens:
one micro-batch per step, which still snapshots RNG and buffers each step and logs through the
engine) and plain Lightning (the engine removed), timed in process CPU time on one thread so that
other processes on the machine count for neither. Prints the ratio of the median step times. Run: python benchmarks/engine_overhead.py
"""

from __future__ import annotations

import statistics
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import OOMBackoff


class Model(pl.LightningModule):
    def __init__(self, width: int = 512, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Alternate(pl.Callback):
    """Installs the engine on even steps and removes it on odd ones, timing each step (CPU time)."""

    def __init__(self, backoff: OOMBackoff) -> None:
        self.backoff = backoff
        self.times: dict[bool, list[float]] = {True: [], False: []}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.on = batch_idx % 2 == 0
        engine = self.backoff.engine
        if self.on and not engine.installed:
            engine.install(trainer)
        elif not self.on and engine.installed:
            engine.uninstall()
        self._t = time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= 4:  # warm-up
            self.times[self.on].append(time.process_time() - self._t)


def main(steps: int = 200, width: int = 512, batch: int = 256) -> None:
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(steps * batch, width), torch.randn(steps * batch, 1))
    backoff = OOMBackoff()
    timer = Alternate(backoff)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=[backoff, timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(width), DataLoader(data, batch_size=batch))
    engine, plain = statistics.median(timer.times[True]), statistics.median(timer.times[False])
    print(f"model: 4 x (Linear({width}) + BatchNorm) + AdamW, batch {batch}, {steps} steps, 1 thread")
    print("steps alternate in one fit: with the engine (OOMBackoff, k=1, no OOM) / without it")
    print(f"median CPU time per step: engine {engine * 1e3:.2f} ms, plain {plain * 1e3:.2f} ms")
    print(f"overhead ratio at k=1: {engine / plain:.4f}")


if __name__ == "__main__":
    main()
