"""Generation heads whose own loss does not shift: TrOCR, Marian, XLNet and XLM (issue 19).

``TrOCRForCausalLM``, ``MarianMTModel``, ``XLNetLMHeadModel`` and ``XLMWithLMHeadModel`` compute their
loss from ``labels`` as a token mean over the labels != -100 with no one-position shift, although their
classes are generation heads. Built from tiny configs (sizes in the spirit of transformers' own tests,
dropout 0), float64, with padded batches of 6 of different lengths: ``AutoAccumulation(micro_batch_size=2)``
and ``OOMBackoff`` after one injected OOM (6 fails, 3 fits), two SGD steps each, must end with the
unsplit run's parameters (``||p - p_unsplit|| / ||p_unsplit - p_start|| <= 1e-10``) with no user code.
Weighting each micro-batch by its own count of labels != -100 (``count_fn``) is exact: the models are
split-invariant, and a failure of the first test is the package's weighting.
"""

from __future__ import annotations

import pytest
import torch

from tests.patterns.helpers import BAR, update_difference
from tests.zoo.models import UNSHIFTED
from tests.zoo.test_micro_batching_zoo import CALLBACKS, train


def label_count(micro_batch: dict[str, torch.Tensor]) -> int:
    """What these models' losses average over: the labels != -100, unshifted."""
    return int((micro_batch["labels"] != -100).sum())


@pytest.fixture(scope="module")
def references() -> dict:
    return {}


def relative(name: str, references: dict, callback: str, **options) -> float:
    if name not in references:
        references[name] = train(name)
    start, reference, _ = references[name]
    _, split, _ = train(name, callback, **options)
    return update_difference(dict(split.named_parameters()), dict(reference.named_parameters()), start)


@pytest.mark.parametrize("callback", list(CALLBACKS))
@pytest.mark.parametrize("name", list(UNSHIFTED))
def test_own_loss_split_equals_unsplit(name: str, callback: str, references: dict) -> None:
    assert relative(name, references, callback) <= BAR


@pytest.mark.parametrize("name", list(UNSHIFTED))
def test_weighting_by_the_unshifted_label_count_is_exact(name: str, references: dict) -> None:
    assert relative(name, references, "AutoAccumulation", count_fn=label_count) <= BAR
