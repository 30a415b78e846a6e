"""Losses as Lightning users write them: every reduction, padding convention and combination of terms.

Each pattern is a ``training_step`` written as Lightning's docs and common recipes write it, trained
plain and with the package forcing a split (``AutoAccumulation(micro_batch_size=2)``, or ``OOMBackoff``
after one injected out-of-memory error), in float64: the update must equal the unsplit run's to 1e-10.
The package learns what each micro-batch weighs from the loss functions as they are called (issue 19);
a loss it cannot explain must be exact or warned about naming ``count_fn``.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt import SplitNotExactWarning
from lightning_memopt.head import linear_cross_entropy
from tests.patterns.helpers import (
    BATCH,
    CLASSES,
    FEATURES,
    MLP,
    MODES,
    assert_exact,
    classification,
    loader,
    no_split_warning,
    relative_update,
    train,
)

VOCAB, SEQ = 11, 7
SAMPLES = 3 * BATCH  # three steps of one batch each
CLASS_WEIGHTS = torch.tensor([1.0, 3.0, 10.0], dtype=torch.float64)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def regression():
    g = _gen()
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return loader(x, torch.randn(SAMPLES, CLASSES, generator=g) + x[:, :CLASSES])


def multilabel():
    g = _gen()
    return loader(
        torch.randn(SAMPLES, FEATURES, generator=g),
        torch.randint(0, 2, (SAMPLES, CLASSES), generator=g).double(),
    )


def soft_targets():
    g = _gen()
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return loader(x, torch.softmax(torch.randn(SAMPLES, CLASSES, generator=g), dim=-1))


def lengths(g: torch.Generator) -> torch.Tensor:
    """Sequence lengths from 2 to SEQ: very different numbers of real tokens per sample."""
    return torch.randint(2, SEQ + 1, (SAMPLES,), generator=g)


def tokens(pad: int):
    """(ids, mask): token ids right-padded with ``pad`` to SEQ, and 1 at real tokens."""
    g = _gen()
    mask = (torch.arange(SEQ)[None, :] < lengths(g)[:, None]).long()
    ids = torch.randint(1, VOCAB, (SAMPLES, SEQ), generator=g)
    return ids.masked_fill(mask == 0, pad), mask


def lm_batches():
    """Hugging Face-style dict batches: ``input_ids`` padded with 0, ``labels`` = ids with -100 at padding."""
    ids, mask = tokens(pad=0)
    labels = ids.masked_fill(mask == 0, -100)
    samples = [{"input_ids": ids[i], "labels": labels[i]} for i in range(SAMPLES)]
    return torch.utils.data.DataLoader(samples, batch_size=BATCH, shuffle=False)


def tagging():
    """Token tagging with 0 as padding for inputs and tags alike (``ignore_index=0``)."""
    ids, mask = tokens(pad=0)
    g = _gen(1)
    tags = torch.randint(1, CLASSES + 1, (SAMPLES, SEQ), generator=g) * mask
    return loader(ids, tags)


def lm_with_length():
    """Padded token batches with -100 labels, plus a per-sample target: the sequence's length."""
    ids, mask = tokens(pad=0)
    labels = ids.masked_fill(mask == 0, -100)
    return loader(ids, labels, mask.sum(dim=1, keepdim=True).double())


def masked_regression():
    g = _gen()
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.randn(SAMPLES, CLASSES, generator=g)
    mask = (torch.rand(SAMPLES, CLASSES, generator=g) < 0.5).double()
    mask[:, 0] = 1.0  # every sample has one observed target
    return loader(x, y, mask)


# --- the patterns --------------------------------------------------------------------------------------


class MeanMSE(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss


class CrossEntropyModule(MLP):
    """An ``nn.Module`` loss object stored on self, the way most tutorials write it."""

    def __init__(self) -> None:
        super().__init__()
        self.criterion = nn.CrossEntropyLoss()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self.net(x), y)


class SumMSE(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y, reduction="sum")


class SumCrossEntropyModule(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.criterion = nn.CrossEntropyLoss(reduction="sum")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self.net(x), y)


