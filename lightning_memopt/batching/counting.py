"""How much each micro-batch's loss counts: what makes micro-batching exact for mean-reduced losses.

What "exact" means. A loss reduced with a mean is ``sum(item losses) / N`` over the ``N`` items it
counts: samples for most losses, but only the positions whose label is not the ignore index (-100)
for token losses with padding (Hugging Face language models, ``cross_entropy(ignore_index=-100)``).
When a batch runs as micro-batches, each micro-batch's mean is multiplied by its share of the counted
items, ``n_i / N``, before its backward; the accumulated gradient then equals the unsplit batch's (up
to floating-point rounding). Weighting by the share of *samples* instead is exact only when every
sample holds the same number of counted items; with padding it is not (the zoo's GPT-2, batch 6,
micro-batch 2: parameters off by 24% of the update after two SGD steps, against 2e-7 weighted by
counted tokens; ``tests/zoo/test_micro_batching_zoo.py``). Dropout is the exception no weighting
fixes: a split batch draws different masks (exactness tests turn it off).

How the count is chosen, per batch, when the callbacks get no ``count_fn``:

- A mapping batch with an integer ``labels`` tensor (the Hugging Face convention, assumed to be what
  the loss that ``training_step`` returns is computed from): the items are the entries ``!= -100``. For a causal language model the loss predicts token ``t + 1`` from token ``t``,
  so the first position of each sample never counts (``labels[..., 1:]``); the model decides which
  (:func:`causal_shift`).
- Anything else holding an integer tensor with -100 entries (a tuple batch ``(x, y)``, another key):
  the package cannot see the loss, weighs by samples, and warns once, naming ``count_fn``.
- Otherwise: samples.

``count_fn(micro_batch) -> number``, given to ``AutoAccumulation`` or ``OOMBackoff``, replaces all of
this for any other loss.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["IGNORE_INDEX", "LabelCount", "causal_shift", "choose_count"]

IGNORE_INDEX = -100  # torch's cross_entropy default, and Hugging Face's padding label
LABELS = "labels"

CountFn = Callable[[Any], float]


@dataclass(frozen=True)
class LabelCount:
    """``count_fn`` for the Hugging Face convention: entries of ``batch[key]`` that are not -100."""

    key: str = LABELS
    """The batch key holding the labels."""
    shift: bool = False
    """Skip each sample's first position (causal language models predict position t + 1 from t)."""

    def __call__(self, micro_batch: Mapping[str, Any]) -> int:
        labels = micro_batch[self.key]
        if self.shift and labels.dim() > 1:  # (B, T) token labels; (B,) labels are one item per sample
            labels = labels[..., 1:]
        return int((labels != IGNORE_INDEX).sum())


def _hf_models(module: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face ``PreTrainedModel`` submodules of ``module`` (itself included)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:  # not imported: no module is one of its models (and importing it takes seconds)
        return []
    pretrained = transformers.PreTrainedModel
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, pretrained) and not any(name.startswith(f"{p}.") or p == "" for p, _ in found):
            found.append((name, sub))
    return [sub for _, sub in found]


def _is_causal(model: nn.Module) -> bool | None:
    """Whether a Hugging Face model's own loss shifts labels by one; None if it cannot be told."""
    from transformers.models.auto import modeling_auto

    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False  # labels are the decoder's targets; the decoder's inputs are shifted, not the labels
    name = type(model).__name__
    if name in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return True
    loss_type = getattr(model, "loss_type", None)  # set from the class name since transformers 4.46
    if loss_type in ("ForCausalLM", "ForConditionalGeneration"):  # decoder-only (checked above)
        return True
    if loss_type is not None:
        return False  # masked LM, classification, token classification: no shift
    return None


def causal_shift(module: nn.Module) -> bool | None:
    """Whether the loss of ``labels`` in ``module`` skips each sample's first position.

    False for a module without Hugging Face models (``labels != -100`` counts as it is), True when its
    outermost Hugging Face models are causal language models (GPT-2, Llama, ...; decided from the
    class, its ``loss_type`` and the config's ``is_encoder_decoder``), None when they cannot be told
    apart or disagree.
    """
    kinds = {_is_causal(m) for m in _hf_models(module)}
    if not kinds:
        return False
    return kinds.pop() if len(kinds) == 1 else None


def _path_of_ignored(batch: Any, path: str = "batch") -> str | None:
    """The path of an integer tensor in ``batch`` holding -100, or None."""
    if isinstance(batch, torch.Tensor):
        if not batch.is_floating_point() and not batch.is_complex() and batch.dtype != torch.bool:
            return path if bool((batch == IGNORE_INDEX).any()) else None
        return None
    if isinstance(batch, Mapping):
        items = ((f"{path}[{k!r}]", v) for k, v in batch.items())
    elif isinstance(batch, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(batch))
    else:
        return None
    for sub_path, value in items:
        found = _path_of_ignored(value, sub_path)
        if found is not None:
            return found
    return None


def choose_count(
    batch: Any, shift: bool | None, *, check_ignored: bool = True
) -> tuple[CountFn | None, str | None]:
    """The default ``count_fn`` for ``batch`` (None: samples), and a warning when that may not be exact.

    Args:
        batch: The optimizer batch.
        shift: :func:`causal_shift` of the model.
        check_ignored: Look for -100 in the integer tensors of a batch without ``labels`` (one small
            reduction per tensor); False once the warning was given.
    """
    labels = batch.get(LABELS) if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point() and labels.dtype != torch.bool:
        if shift is not None:
            return LabelCount(shift=shift), None
        return LabelCount(), (
            "cannot tell whether the model's loss shifts `labels` by one position (a causal LM) or not; "
            "weighting micro-batches by entries of labels != -100 without a shift. If the loss counts other "
            "positions, pass count_fn=... (the number of items the loss averages over in a micro-batch) to "
            "AutoAccumulation/OOMBackoff"
        )
    path = _path_of_ignored(batch) if check_ignored else None
    if path is None:
        return None, None
    return None, (
        f"{path} is an integer tensor holding -100 (an ignored label?), but the batch does not follow the "
        "Hugging Face convention (a mapping with 'labels'), so micro-batches are weighted by samples. That "
        "is exact only if the loss is a mean over samples; if it is a mean over the entries != -100, pass "
        f"count_fn=lambda mb: ({path.replace('batch', 'mb', 1)} != -100).sum() to AutoAccumulation/OOMBackoff"
    )
