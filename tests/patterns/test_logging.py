"""What ``training_step`` logs must read the same whether the batch was split or not.

``self.log`` and ``self.log_dict`` as Lightning's docs write them, every built-in ``reduce_fx``, and a
torchmetrics ``Metric`` object logged on step and on epoch; a :class:`Recorder` logger keeps every row
Lightning sends (``log_every_n_steps=1``). Twenty samples in batches of 8 (8, 8, 4: one epoch of three
steps, the last one short) split into micro-batches of 3 (3 + 3 + 2, and 3 + 1), so that a mean that
forgets the sizes, or a last micro-batch standing for the batch, cannot pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from tests.patterns.helpers import (
    CLASSES,
    MLP,
    MODES,
    assert_exact,
    assert_same_values,
    classification,
    train,
)

SAMPLES, MICRO = 20, 3


class LogLoss(MLP):
    """The docs' first example: the mean loss logged with ``self.log``, on step and on epoch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


class LogSumLoss(MLP):
    """A sum-reduced loss logged as it is: the step's value is the batch's total."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y, reduction="sum")
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


class LogDict(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        accuracy = (logits.argmax(dim=-1) == y).double().mean()
        self.log_dict({"train_loss": loss, "train_accuracy": accuracy})
        return loss


class ReduceFx(MLP):
    """Logs a per-sample statistic of the batch with the matching ``reduce_fx``: the mean error with
    "mean", the total with "sum", the largest and smallest with "max" and "min"."""

    def __init__(self, fx: str) -> None:
        super().__init__()
        self.fx = fx

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        error = 1 - torch.softmax(logits, dim=-1).gather(1, y[:, None]).squeeze(1)  # (B,)
        value = {"mean": error.mean(), "sum": error.sum(), "max": error.max(), "min": error.min()}[self.fx]
        self.log("error", value, on_step=True, on_epoch=True, reduce_fx=self.fx)
        return F.cross_entropy(logits, y)


class WithMetric(MLP):
    """A torchmetrics ``Metric`` updated in ``training_step`` and logged as the object (the
    torchmetrics-in-Lightning docs' pattern), on step and on epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.train_acc = MulticlassAccuracy(num_classes=CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return F.cross_entropy(logits, y)


def fit(make, mode: str):
    return train(
        make,
        lambda: classification(SAMPLES),
        mode,
        record=True,
        k=MICRO,
        max_epochs=1,
        steps=-1,
        log_every_n_steps=1,
    )


@pytest.fixture(scope="module")
def runs() -> dict:
    return {}


def run(runs: dict, name: str, make, mode: str):
    if (name, mode) not in runs:
        runs[name, mode] = fit(make, mode)
    return runs[name, mode]


def assert_logged_alike(got, expected, key: str) -> None:
    assert_same_values(got.logger.values(key), expected.logger.values(key), key)
    assert_same_values([got.metric(key)], [expected.metric(key)], f"callback_metrics[{key!r}]")


PATTERNS = {
    "log_mean_loss": (LogLoss, ["train_loss_step", "train_loss_epoch"]),
    "log_sum_loss": (LogSumLoss, ["train_loss_step", "train_loss_epoch"]),
    "log_dict": (LogDict, ["train_loss", "train_accuracy"]),
    "reduce_fx_mean": (lambda: ReduceFx("mean"), ["error_step", "error_epoch"]),
    "reduce_fx_sum": (lambda: ReduceFx("sum"), ["error_step", "error_epoch"]),
    "reduce_fx_max": (lambda: ReduceFx("max"), ["error_step", "error_epoch"]),
    "reduce_fx_min": (lambda: ReduceFx("min"), ["error_step", "error_epoch"]),
    "metric_object": (WithMetric, ["train_acc_step", "train_acc_epoch"]),
}


def value_cases():
    for name, (_, keys) in PATTERNS.items():
        for key in keys:
            yield pytest.param(name, key, id=f"{name}-{key}")


def training_cases():
    for name in PATTERNS:
        yield pytest.param(name, id=name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "key"), list(value_cases()))
def test_logged_value_is_the_unsplit_steps(name: str, key: str, mode: str, runs: dict) -> None:
    make = PATTERNS[name][0]
    assert_logged_alike(run(runs, name, make, mode), run(runs, name, make, "plain"), key)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(training_cases()))
def test_logging_patterns_train_exactly(name: str, mode: str, runs: dict) -> None:
    make = PATTERNS[name][0]
    assert_exact(run(runs, name, make, mode), run(runs, name, make, "plain"))
