"""Tiny Lightning modules and runners shared by the engine's tests."""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


def dataset(n: int = 40, features: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class Net(pl.LightningModule):
    """A two-layer MLP; with ``batchnorm``/``dropout`` it is not deterministic per sample any more."""

    def __init__(self, optimizer: str = "sgd", batchnorm: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = [torch.nn.Linear(8, 16)]
        if batchnorm:
            layers.append(torch.nn.BatchNorm1d(16))
        layers += [torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 1)]
        self.net = torch.nn.Sequential(*layers)
        self.optimizer = optimizer
        self.events: list[str] = []
        self.step_losses: list[float] = []
        self.logged_losses: list[float] = []
        self.seen_sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen_sizes.append(len(x))
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss)
        return loss

    def on_before_backward(self, loss):
        self.events.append("before_backward")

    def on_after_backward(self):
        self.events.append("after_backward")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_losses.append(float(outputs["loss"]))
        self.logged_losses.append(float(self.trainer.callback_metrics["train_loss_step"]))

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.05)


def quiet_trainer(callbacks=(), **kwargs) -> pl.Trainer:
    """A CPU Trainer without logger, checkpoints, progress bar, summary or validation; ``kwargs`` override."""
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **options)


def fit(model: pl.LightningModule, callbacks=(), *, steps: int = 4, batch: int = 10, tmp_path=None, **kwargs):
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = quiet_trainer(callbacks, max_steps=steps, default_root_dir=tmp_path, **kwargs)
    trainer.fit(model, DataLoader(dataset(), batch_size=batch, shuffle=False), ckpt_path=ckpt_path)
    return trainer


def assert_params_close(a: torch.nn.Module, b: torch.nn.Module, rel: float) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        err = ((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item()
        assert err <= rel, f"{name}: relative difference {err:.3g} > {rel}"


def oom(where: str) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate 2.00 MiB (test injection in {where})"
    )


def patch_regime(monkeypatch, name: str, value) -> None:
    """Replace ``lightning_memopt.batching.regime``'s ``name`` with ``value``, also where the engine's
    modules imported it by name (``is_distributed``, ``find_sharding``, ``drop_attempt``)."""
    from lightning_memopt.batching import engine, regime, step

    for module in (regime, engine, step):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)


class DeviceReads(pl.Callback):
    """Every read of a tensor's value that the package makes (``float(t)``, ``t.item()``, ``t.tolist()``,
    ...: on a GPU each waits for the device's queued work), by the optimizer step it falls in (1 for the
    first); the methods are spied on through ``monkeypatch`` for the test's duration."""

    METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")

    def __init__(self, monkeypatch) -> None:
        self.reads: list[tuple[int, str]] = []
        self.step = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def spy(tensor, *args, _name=name, _original=original, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if "lightning_memopt" in caller:
                    self.reads.append(
                        (self.step, f"{_name} in lightning_memopt{caller.rsplit('lightning_memopt', 1)[1]}")
                    )
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, spy)

    def on_train_batch_start(self, *args) -> None:
        self.step += 1

    def since(self, step: int) -> list[str]:
        """The reads of the optimizer steps from ``step`` on: the method and the package's file."""
        return [where for at, where in self.reads if at >= step]