class SumOverBatchSize(MLP):
    """``loss.sum() / self.hparams.batch_size``: a fixed hyperparameter, not the batch's size."""

    def __init__(self, batch_size: int = BATCH) -> None:
        super().__init__()
        self.save_hyperparameters()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y, reduction="none")
        return loss.sum() / self.hparams.batch_size


class ClassWeighted(MLP):
    """Class-weighted cross-entropy: the mean divides by the summed weights of the batch's targets."""

    def __init__(self) -> None:
        super().__init__()
        self.criterion = nn.CrossEntropyLoss(weight=CLASS_WEIGHTS.to(torch.get_default_dtype()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self.net(x), y)


class L2Penalty(MLP):
    """An explicit L2 penalty on the weights added to a mean loss (instead of the optimizer's decay)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        return loss + 1e-3 * sum(p.pow(2).sum() for p in self.parameters())


class BCEWithLogits(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.binary_cross_entropy_with_logits(self.net(x), y)


class KLBatchMean(MLP):
    def training_step(self, batch, batch_idx):
        x, target = batch
        return F.kl_div(F.log_softmax(self.net(x), dim=-1), target, reduction="batchmean")


class SmoothL1(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.smooth_l1_loss(self.net(x), y, beta=0.5)


class Huber(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.huber_loss(self.net(x), y, delta=0.5)


class TokenModel(pl.LightningModule):
    """Embedding -> Tanh -> vocabulary logits, per token: a bigram language model / tagger."""

    def __init__(self, out: int = VOCAB) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, out))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class CausalLMOwnShift(TokenModel):
    """A causal LM that shifts in its own ``training_step``, on a ``labels`` key with -100 at padding."""

    def training_step(self, batch, batch_idx):
        logits = self.net(batch["input_ids"])  # (B, T, V)
        labels = batch["labels"]
        shift_logits = logits[:, :-1].reshape(-1, VOCAB)  # position t predicts token t + 1
        shift_labels = labels[:, 1:].reshape(-1)
        loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
        self.log("train_loss", loss)
        return loss


class ChunkedHeadTied(TokenModel):
    """A causal LM whose loss is :func:`linear_cross_entropy` (chunks of 3 tokens) on the embedding's
    weight (tied), shifting in ``training_step``: micro-batches count its labels that are not -100."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh())

    def training_step(self, batch, batch_idx):
        hidden = self.net(batch["input_ids"])[:, :-1]  # (B, T - 1, 8)
        labels = batch["labels"][:, 1:]
        return linear_cross_entropy(hidden, self.net[0].weight, labels, chunk_size=3, label_smoothing=0.1)


class IgnoreIndexZero(TokenModel):
    """Token tagging where 0 is the padding tag: ``ignore_index=0``, not -100."""

    def __init__(self) -> None:
        super().__init__(out=CLASSES + 1)

    def training_step(self, batch, batch_idx):
        ids, tags = batch
        logits = self.net(ids)  # (B, T, C + 1)
        return F.cross_entropy(logits.transpose(1, 2), tags, ignore_index=0)


class CEPlusAux(TokenModel):
    """``ce + 0.1 * aux``: a token mean over real tokens plus a per-sample mean (predict each length)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh())
        self.lm_head = nn.Linear(8, VOCAB)
        self.length_head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        ids, labels, length = batch
        hidden = self.net(ids)  # (B, T, 8)
        ce = F.cross_entropy(self.lm_head(hidden).reshape(-1, VOCAB), labels.reshape(-1))
        aux = F.mse_loss(self.length_head(hidden.mean(dim=1)), length)
        return ce + 0.1 * aux


class MaskedMean(MLP):
    """``reduction="none"`` and a mean over the observed targets only: the count is the mask's sum,
    which no loss function call shows."""

    def training_step(self, batch, batch_idx):
        x, y, mask = batch
        per_element = F.mse_loss(self.net(x), y, reduction="none")
        return (per_element * mask).sum() / mask.sum()


EXACT = [
    pytest.param(MeanMSE, regression, id="mse_mean"),
    pytest.param(CrossEntropyModule, classification, id="CrossEntropyLoss_module"),
    pytest.param(SumMSE, regression, id="mse_sum"),
    pytest.param(
        SumCrossEntropyModule,
        classification,
        id="CrossEntropyLoss_sum",
    ),
    pytest.param(
        ClassWeighted,
        classification,
        id="class_weighted_ce",
    ),
    pytest.param(L2Penalty, classification, id="l2_penalty"),
    pytest.param(BCEWithLogits, multilabel, id="bce_with_logits"),
    pytest.param(KLBatchMean, soft_targets, id="kl_div_batchmean"),
    pytest.param(SmoothL1, regression, id="smooth_l1"),
    pytest.param(Huber, regression, id="huber"),
    pytest.param(
        CausalLMOwnShift,
        lm_batches,
        id="causal_lm_own_shift",
    ),
    pytest.param(
        IgnoreIndexZero,
        tagging,
        id="ignore_index_0",
    ),
    pytest.param(ChunkedHeadTied, lm_batches, id="linear_cross_entropy_tied"),
    pytest.param(
        CEPlusAux,
        lm_with_length,
        id="ce_plus_aux",
    ),
]


@pytest.fixture(scope="module")
def references() -> dict:
    """The plain run of each pattern, trained once for the module's tests."""
    return {}


def plain(references: dict, module: type, data) -> object:
    if module not in references:
        references[module] = train(module, data)
    return references[module]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("module", "data"), EXACT)
