"""Micro-batching is exact on third-party models, each with its own loss and padding, with no user code.

For every model of the zoo: ``AutoAccumulation(micro_batch_size=2)`` on batches of 6, and ``OOMBackoff``
after a back-off (an injected OOM above 3 samples: 6 fails, then 2 x 3), two SGD steps each, end with the
parameters of the unsplit run. Hugging Face language models put -100 at padded ``labels``: their losses
are means over the labels != -100 (after a one-position shift for causal LMs), which only a split
weighted by those counts reproduces; the engine learns which from the loss each model computes. Dropout is off (a split batch draws other masks) and BatchNorm is
converted to GroupNorm (BatchNorm's statistics depend on the micro-batch).

``python -m tests.zoo.test_micro_batching_zoo`` prints the table of relative differences.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from lightning_memopt import AutoAccumulation, OOMBackoff, SplitNotExactError
from lightning_memopt.norm import convert_batchnorm
from lightning_memopt.testing import OOMInjector
from tests.batching.helpers import DeviceReads, quiet_trainer
from tests.zoo.models import ZOO, ZooModule, entry, loader, no_dropout

# Hugging Face's causal-LM loss upcasts logits with .float(), down to float32 in a float64 model.
FLOAT32 = {name for name, e in ZOO.items() if e.kind == "causal_lm"}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
CALLBACKS = {
    "AutoAccumulation": lambda **options: AutoAccumulation(micro_batch_size=2, log=False, **options),
    "OOMBackoff": lambda **options: OOMBackoff(log=False, **options),
}


def dtype_of(name: str) -> torch.dtype:
    return torch.float32 if name in FLOAT32 else torch.float64


def train(
    name: str, callback: str | None = None, precision: str | None = None, steps: int = 2, **options: object
) -> tuple[dict, ZooModule, list[str]]:
    """``steps`` SGD steps on batches of 6; returns the start parameters, the module, and its state_dict
    keys. ``precision="bf16-mixed"``: float32 parameters under CPU bf16 autocast."""
    dtype = torch.float32 if precision else dtype_of(name)
    module = ZooModule(name, dtype=dtype)
    no_dropout(module)
    if entry(name).has_batchnorm:
        # 4 groups, not the default 32: at 1x1 spatial size 32 groups normalize 2 values each, which
        # amplifies float64 rounding (ResNet: 1.4e-10 of the update after two steps, vs 6e-16 here)
        convert_batchnorm(module, num_groups=4)
    start = {k: p.detach().clone() for k, p in module.named_parameters()}
    keys = list(module.state_dict())
    callbacks = [] if callback is None else [CALLBACKS[callback](**options)]
    # OOMBackoff backs off once: the whole batch (6) runs out of memory, 3 samples fit
    oom = OOMInjector(module.model, max_size=3) if callback == "OOMBackoff" else contextlib.nullcontext()
    with oom:
        trainer = quiet_trainer(callbacks, max_steps=steps, **({"precision": precision} if precision else {}))
        trainer.fit(module, loader(name, 6, batches=2, dtype=dtype))
    if callback == "OOMBackoff":
        assert oom.raised == 1 and callbacks[0].micro_batch_size == 3
    return start, module, keys


def relative_difference(start: dict, split: torch.nn.Module, reference: torch.nn.Module) -> float:
    """max |split - reference| over every parameter, relative to the largest change of the update."""
    ref = dict(reference.named_parameters())  # parameters with no element (MobileBERT has some) are left out
    diff = max((p - ref[k]).abs().max().item() for k, p in split.named_parameters() if p.numel())
    update = max((ref[k] - s).abs().max().item() for k, s in start.items() if s.numel())
    return diff / update


@pytest.fixture(scope="module")
def references() -> dict:
    return {}


@pytest.mark.parametrize("callback", list(CALLBACKS))
@pytest.mark.parametrize("name", list(ZOO))
def test_split_equals_unsplit(name: str, callback: str, references: dict) -> None:
    if name not in references:
        references[name] = train(name)
    start, reference, keys = references[name]
    _, split, split_keys = train(name, callback)
    assert split_keys == keys and list(split.state_dict()) == keys  # the package changes no key
    assert relative_difference(start, split, reference) <= TOLERANCE[dtype_of(name)]


# Under bf16-mixed (float32 parameters and gradients, CPU bf16 autocast): a split step's gradient equals
# the unsplit one's to the rounding of bf16 matmuls, whose float32 sums are rounded to bf16 once per
# micro-batch instead of once per batch, then accumulated in float32. Measured after one step, as max |split
# - unsplit| over the largest update: 2.3e-3 to 4.5e-3 on torch 2.13, about one bf16 half-ulp
# (2**-9 = 2.0e-3) to one ulp; the bar is one bf16 epsilon (2**-7). A second step compounds the first's
# rounding through the model (T5: 2.6e-3 after one, 2.8e-2 after two), so one step is compared. The
# exactness check (exactness="raise") accepts these splits: its bar under mixed precision is 2e-2.
BF16 = ["gemma2", "llama", "mistral", "mixtral", "phi3", "qwen2", "gpt2", "bert", "t5", "vit"]
BF16_TOLERANCE = 2**-7


@pytest.mark.parametrize("name", BF16)
def test_split_equals_unsplit_to_bf16_rounding(name: str) -> None:
    start, reference, keys = train(name, precision="bf16-mixed", steps=1)
    _, split, split_keys = train(name, "AutoAccumulation", precision="bf16-mixed", steps=1, exactness="raise")
    assert split_keys == keys
    assert relative_difference(start, split, reference) <= BF16_TOLERANCE


def test_swin_under_bf16_passes_the_check_where_its_patch_norm_s_bias_rounds_most() -> None:
    """Swin's patch-embedding LayerNorm bias sums over every token to 6% of the largest gradient, and
    carries bf16's rounding of those terms: a micro-batch of 8 against two of 4 differed by 7.7% of a
    tenth of the largest gradient (7e-9 in float32), over the 2e-2 bar where a gradient that small was
    measured against that tenth; in half precision every gradient is measured against the largest
    (exactness.tolerance)."""
    module = no_dropout(ZooModule("swin"))
    callback = AutoAccumulation(micro_batch_size=8, log=False, exactness="raise")
    quiet_trainer([callback], max_steps=1, precision="bf16-mixed").fit(module, loader("swin", 16, batches=1))
    assert callback.micro_batch_size == 8


def test_the_check_still_tells_a_wrong_weighting_under_bf16() -> None:
    # weighed by samples where the loss is a token mean: 24% of the update, far above bf16's rounding
    with pytest.raises(SplitNotExactError, match="relative difference"):
        train(
            "llama",
            "AutoAccumulation",
            precision="bf16-mixed",
            steps=1,
            exactness="raise",
            count_fn=len_samples,
        )


def len_samples(micro_batch: dict) -> int:
    return len(micro_batch["input_ids"])


def test_the_engine_learns_what_each_model_counts() -> None:
    learned = {}
    for name in ("gpt2", "llama", "bert", "t5", "vit"):
        callback = AutoAccumulation(micro_batch_size=2, log=False, exactness="off")
        module = ZooModule(name, dtype=dtype_of(name))
        quiet_trainer([callback], max_steps=1).fit(module, loader(name, 6, batches=1, dtype=dtype_of(name)))
        (weighting,) = callback.engine.weights.learned.values()
        learned[name] = str(weighting.rule(0))  # its one part's best rule
    assert learned == {
        "gpt2": "(batch['labels'][:, 1:] != -100).sum()",  # the causal shift, from the loss itself
        "llama": "(batch['labels'][:, 1:] != -100).sum()",
        "bert": "(batch['labels'] != -100).sum()",
        "t5": "(batch['labels'] != -100).sum()",
        "vit": "(batch['labels'] != -100).sum()",  # one label per image: the same shares as samples
    }


@pytest.mark.parametrize(
    ("name", "count_fn"),
    [
        (
            "bert",
            lambda mb: len(mb["input_ids"]),
        ),  # what the callbacks did before: samples (24% of the update)
        ("gpt2", lambda mb: len(mb["input_ids"])),  # 24%
        ("gpt2", lambda mb: (mb["labels"] != -100).sum()),  # labels != -100 without the causal shift: 2.4%
    ],
)
def test_other_weightings_are_not_exact_with_padding(name: str, count_fn) -> None:
    start, reference, _ = train(name)
    _, split, _ = train(name, "AutoAccumulation", count_fn=count_fn)
    assert relative_difference(start, split, reference) > 1e-3


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print(f"{'model':<20}{'dtype':<10}" + "".join(f"{c:>20}" for c in CALLBACKS))
    for name in ZOO:
        start, reference, _ = train(name)
        diffs = [relative_difference(start, train(name, c)[1], reference) for c in CALLBACKS]
        print(f"{name:<20}{str(dtype_of(name))[6:]:<10}" + "".join(f"{d:>20.2e}" for d in diffs))


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2", "gemma2", "phi3"])
def test_bf16_causal_lms_read_the_device_once_a_steady_step(name: str, monkeypatch) -> None:
    # Their loss is a mean over the labels != -100: each step's micro-batches weigh by their counts, which
    # are read together, once, before the first forward (on a GPU a read waits for the queued work)
    module = ZooModule(name, dtype=torch.float32)
    no_dropout(module)
    reads = DeviceReads(monkeypatch)
    callbacks = [AutoAccumulation(micro_batch_size=2, log=False), reads]
    trainer = quiet_trainer(callbacks, max_steps=4, precision="bf16-mixed")
    trainer.fit(module, loader(name, 6, batches=4))
    assert reads.since(3) == ["tolist in lightning_memopt/_tree.py"] * 2
