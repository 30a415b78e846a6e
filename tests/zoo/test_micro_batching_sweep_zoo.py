"""Reproductions of what ``benchmarks/micro_batching_zoo.py`` (the sweep over transformers architectures)
found: each is the smallest step that shows it, plus the zoo model it was found on.

A split step must give the unsplit gradient or warn (``SplitNotExactWarning``); these did neither, or
warned about an exact split, until the engine was fixed (the cause of each below); now each is exact and
says nothing. The controls give the weights by hand (``count_fn``): the same runs are exact, so the models
are split-invariant and a difference would be the weighting's (float64, SGD, two steps of 8 samples,
``AutoAccumulation(micro_batch_size=2)``).

1. A rule learned on an ambiguous first batch was trusted on later batches without looking again. The
   engine takes the first candidate that reproduces the first batch's count: with no padding and no -100
   label in that batch, ``(batch['input_ids'] != -100).sum()`` (every token) counts what
   ``(batch['labels'] != -100).sum()`` counts, and ``input_ids`` comes first in the batch. Later batches
   are padded; the rule is not observed again and weighs them by their tokens, padding included (T5
   0.12 of the update, Llama 0.65, BERT tagging 0.46; no warning). Length-grouped batching gives exactly
   such a first batch. Now the rules still possible must agree on a batch's weights, or it is observed.
2. Extractive QA: Hugging Face clamps answer positions to the sequence length ``T`` and ignores ``T``
   (``ignore_index=T``). When the first batch's answers are all inside, ``(batch['start_positions'] !=
   T).sum()`` reproduces the count; a later answer outside the input (position > T in the batch, clamped
   to T inside the loss) is counted by the rule and ignored by the loss (BERT 0.28; no warning). Now a
   rule may follow the input's length and count only positions inside it.
3. The one-time check's tolerance follows the parameters' dtype (1e-9 for float64), but a float64 model
   whose loss is computed in float32 (Hugging Face's causal-LM and token-classification losses upcast
   logits with ``.float()``, which casts float64 down) carries float32 rounding (about 1e-7) in every
   gradient: two exact splits differ by that much and the check warns "its gradient depends on how the
   batch is split" (41 of the sweep's float64 causal LMs; their splits are within 1e-7 of unsplit). Now
   the tolerance follows the loss's dtype too.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt import AutoAccumulation, SplitNotExactWarning
from tests.batching.helpers import quiet_trainer
from tests.zoo.models import (
    ZooEntry,
    ZooModule,
    causal_lm_batch,
    gpt2,
    loader,
    no_dropout,
    seq2seq_batch,
    t5,
    unpadded_first_batch,
)
from tests.zoo.test_micro_batching_zoo import relative_difference

BATCH, STEPS, TOKENS, CLASSES = 8, 2, 6, 3
BAR = 1e-10  # float64


class Tagger(pl.LightningModule):
    """A per-token classifier: the loss is a token mean over ``labels != -100`` (a tagging or LM loss)."""

    def __init__(self, loss_dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(20, 8).double(), nn.Linear(8, CLASSES).double()
        self.loss_dtype = loss_dtype

    def training_step(self, batch, batch_idx):
        logits = self.head(torch.tanh(self.embed(batch["input_ids"])))  # (B, T, C)
        return F.cross_entropy(logits.flatten(0, 1).to(self.loss_dtype), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Spans(Tagger):
    """Extractive QA as Hugging Face computes it: start positions clamped to T, and T ignored."""

    def training_step(self, batch, batch_idx):
        scores = self.head(torch.tanh(self.embed(batch["input_ids"])))[..., 0]  # (B, T)
        start = batch["start_positions"].clamp(0, TOKENS)
        return F.cross_entropy(scores, start, ignore_index=TOKENS)


def token_data(padded_first: bool) -> list[dict]:
    """Two batches of BATCH token sequences; the second padded (labels -100 after each length), the first
    padded too or at full length."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 20, (2 * BATCH, TOKENS), generator=g)
    labels = torch.randint(0, CLASSES, (2 * BATCH, TOKENS), generator=g)
    lengths = torch.randint(1, TOKENS + 1, (2 * BATCH,), generator=g)
    if not padded_first:
        lengths[:BATCH] = TOKENS
    padding = torch.arange(TOKENS)[None, :] >= lengths[:, None]
    ids, labels = ids.masked_fill(padding, 0), labels.masked_fill(padding, -100)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(2 * BATCH)]


