"""Weights learned from the loss as it is computed: the observer, the decomposition, the rules, and fits."""

import doctest
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import AutoAccumulation, OOMBackoff
from lightning_memopt.batching import loss as loss_module
from lightning_memopt.batching.loss import LossObserver, Rule, decompose, learn, shares
from lightning_memopt.batching.split import split_batch
from tests.batching.helpers import quiet_trainer

LABELS = torch.tensor([[5, 6, -100, -100], [7, -100, -100, -100], [1, 2, 3, 4], [-100, 9, 9, -100]])


def observed(fn):
    with LossObserver() as observer:
        loss = fn()
    return loss, observer.terms


def test_the_observer_records_what_each_mean_divides_by():
    logits = torch.randn(4, 4, 10, requires_grad=True)
    _, terms = observed(lambda: F.cross_entropy(logits.flatten(0, 1), LABELS.flatten()))
    assert [(t.name, t.reduction, int(t.count), t.ignore_index) for t in terms] == [
        ("cross_entropy", "mean", 9, -100)
    ]
    _, terms = observed(
        lambda: torch.nn.CrossEntropyLoss(ignore_index=5)(logits.flatten(0, 1), LABELS.flatten().clamp(min=0))
    )
    assert int(terms[0].count) == 15 and terms[0].ignore_index == 5  # the call's own ignore_index
    weight = torch.arange(10, dtype=torch.float)
    _, terms = observed(lambda: F.cross_entropy(logits.flatten(0, 1), LABELS.flatten(), weight=weight))
    assert float(terms[0].count) == float(weight[LABELS[LABELS != -100]].sum())  # class weights
    x = torch.randn(4, 3, requires_grad=True)
    _, terms = observed(
        lambda: F.mse_loss(x, torch.zeros(4, 3)) + F.l1_loss(x, torch.zeros(3), reduction="sum")
    )
    assert [(t.name, t.reduction, None if t.count is None else int(t.count)) for t in terms] == [
        ("mse_loss", "mean", 12),
        ("l1_loss", "sum", None),
    ]
    _, terms = observed(lambda: F.kl_div(x.log_softmax(-1), x.softmax(-1).detach(), reduction="batchmean"))
    assert int(terms[0].count) == 4
    with torch.no_grad():  # not part of any loss: not recorded
        _, terms = observed(lambda: F.mse_loss(x, torch.zeros(4, 3)))
    assert terms == []


def test_decompose_finds_each_part_and_its_kind():
    x = torch.randn(6, 3, requires_grad=True)
    y = torch.randint(0, 3, (6,))

    def parts_of(fn):
        loss, terms = observed(fn)
        return [(p.term.name, p.kind, p.count) for p in decompose(loss, terms)]

    assert parts_of(lambda: F.cross_entropy(x, y) + 0.1 * F.mse_loss(x, torch.zeros(6, 3))) == [
        ("cross_entropy", "mean", 6.0),
        ("mse_loss", "mean", 18.0),
    ]
    assert parts_of(lambda: F.mse_loss(x, torch.zeros(6, 3), reduction="none").sum() / 32) == [
        ("mse_loss", "sum", 18.0)
    ]
    assert parts_of(lambda: F.mse_loss(x, torch.zeros(6, 3), reduction="none").mean()) == [
        ("mse_loss", "mean", 18.0)
    ]
    mask = torch.tensor([1, 1, 0, 1, 0, 0.0])
    masked = lambda: (F.cross_entropy(x, y, reduction="none") * mask).sum() / mask.sum()  # noqa: E731
    assert parts_of(masked) == [("cross_entropy", "mean", 3.0)]
    metric = lambda: F.cross_entropy(x, y) + 0 * F.mse_loss(x, torch.zeros(6, 3)).detach()  # noqa: E731
    assert parts_of(metric) == [("cross_entropy", "mean", 6.0)]


def test_rules_find_which_batch_entries_a_loss_counts():
    batch = {"input_ids": LABELS.clamp(min=0), "labels": LABELS}
    logits = torch.randn(4, 4, 10, requires_grad=True)

    def rules(fn, micro_batch=batch):
        loss, terms = observed(fn)
        (part,) = decompose(loss, terms)
        return learn(part, micro_batch, 4)

    unshifted = rules(lambda: F.cross_entropy(logits.flatten(0, 1), LABELS.flatten()))
    assert str(unshifted[0]) == "(batch['labels'] != -100).sum()" and str(unshifted[-1]) == "samples"
    shifted = rules(lambda: F.cross_entropy(logits[:, :-1].flatten(0, 1), LABELS[:, 1:].flatten()))
    assert str(shifted[0]) == "(batch['labels'][:, 1:] != -100).sum()"
    padded_by_zero = rules(
        lambda: F.cross_entropy(logits.flatten(0, 1), LABELS.clamp(min=0).flatten(), ignore_index=0)
    )
    assert str(padded_by_zero[0]) == "(batch['input_ids'] != 0).sum()"
    assert [str(r) for r in rules(lambda: F.mse_loss(logits, torch.zeros(4, 4, 10)))] == ["samples"]


