"""Lightning features users combine with micro-batching: what already works stays exact (LR schedulers,
gradient clipping, frozen layers, tied weights, resuming mid-fit, an evaluation loop that logs), and what
cannot work is refused early (an accumulation schedule) or handled (``BatchSizeFinder`` with
``OOMBackoff``)."""

from __future__ import annotations

import gc

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BatchSizeFinder, GradientAccumulationScheduler
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_memopt import AutoAccumulation, OOMBackoff
from lightning_memopt.testing import OOMInjector
from tests.patterns.helpers import (
    BATCH,
    CLASSES,
    FEATURES,
    MLP,
    MODES,
    K,
    Run,
    assert_exact,
    assert_same_values,
    classification,
    loader,
    no_split_warning,
    quiet_trainer,
    train,
)

VOCAB, SAMPLES = 9, 3 * BATCH


def tokens():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (SAMPLES, 5), generator=g)
    return loader(ids[:, :-1], ids[:, 1:])


class Classifier(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.steps_run = 0

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


class WithScheduler(Classifier):
    """A per-step LR schedule, as ``configure_optimizers`` returns one in the docs."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Frozen(Classifier):
    """The first layer frozen (fine-tuning a head)."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)


class Tied(pl.LightningModule):
    """A language model whose output layer shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Embedding(VOCAB, 6)
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.net.weight

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        logits = self.head(torch.tanh(self.net(ids)))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class WithValidation(Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("module", "data", "options"),
    [
        pytest.param(WithScheduler, classification, {}, id="lr_scheduler"),
        pytest.param(Classifier, classification, {"gradient_clip_val": 0.05}, id="clip_norm"),
        pytest.param(
            Classifier,
            classification,
            {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
            id="clip_value",
        ),
        pytest.param(Frozen, classification, {}, id="frozen_layer"),
        pytest.param(Tied, tokens, {}, id="tied_weights"),
    ],
)
def test_already_exact(module, data, options, mode) -> None:
    reference = train(module, data, **options)
    with no_split_warning():
        run = train(module, data, mode, **options)
    assert_exact(run, reference)
    for name, p in run.module.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, run.start[name]), f"frozen {name} moved"
    if module is Tied:
        assert run.module.head.weight is run.module.net.weight


@pytest.fixture(scope="module")
def validated() -> dict:
    """Validation every step, split too (``eval_micro_batch_size``), per mode."""
    kwargs = dict(limit_val_batches=2, val_check_interval=1, check_val_every_n_epoch=None, record=True)
    return {
        mode: train(
            WithValidation,
            lambda: (classification(), classification()),
            mode,
            options={"eval_micro_batch_size": K} if mode == "split" else {},
            **kwargs,
        )
        for mode in ("plain", *MODES)
    }


@pytest.mark.parametrize("mode", MODES)
def test_validation_loop_training_is_exact(mode: str, validated: dict) -> None:
    assert_exact(validated[mode], validated["plain"])


@pytest.mark.parametrize(
    "mode",
    [
        "split",
        "oom",
    ],
)
def test_validation_logged_value_is_exact(mode: str, validated: dict) -> None:
    """The logged ``val_loss`` of the trained model equals the unsplit run's, at every validation."""
    got, expected = validated[mode].logger.values("val_loss"), validated["plain"].logger.values("val_loss")
    assert_same_values(got, expected, "val_loss")


def resumed(mode: str, path) -> Run:
    """Two steps, a checkpoint, then a new module and Trainer resuming from it to four steps."""
    first = train(Classifier, classification, mode, steps=2)
    first.trainer.save_checkpoint(path)
    return train(Classifier, classification, mode, steps=4, ckpt_path=path)


@pytest.mark.parametrize("mode", MODES)
def test_resume_mid_fit_is_exact(mode: str, tmp_path) -> None:
    """A run resumed mid-fit (AdamW's state and the package's state from the checkpoint) ends where the
    plain run resumed the same way ends."""
    reference = resumed("plain", tmp_path / "plain.ckpt")
    assert_exact(resumed(mode, tmp_path / f"{mode}.ckpt"), reference)


@pytest.mark.parametrize("callback", [AutoAccumulation, OOMBackoff])
def test_accumulation_schedule_is_refused_before_the_first_batch(callback) -> None:
    module = Classifier()
    trainer = quiet_trainer(
        [GradientAccumulationScheduler({0: 1, 1: 2}), callback(log=False)], steps=-1, max_epochs=2
    )
    with pytest.raises(MisconfigurationException, match="GradientAccumulationScheduler"):
        trainer.fit(module, classification())
    assert module.steps_run == 0


class Tunable(Classifier):
    """Lightning's BatchSizeFinder pattern: the batch size is a module attribute its DataLoader reads."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2
        g = torch.Generator().manual_seed(0)
        self.x, self.y = (
            torch.randn(64, FEATURES, generator=g),
            torch.randint(0, CLASSES, (64,), generator=g),
        )

    def train_dataloader(self):
        return loader(self.x, self.y, batch_size=self.batch_size)


def find_batch_size(callbacks, root) -> int:
    """BatchSizeFinder in power mode on a device where more than 16 samples run out of memory."""
    module = Tunable()
    finder = BatchSizeFinder(mode="power", init_val=2, steps_per_trial=1)
    # The finder runs gc.collect() after each trial (for CUDA's cache); with the test process's heap frozen
    # out of the collector's reach those take milliseconds instead of most of this test's time.
    gc.freeze()
    try:
        with OOMInjector(module.net, max_size=16):
            quiet_trainer([finder, *callbacks], steps=2, default_root_dir=root).fit(module)
    finally:
        gc.unfreeze()
    return finder.optimal_batch_size


def test_batch_size_finder_with_oom_backoff_finds_the_same_size_or_refuses(tmp_path) -> None:
    expected = find_batch_size([], tmp_path)
    assert expected == 16
    try:
        found = find_batch_size([OOMBackoff(log=False)], tmp_path)
    except MisconfigurationException as error:
        assert "BatchSizeFinder" in str(error) and "OOMBackoff" in str(error)
    else:
        assert found == expected