def span_data() -> list[dict]:
    """Two batches; in the second, every third answer lies outside the input (position 4 T)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 20, (2 * BATCH, TOKENS), generator=g)
    start = torch.randint(0, TOKENS, (2 * BATCH,), generator=g)
    outside = (torch.arange(2 * BATCH) >= BATCH) & (torch.arange(2 * BATCH) % 3 == 2)
    start = start.masked_fill(outside, 4 * TOKENS)
    return [{"input_ids": ids[i], "start_positions": start[i]} for i in range(2 * BATCH)]


def fit(module: pl.LightningModule, data, callbacks=()) -> list[str]:
    """STEPS SGD steps on ``data`` (a list of samples or a DataLoader); the SplitNotExactWarnings' texts."""
    if isinstance(data, list):
        data = torch.utils.data.DataLoader(data, batch_size=BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(list(callbacks), max_steps=STEPS).fit(module, data)
    return [str(w.message) for w in caught if issubclass(w.category, SplitNotExactWarning)]


def split_against_unsplit(make, data, **options) -> tuple[float, list[str]]:
    """(relative difference of the update, SplitNotExactWarnings) of a split run against the unsplit one."""
    reference = make()
    start = {k: p.detach().clone() for k, p in reference.named_parameters()}
    fit(reference, data)
    split = make()
    warned = fit(split, data, [AutoAccumulation(micro_batch_size=2, log=False, **options)])
    return relative_difference(start, split, reference), warned


def label_count(micro_batch) -> torch.Tensor:
    return (micro_batch["labels"] != -100).sum()


def zoo_module(build, batch, dtype=torch.float64):
    return lambda: no_dropout(ZooModule(ZooEntry(build, batch, "zoo"), dtype=dtype))


# ------------------------------------------------------------------------- 1. a rule from an ambiguous batch
def test_padded_first_batch_is_exact() -> None:
    """The control: padding in the first batch already tells ``labels`` from ``input_ids``."""
    rel, warned = split_against_unsplit(Tagger, token_data(padded_first=True))
    assert rel <= BAR and warned == []


def test_unpadded_first_batch_with_the_count_given_is_exact() -> None:
    rel, warned = split_against_unsplit(Tagger, token_data(padded_first=False), count_fn=label_count)
    assert rel <= BAR and warned == []


def test_unpadded_first_batch_is_exact() -> None:
    rel, warned = split_against_unsplit(Tagger, token_data(padded_first=False))
    assert rel <= BAR and warned == []


def test_a_micro_batch_weighed_by_a_rule_a_later_one_disproves_runs_again() -> None:
    """The first split step's first micro-batch is unpadded (``input_ids`` and ``labels`` count alike), its
    second is padded: the first was weighed by the wrong rule, so the pass runs again with the rule both
    confirmed; exact without the one-time check, and nothing said."""
    data = token_data(padded_first=True)
    for sample in data[:2]:
        sample["labels"] = sample["labels"].masked_fill(sample["labels"] == -100, 1)
        sample["input_ids"] = sample["input_ids"].masked_fill(sample["input_ids"] == 0, 1)
    runs: list[int] = []

    class Counted(Tagger):
        def training_step(self, batch, batch_idx):
            runs.append(len(batch["labels"]))
            return super().training_step(batch, batch_idx)

    rel, warned = split_against_unsplit(Counted, data, exactness="off")
    assert rel <= BAR and warned == []
    assert runs == [8, 8] + [2] * 4 * 2 + [2] * 4  # unsplit; the first split step twice, the second once


T5_UNPADDED_FIRST = unpadded_first_batch(seq2seq_batch, "tokens", BATCH)


def test_t5_unpadded_first_with_the_count_given_is_exact() -> None:
    make = zoo_module(t5, T5_UNPADDED_FIRST)
    data = loader(ZooEntry(t5, T5_UNPADDED_FIRST, "zoo"), BATCH, batches=STEPS, dtype=torch.float64)
    rel, warned = split_against_unsplit(make, data, count_fn=label_count)
    assert rel <= BAR and warned == []


def test_t5_unpadded_first_is_exact() -> None:
    make = zoo_module(t5, T5_UNPADDED_FIRST)
    data = loader(ZooEntry(t5, T5_UNPADDED_FIRST, "zoo"), BATCH, batches=STEPS, dtype=torch.float64)
    rel, warned = split_against_unsplit(make, data)
    assert rel <= BAR and warned == []


# ------------------------------------------------------------------------- 2. a count the batch hides (clamp)
def test_spans_with_the_count_given_is_exact() -> None:
    def answerable(micro_batch) -> torch.Tensor:
        return (micro_batch["start_positions"] < TOKENS).sum()

    rel, warned = split_against_unsplit(Spans, span_data(), count_fn=answerable)
    assert rel <= BAR and warned == []


def test_spans_are_exact() -> None:
    rel, warned = split_against_unsplit(Spans, span_data())
    assert rel <= BAR and warned == []


# ------------------------------------------------------------------------- 3. a float32 loss in a float64 model
def test_float32_loss_split_is_exact_to_float32_rounding() -> None:
    """The control for 3: the split is exact to float32 rounding (what the loss computes in)."""
    rel, _ = split_against_unsplit(lambda: Tagger(torch.float32), token_data(padded_first=True))
    assert rel <= 1e-5


def test_float32_loss_is_no_false_alarm() -> None:
    _, warned = split_against_unsplit(lambda: Tagger(torch.float32), token_data(padded_first=True))
    assert warned == []


def test_gpt2_float64_is_no_false_alarm() -> None:
    data = loader(ZooEntry(gpt2, causal_lm_batch, "zoo"), BATCH, batches=STEPS, dtype=torch.float64)
    rel, warned = split_against_unsplit(zoo_module(gpt2, causal_lm_batch), data)
    assert rel <= 1e-5 and warned == []
