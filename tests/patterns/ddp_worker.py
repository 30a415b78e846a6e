"""One rank of the DDP pattern (started by test_ddp.py through ``tests.distributed.run_ranks``).

``DDPStrategy(find_unused_parameters=True)`` on two gloo CPU processes, float64, with a branch used only
on odd batches and a layer never used, AdamW with weight decay (a zero gradient where plain DDP leaves
``None`` moves a parameter). Three runs in these two processes (start-up dominates): plain DDP,
``AutoAccumulation(micro_batch_size=2)``, and ``OOMBackoff`` after an OOM on rank 1 only. Each writes
OUT/<mode>-rank<r>.json: the parameters at the start and at the end, which gradients were None before each optimizer step,
and the ``train_loss`` logged with ``sync_dist=True`` at each step.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_memopt.testing import OOMInjector
from tests.distributed import full_params
from tests.patterns.helpers import BATCH, loader, package_callbacks

FEATURES, STEPS, RANKS = 4, 3, 2


class Branchy(pl.LightningModule):
    """``self.branch`` joins on odd batches only; ``self.never`` is never used (a leftover layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, 8)
        self.branch = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.grad_is_none: list[dict[str, bool]] = []
        self.logged: list[float] = []
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.sizes.append(len(x))
        h = torch.tanh(self.net(x))
        if batch_idx % 2 == 1:
            h = h + torch.tanh(self.branch(h))
        loss = F.mse_loss(self.head(h), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.grad_is_none.append({name: p.grad is None for name, p in self.named_parameters()})

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.logged.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(RANKS * BATCH * STEPS, FEATURES, generator=g)
    return loader(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(len(x), 1, generator=g))


def run(mode: str, path: str) -> None:
    pl.seed_everything(0, verbose=False)
    module = Branchy()
    start = full_params(module)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy=DDPStrategy(process_group_backend="gloo", find_unused_parameters=True),
        max_steps=STEPS,
        callbacks=package_callbacks(mode),
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    injector = (
        OOMInjector(module.net, max_size=BATCH // 2, ranks={1}) if mode == "oom" else contextlib.nullcontext()
    )
    with injector:
        trainer.fit(module, data())
    result = {
        "start": start,
        "params": full_params(module),
        "grad_is_none": module.grad_is_none,
        "logged": module.logged,
        "sizes": module.sizes,
        "oom_raised": getattr(injector, "raised", 0),
    }
    with open(path, "w") as f:
        json.dump(result, f)


def main(out: str) -> None:
    torch.set_default_dtype(torch.float64)
    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    for mode in ("plain", "split", "oom"):
        run(mode, os.path.join(out, f"{mode}-rank{rank}.json"))
