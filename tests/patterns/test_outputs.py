"""What ``training_step`` returns, as the hooks after it see it, and ``return None`` to skip a batch.

A ``training_step`` may return a dict (Lightning's docs: ``"loss"`` plus anything the user wants back
in ``on_train_batch_end``): the loss must be the full batch's, in the model's dtype; a 0-dim count the
batch's count; a per-sample tensor all samples, in order; a tensor of another shape (a histogram) equal,
or a warning that names its key. Returning None skips the batch as in Lightning (no update from it)
when the batch is not split, and is refused with an error naming None when it is.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_memopt import AutoAccumulation, OOMBackoff
from tests.patterns.helpers import BATCH, CLASSES, MLP, MODES, K, assert_exact, classification, train


class DictOutputs(MLP):
    """Returns ``{"loss", "n_correct", "hist", "preds"}`` and keeps what ``on_train_batch_end`` sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        preds = logits.argmax(dim=-1)  # (B,)
        return {
            "loss": F.cross_entropy(logits, y),
            "n_correct": (preds == y).sum(),  # 0-dim int
            "hist": torch.bincount(preds, minlength=CLASSES),  # (CLASSES,): not one value per sample
            "preds": preds,
        }

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append({k: v.detach().clone() for k, v in outputs.items()})


class SkipsBatches(MLP):
    """Returns None for the second batch: Lightning skips its backward and update."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if batch_idx == 1:
            self.skipped += 1
            return None
        return loss


@pytest.fixture(scope="module")
def outputs() -> dict:
    """Per mode: what ``on_train_batch_end`` saw, and the warnings the run gave."""
    result = {}
    for mode in ("plain", *MODES):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = train(DictOutputs, classification, mode)
        result[mode] = (run.module.seen, [str(w.message) for w in caught])
    return result


@pytest.mark.parametrize("mode", MODES)
def test_output_loss_is_the_batch_loss_in_the_model_dtype(mode: str, outputs: dict) -> None:
    got, expected = outputs[mode][0], outputs["plain"][0]
    assert [o["loss"].dtype for o in got] == [torch.float64] * len(expected)
    torch.testing.assert_close([o["loss"] for o in got], [o["loss"] for o in expected], rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_output_count_is_the_batch_count(mode: str, outputs: dict) -> None:
    got, expected = outputs[mode][0], outputs["plain"][0]
    assert [int(o["n_correct"]) for o in got] == [int(o["n_correct"]) for o in expected]


@pytest.mark.parametrize("mode", MODES)
def test_output_per_sample_tensor_is_concatenated(mode: str, outputs: dict) -> None:
    got, expected = outputs[mode][0], outputs["plain"][0]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert torch.equal(g["preds"], e["preds"])


@pytest.mark.parametrize("mode", MODES)
def test_output_other_tensor_is_equal_or_named(mode: str, outputs: dict) -> None:
    (got, messages), expected = outputs[mode], outputs["plain"][0]
    if any(re.search(r"\bhist\b", m) for m in messages):
        return  # the rule for it is a guess, and the warning says which key
    for g, e in zip(got, expected):
        assert torch.equal(g["hist"], e["hist"]), (
            f"outputs['hist'] {g['hist'].tolist()} != {e['hist'].tolist()}"
        )


def test_output_other_tensor_is_not_any_micro_batchs(outputs: dict) -> None:
    """Each step's histogram differs from its last micro-batch's: keeping one micro-batch's value cannot
    pass the test above by luck."""
    for e in outputs["plain"][0]:
        assert not torch.equal(torch.bincount(e["preds"][-K:], minlength=CLASSES), e["hist"])


UNSPLIT = {
    "AutoAccumulation(micro_batch_size=BATCH)": lambda: AutoAccumulation(micro_batch_size=BATCH, log=False),
    "OOMBackoff() without OOM": lambda: OOMBackoff(log=False),
}


@pytest.mark.parametrize("callback", list(UNSPLIT))
def test_return_none_skips_an_unsplit_batch(callback: str) -> None:
    reference = train(SkipsBatches, classification)
    run = train(SkipsBatches, classification, callbacks=[UNSPLIT[callback]()])
    assert run.module.skipped == reference.module.skipped == 1
    assert run.sizes == reference.sizes == [BATCH] * 3
    assert_exact(run, reference)


def test_return_none_when_split_is_refused_naming_none() -> None:
    """The batch cannot be half skipped: a clear error that says None, not a crash inside the engine."""
    with pytest.raises((MisconfigurationException, RuntimeError, ValueError), match=r"\bNone\b") as error:
        train(SkipsBatches, classification, "split")
    assert not isinstance(error.value, (TypeError, AttributeError))


class ReturnsNoLoss(MLP):
    """``training_step`` returns ``self.returned(loss)``: a form that carries no loss tensor."""

    def __init__(self, returned) -> None:
        super().__init__()
        self.returned = returned

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.returned(F.cross_entropy(self.net(x), y))


NOT_A_LOSS = {
    "dict without 'loss'": (
        lambda loss: {"ce": loss},
        r"training_step returned a dict without a 'loss' key \(its keys: 'ce'\); return the loss tensor",
    ),
    "float": (
        lambda loss: loss.item(),
        r"training_step returned a float \(\d\.\d+\), not a loss tensor; return the loss tensor as computed "
        r"\(not \.item\(\) or float\(\.\.\.\): a number has no gradient\), a dict with 'loss': that tensor "
        r"\(and anything else on_train_batch_end should get\), or None to skip the batch$",
    ),
    "dict with a float 'loss'": (
        lambda loss: {"loss": loss.item()},
        r"training_step returned a dict whose 'loss' is a float \(\d\.\d+\), not a tensor; return the loss",
    ),
    "dict with 'loss': None": (
        lambda loss: {"loss": None},
        r"training_step returned a dict whose 'loss' is None, not a tensor; return the loss tensor",
    ),
}


@pytest.mark.parametrize("form", list(NOT_A_LOSS))
@pytest.mark.parametrize("mode", ["split", "unsplit"])
def test_an_output_without_a_loss_tensor_is_named_with_the_fix(form: str, mode: str) -> None:
    """Not taken for None ("skip this batch"): the message says what came back and what to return."""
    returned, match = NOT_A_LOSS[form]
    callbacks = [AutoAccumulation(micro_batch_size=BATCH, log=False)] if mode == "unsplit" else None
    with pytest.raises(MisconfigurationException, match=match) as error:
        train(
            lambda: ReturnsNoLoss(returned),
            classification,
            "split" if mode == "split" else "plain",
            callbacks=callbacks,
        )
    assert "None (skip this batch)" not in str(error.value)


class Reductions(MLP):
    """Returns the loss beside reductions of the logits over the batch's samples, and keeps what
    ``on_train_batch_end`` sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)  # (B, CLASSES)
        return {
            "loss": F.cross_entropy(logits, y),
            "max_logit": logits.max(),
            "min_logit": logits.min().float(),  # a cast does not hide the reduction
            "class_max": logits.amax(dim=0),  # (CLASSES,)
            "logit_sum": logits.sum(),
            "mean_prob": logits.softmax(-1).mean(),
            "class_mean": logits.mean(dim=0),  # (CLASSES,)
            "top_logit": logits.max().detach(),  # no graph: how it was reduced cannot be read
            "scale": 2.5,  # a Python float: nothing says what it is
        }

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in outputs.items()})