def test_a_rule_can_follow_the_inputs_length_and_a_clamp():
    """Extractive QA: positions clamped onto the input's length T, which is the ignore index; T differs
    from batch to batch. The rules that explain a first batch with every answer inside are all possible;
    a batch of another length with an answer outside tells them apart."""
    first = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "start": torch.tensor([1, 5])}
    logits = torch.randn(2, 6, requires_grad=True)
    loss, terms = observed(lambda: F.cross_entropy(logits, first["start"].clamp(0, 6), ignore_index=6))
    (part,) = decompose(loss, terms)
    possible = [str(r) for r in learn(part, first, 2)]
    assert possible == [
        "(batch['start'] != 6).sum()",
        "(batch['start'] < 6).sum()",
        "(batch['start'] != batch['input_ids'].shape[1]).sum()",
        "(batch['start'] < batch['input_ids'].shape[1]).sum()",
        "(batch['start'] != 0).sum()",
        "samples",
    ]
    later = {"input_ids": torch.zeros(3, 9, dtype=torch.long), "start": torch.tensor([8, 6, 30])}
    rules = learn(part, first, 2)
    # only the fourth counts what the loss would: 8 and 6 inside the 9 positions, 30 clamped onto 9
    assert [r.count(later, 3) for r in rules] == [2.0, 0.0, 3.0, 2.0, 3.0, 3.0]
    assert rules[3].count(later, 3) == float((later["start"].clamp(0, 9) != 9).sum())


def test_shares_reproduce_the_token_mean():
    logits = torch.randn(4, 4, 10, generator=torch.Generator().manual_seed(0))
    batch = {"logits": logits, "labels": LABELS}

    def loss(b):
        return F.cross_entropy(b["logits"].flatten(0, 1), b["labels"].flatten())

    parts = split_batch(batch, [2, 2])
    (weights,) = shares([Rule("batch['labels']", 0, -100)], parts, [2, 2])
    assert weights == [3 / 9, 6 / 9]
    combined = sum(w * loss(p) for w, p in zip(weights, parts))
    torch.testing.assert_close(combined, loss(batch), rtol=1e-12, atol=0)
    by_samples = sum(0.5 * loss(p) for p in parts)
    assert abs(by_samples - loss(batch)) > 1e-2  # why samples are not enough


class TokenTagger(pl.LightningModule):
    """A tuple batch ``(x, y)`` with -100 in y: a token mean the old conventions could not read."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 5, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.layer(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _tagging_data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 4, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (12, 4), generator=g)
    y[torch.rand(12, 4, generator=g) < 0.4] = -100
    y[:, 0] = torch.randint(0, 5, (12,), generator=g)  # every sample counts at least one position
    return DataLoader(TensorDataset(x, y), batch_size=6)


def _fit(callbacks, module=None) -> TokenTagger:
    module = module or TokenTagger()
    quiet_trainer(callbacks, max_steps=2).fit(module, _tagging_data())
    return module


def test_a_token_mean_in_a_tuple_batch_is_exact_without_count_fn():
    reference = _fit([])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to say: learned, and checked
        split = _fit([AutoAccumulation(micro_batch_size=2, log=False)])
    torch.testing.assert_close(split.layer.weight, reference.layer.weight, rtol=1e-12, atol=0)
    given = _fit(
        [
            OOMBackoff(count_fn=lambda mb: (mb[1] != -100).sum(), log=False),
            AutoAccumulation(micro_batch_size=2, log=False),
        ]
    )
    torch.testing.assert_close(given.layer.weight, reference.layer.weight, rtol=1e-12, atol=0)


class SumTagger(TokenTagger):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.layer(x).flatten(0, 1), y.flatten(), reduction="sum")


def test_a_sum_is_learned_and_count_fn_sum_says_so():
    reference = _fit([], SumTagger())
    split = _fit([AutoAccumulation(micro_batch_size=2, log=False)], SumTagger())
    torch.testing.assert_close(split.layer.weight, reference.layer.weight, rtol=1e-12, atol=0)
    given = _fit([AutoAccumulation(micro_batch_size=2, count_fn="sum", log=False)], SumTagger())
    torch.testing.assert_close(given.layer.weight, reference.layer.weight, rtol=1e-12, atol=0)
    with pytest.raises(TypeError, match="count_fn must be a callable"):
        AutoAccumulation(count_fn="mean")


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
    assert split.losses == pytest.approx(reference.losses, rel=1e-12)  # the step's loss, in its own dtype


def test_docstring_examples_run():
    assert doctest.testmod(loss_module).failed == 0
