"""How AutoAccumulation's probing does against the true largest micro-batch, on CPU.

For a BatchNorm+dropout MLP and batches of 32, the peak live bytes of one forward+backward are
measured at every size (MemoryTracker, outside Lightning), as a split step's later micro-batches run it
(the gradients held from the start); a capacity halfway between the peaks of
``true_max`` and ``true_max + 1`` makes ``true_max`` the right answer. Prints, per capacity, the size
AutoAccumulation found, the probe steps it spent, and the evaluation size it probed.
Run: python benchmarks/engine_probing.py
"""

from __future__ import annotations

import tempfile

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import AutoAccumulation
from lightning_memopt.memory import MemoryTracker


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16),
            torch.nn.BatchNorm1d(16),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(16, 1),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(batch: int = 32) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 8, generator=g), torch.randn(batch, 1, generator=g)
    peaks = {}
    for size in range(2, batch + 1):
        model = Net()
        with MemoryTracker(model) as tracker:
            for p in model.parameters():  # held from the start, as in a split step's later micro-batches
                p.grad = torch.zeros_like(p)
            # slices of the whole batch, as in a training step (the collated batch is alive anyway)
            torch.nn.functional.mse_loss(model.net(x[:size]), y[:size]).backward()
        peaks[size] = tracker.peak
    print(
        f"{'true max':>8} {'found':>6} {'found/true':>10} {'probes':>6}  sizes probed        eval size (probes)"
    )
    for true_max in (5, 13, 22, 31):
        callback = AutoAccumulation(max_memory=(peaks[true_max] + peaks[true_max + 1]) // 2, headroom=0.0)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=1,
            callbacks=[callback],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            default_root_dir=tempfile.mkdtemp(),
        )
        trainer.fit(Net(), DataLoader(TensorDataset(x, y), batch_size=batch))
        found = callback.micro_batch_size
        sizes = str([s for s, _ in callback.probes])
        print(
            f"{true_max:>8} {found:>6} {found / true_max:>10.0%} {len(callback.probes):>6}  {sizes:<18}"
            f"  {callback.engine.sizes.eval_size} ({len(callback.eval_probes)})"
        )


if __name__ == "__main__":
    main()
