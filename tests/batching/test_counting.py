"""The default weighting of micro-batch losses: what the package can read from a batch, and its one warning."""

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import AutoAccumulation, OOMBackoff
from lightning_memopt.batching.counting import LabelCount, causal_shift, choose_count
from lightning_memopt.batching.split import micro_batch_weights, split_batch
from tests.batching.helpers import quiet_trainer

LABELS = torch.tensor([[5, 6, -100, -100], [7, -100, -100, -100], [1, 2, 3, 4], [-100, 9, 9, -100]])


def test_label_count_with_and_without_the_causal_shift():
    assert LabelCount()({"labels": LABELS}) == 9
    assert LabelCount(shift=True)({"labels": LABELS}) == 6  # position 0 of each sample predicts nothing
    assert LabelCount(key="y")({"y": LABELS[:1]}) == 2
    assert LabelCount(shift=True)({"labels": torch.tensor([3, -100, 1])}) == 2  # per-sample labels: no shift


def test_choose_count():
    batch = {"input_ids": LABELS.clamp(min=0), "labels": LABELS}
    assert choose_count(batch, shift=True) == (LabelCount(shift=True), None)
    assert choose_count(batch, shift=False) == (LabelCount(shift=False), None)
    count, warning = choose_count(batch, shift=None)  # HF models that disagree: counted, but said
    assert count == LabelCount() and "pass count_fn=" in warning
    # samples, silently: image labels, float targets, no labels
    assert choose_count({"x": torch.zeros(4, 2), "labels": torch.arange(4)}, shift=True) == (
        LabelCount(shift=True),
        None,
    )
    assert choose_count((torch.zeros(4, 2), torch.zeros(4)), shift=False) == (None, None)
    assert choose_count({"x": torch.zeros(4), "labels": torch.zeros(4)}, shift=False) == (None, None)
    # -100 in an integer tensor outside the convention: samples, and a warning naming the option
    count, warning = choose_count((torch.zeros(4, 2), LABELS), shift=False)
    assert count is None
    assert "batch[1] is an integer tensor holding -100" in warning
    assert "count_fn=lambda mb: (mb[1] != -100).sum()" in warning


def test_label_weights_reproduce_the_token_mean():
    logits = torch.randn(4, 4, 10, generator=torch.Generator().manual_seed(0))
    batch = {"logits": logits, "labels": LABELS}

    def loss(b):
        return torch.nn.functional.cross_entropy(b["logits"].flatten(0, 1), b["labels"].flatten())

    parts = split_batch(batch, [2, 2])
    weights = micro_batch_weights(parts, [2, 2], LabelCount())
    assert weights == [3 / 9, 6 / 9]
    combined = sum(w * loss(p) for w, p in zip(weights, parts))
    torch.testing.assert_close(combined, loss(batch), rtol=1e-12, atol=0)
    by_samples = sum(0.5 * loss(p) for p in parts)
    assert abs(by_samples - loss(batch)) > 1e-2  # why samples are not enough


def test_a_module_without_hugging_face_models_counts_labels_unshifted():
    assert causal_shift(torch.nn.Sequential(torch.nn.Linear(2, 2))) is False


class TokenTagger(pl.LightningModule):
    """A tuple batch ``(x, y)`` with -100 in y: a token-mean loss the package cannot see into."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 5, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _tagging_data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 4, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (12, 4), generator=g)
    y[torch.rand(12, 4, generator=g) < 0.4] = -100
    y[:, 0] = torch.randint(0, 5, (12,), generator=g)  # every sample counts at least one position
    return DataLoader(TensorDataset(x, y), batch_size=6)


def _fit(callbacks) -> TokenTagger:
    module = TokenTagger()
    quiet_trainer(callbacks, max_steps=2).fit(module, _tagging_data())
    return module


def test_unreadable_loss_warns_once_and_count_fn_makes_it_exact():
    reference = _fit([])
    with pytest.warns(UserWarning, match=r"batch\[1\] is an integer tensor holding -100") as record:
        _fit([AutoAccumulation(micro_batch_size=2, log=False)])
    assert sum("holding -100" in str(w.message) for w in record) == 1  # two steps, three splits each: once
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*holding -100.*")
        exact = _fit(
            [
                OOMBackoff(count_fn=lambda mb: (mb[1] != -100).sum(), log=False),
                AutoAccumulation(micro_batch_size=2, log=False),
            ]
        )
    torch.testing.assert_close(exact.layer.weight, reference.layer.weight, rtol=1e-12, atol=0)


class DictTagger(TokenTagger):
    def training_step(self, batch, batch_idx):
        loss = super().training_step((batch["x"], batch["labels"]), batch_idx)
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses = [*getattr(self, "losses", []), float(outputs["loss"])]


def test_a_micro_batch_without_counted_items_weighs_nothing():
    # samples 0 and 1 have only -100 labels: that micro-batch's mean is NaN and must not poison anything
    x, y = next(iter(_tagging_data()))
    y[:2] = -100
    data = DataLoader([{"x": a, "labels": b} for a, b in zip(x, y)], batch_size=6)
    modules = []
    for callbacks in ([], [AutoAccumulation(micro_batch_size=2, log=False)]):
        modules.append(DictTagger())
        trainer = quiet_trainer(callbacks, max_steps=1)
        trainer.fit(modules[-1], data)
        assert torch.isfinite(trainer.callback_metrics["loss"])
    reference, split = modules
    torch.testing.assert_close(split.layer.weight, reference.layer.weight, rtol=1e-12, atol=0)
    assert split.losses == pytest.approx(reference.losses, rel=1e-6)  # the step returns a float32 loss