EXACT_KEYS = ("max_logit", "min_logit", "class_max", "logit_sum", "mean_prob", "class_mean")
INEXACT = (
    "micro-batching cannot combine training_step's outputs['top_logit'], outputs['scale'] exactly from its "
    "micro-batches' values (a float is averaged by samples, any other object is the last micro-batch's), so "
    "on_train_batch_end may see other values than without micro-batching; return one value per sample "
    "(joined), an integer count (added), or a max, min, sum or mean over the samples as a tensor still "
    "attached to the graph (no .detach() or .item(): its reduction is read from it)"
)


@pytest.fixture(scope="module")
def reduced() -> dict:
    """Per mode: what ``on_train_batch_end`` saw from :class:`Reductions`, and the warnings the run gave."""
    result = {}
    for mode in ("plain", *MODES):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = train(Reductions, classification, mode)
        result[mode] = (run.module.seen, [str(w.message) for w in caught])
    return result


@pytest.mark.parametrize("mode", MODES)
def test_reductions_over_the_samples_are_the_batchs(mode: str, reduced: dict) -> None:
    """A max, min, sum or mean over the samples, attached to the graph, is combined as what it is: the
    unsplit run's value (a sample-weighted mean of maxes gave 0.40 for a max of 0.64)."""
    (got, _), (expected, _) = reduced[mode], reduced["plain"]
    assert len(got) == len(expected) == 3
    for g, e in zip(got, expected):
        for key in EXACT_KEYS:
            assert g[key].dtype == e[key].dtype and g[key].shape == e[key].shape, key
            torch.testing.assert_close(g[key], e[key], rtol=1e-12, atol=0, msg=key)


@pytest.mark.parametrize("mode", MODES)
def test_keys_that_cannot_be_combined_exactly_are_named_once(mode: str, reduced: dict) -> None:
    (got, messages), (expected, plain_messages) = reduced[mode], reduced["plain"]
    assert [m for m in messages if "micro-batching cannot combine" in m] == [INEXACT]
    assert not [m for m in plain_messages if "micro-batching" in m]
    # what the warning says happened: the detached max is averaged by samples, which is not the max
    assert [float(g["top_logit"]) for g in got] != [float(e["top_logit"]) for e in expected]
    assert [g["scale"] for g in got] == [2.5] * 3