def test_loss_is_exact(module, data, mode, references) -> None:
    """Exact, and quiet about it (the L2 term is no loss function's output: a warning naming
    ``count_fn`` is allowed there, as long as the update is exact)."""
    if module is L2Penalty:
        run = train(module, data, mode)
    else:
        with no_split_warning():
            run = train(module, data, mode)
    assert_exact(run, plain(references, module, data))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("module", "data"),
    [
        pytest.param(
            SumOverBatchSize,
            classification,
            id="sum_over_hparam",
        ),
        pytest.param(MaskedMean, masked_regression, id="masked_mean"),
    ],
)
def test_loss_user_arithmetic_is_exact_or_names_count_fn(module, data, mode, references) -> None:
    """A loss reduced by the user's own arithmetic: exact, or a warning that names ``count_fn`` (the
    override that says what the loss averages over). Never a silent difference."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = train(module, data, mode)
    named = [
        w for w in caught if issubclass(w.category, SplitNotExactWarning) and "count_fn" in str(w.message)
    ]
    if not named:
        assert_exact(run, plain(references, module, data))


@pytest.mark.parametrize(
    ("module", "data", "count_fn"),
    [
        pytest.param(
            CausalLMOwnShift, lm_batches, lambda mb: int((mb["labels"][:, 1:] != -100).sum()), id="causal_lm"
        ),
        pytest.param(IgnoreIndexZero, tagging, lambda mb: int((mb[1] != 0).sum()), id="ignore_index_0"),
        pytest.param(MaskedMean, masked_regression, lambda mb: float(mb[2].sum()), id="masked_mean"),
        pytest.param(
            ClassWeighted, classification, lambda mb: float(CLASS_WEIGHTS[mb[1]].sum()), id="class_weighted"
        ),
    ],
)
def test_count_fn_makes_token_means_exact(module, data, count_fn, references) -> None:
    """The override: with ``count_fn`` counting what the loss averages over, the split is exact. This also
    shows the patterns above are split-invariant, so their failures are the weighting's alone."""
    run = train(module, data, "split", options={"count_fn": count_fn})
    assert_exact(run, plain(references, module, data))


def test_inexact_weighting_is_detected(references) -> None:
    """The bar can fail: sample weighting of the causal LM's token mean differs well above it."""
    reference = plain(references, CausalLMOwnShift, lm_batches)
    run = train(CausalLMOwnShift, lm_batches, "split", options={"count_fn": lambda mb: len(mb["input_ids"])})
    assert relative_update(run, reference) > 1e-4
