"""AutoCheckpoint on architectures nobody here wrote (tests/zoo/models.py), with their defaults.

For every zoo model and the modes auto (zero arguments), full and selective: the fit runs, the parameters
equal those of the same fit without the package, state_dict keys do not change, discovery finds every
stack an expert would checkpoint, and zero-argument AutoCheckpoint cuts the step's peak live tensor bytes
to at most 0.75x where activations dominate. After fit, successful or not, nothing stays on the model.
"""

from __future__ import annotations

import functools
import gc
import io
import warnings
import weakref
from collections import Counter
from contextlib import nullcontext

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_memopt import AutoCheckpoint
from lightning_memopt.checkpointing import (
    CostModel,
    capture_block_inputs,
    checkpointed_blocks,
    find_blocks,
    profile_blocks,
)
from lightning_memopt.memory import MemoryTracker
from tests.batching.helpers import quiet_trainer
from tests.zoo.models import ZOO, ZooModule, loader, packed_causal_lm_batch

SMALL, LARGE = 2, 24  # samples per batch: exactness runs, and peak runs where activations dominate


def _stack(prefix: str, *counts: int, inner: str = "") -> list[str]:
    """Block names ``prefix.<stage>.<inner>.<i>`` (or ``prefix.<i>`` without stages)."""
    if not inner:
        return [f"model.{prefix}.{i}" for i in range(counts[0])]
    return [f"model.{prefix}.{s}.{inner}.{i}" for s, n in enumerate(counts) for i in range(n)]


# What an expert checkpoints: every transformer layer, encoder AND decoder, every residual block of every
# stage (not the stages, not the conv units inside a block), and the stem before the first stack where it
# is a module of its own with a weight layer (find_blocks' rule 5): a CNN's stem runs at the highest
# resolution (~40% of a ResNet's activations), a ViT's/Swin's patch embedding and BERT's embeddings are the
# same kind of unit. GPT-2, Llama, Mixtral, T5 and torch's Transformer embed with a bare Embedding: no stem.
EXPECTED_BLOCKS = {
    "gpt2": _stack("transformer.h", 3),
    "llama": _stack("model.layers", 3),
    "mixtral": _stack("model.layers", 2),
    "mistral": _stack("model.layers", 2),
    "qwen2": _stack("model.layers", 2),
    "gemma2": _stack("model.layers", 2),
    "phi3": _stack("model.layers", 2),
    "bert": ["model.bert.embeddings", *_stack("bert.encoder.layer", 3)],
    "t5": _stack("encoder.block", 2) + _stack("decoder.block", 2),
    "vit": ["model.vit.embeddings", *_stack("vit.layers", 3)],
    "resnet": ["model.resnet.embedder", *_stack("resnet.encoder.stages", 2, 2, 2, 2, inner="layers")],
    "resnet_bottleneck": [
        "model.resnet.embedder",
        *_stack("resnet.encoder.stages", 1, 2, 2, 1, inner="layers"),
    ],
    "convnext": ["model.convnext.embeddings", *_stack("convnext.encoder.stages", 2, 2, 2, 2, inner="layers")],
    "mobilenet_v2": ["model.mobilenet_v2.conv_stem", *_stack("mobilenet_v2.layer", 16)],
    "efficientnet": ["model.efficientnet.embeddings", *_stack("efficientnet.encoder.blocks", 8)],
    "swin": ["model.swin.embeddings", *_stack("swin.encoder.layers", 2, 2, inner="blocks")],
    "torch_transformer": _stack("encoder.layers", 2) + _stack("decoder.layers", 2),
}


def _dtype(name: str) -> torch.dtype:
    # HF causal-LM losses upcast logits with .float(): those models are checked in float32 (models.py).
    return torch.float32 if ZOO[name].kind == "causal_lm" else torch.float64


class _Peak(Callback):
    """Each training step's peak live tensor bytes (MemoryTracker), profiling included. One instance goes
    first and one last in the callbacks: the tracker spans every other callback's batch hooks."""

    def __init__(self, shared: dict, first: bool) -> None:
        self.shared, self.first = shared, first

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first:
            self.shared["tracker"] = MemoryTracker(pl_module, trainer.optimizers).__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.first:
            tracker = self.shared.pop("tracker")
            tracker.__exit__(None, None, None)
            self.shared.setdefault("peaks", []).append(tracker.peak)


class _Seen(Callback):
    """Which blocks run checkpointed, and how, in each training step."""

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(checkpointed_blocks(pl_module))


def _fit(
    name: str,
    callbacks: list,
    batch_size: int,
    measure: bool = False,
    module=None,
    quiet=True,
    precision=None,
    batch=None,
):
    """Two SGD steps; ``precision="bf16-mixed"``: float32 parameters under CPU bf16 autocast; ``batch``:
    another batch function than the model's."""
    module = module or ZooModule(name, dtype=torch.float32 if precision else _dtype(name))
    shared: dict = {}
    if measure:
        callbacks = [_Peak(shared, True), *callbacks, _Peak(shared, False)]
    trainer = quiet_trainer(callbacks, max_steps=2, **({"precision": precision} if precision else {}))
    seen: list[dict] = []
    trainer.callbacks.append(_Seen(seen))
    torch.manual_seed(1)  # the same dropout masks in every run
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        trainer.fit(module, loader(name, batch_size, dtype=next(module.parameters()).dtype, batch=batch))
    return module, trainer, seen, shared.get("peaks")


@functools.cache
def _plain(name: str, batch_size: int, measure: bool):
    module, _, _, peaks = _fit(name, [], batch_size, measure)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, peaks and max(peaks)


def _assert_same_parameters(name: str, module, reference: dict) -> None:
    state = module.state_dict()
    assert list(state) == list(reference)  # the package changes no state_dict key
    rtol = 1e-5 if _dtype(name) == torch.float32 else 1e-10
    for key, value in state.items():
        torch.testing.assert_close(value, reference[key], rtol=rtol, atol=rtol * 1e-2, msg=key)


def _assert_nothing_left(module) -> None:
    assert checkpointed_blocks(module) == {}
    assert "configure_model" not in vars(module)
    assert not [m for m in module.modules() if "forward" in vars(m)]
    torch.save(module, io.BytesIO())


@pytest.mark.parametrize("name", sorted(ZOO))
def test_discovery_finds_every_stack(name):
    assert [n for n, _ in find_blocks(ZooModule(name))] == EXPECTED_BLOCKS[name]


@pytest.mark.parametrize("name", sorted(ZOO))
def test_blocks_profiled_once_hold_what_each_holds_profiled_alone(name, monkeypatch):
    """Blocks that run alike are profiled once, though the first of a stack counts the inputs every layer
    takes (an attention mask, position embeddings): each then holds, by treatment, what it holds profiled
    on its own. Every grouped-query LM's layers are one profile."""
    import lightning_memopt.checkpointing.profile as profile_module

    torch.manual_seed(0)
    model = ZOO[name].build()
    blocks = find_blocks(model)
    inputs = capture_block_inputs(model, blocks, **ZOO[name].batch(2, 0))
    runs = []
    run = profile_module._profile_block
    monkeypatch.setattr(profile_module, "_profile_block", lambda n, *a: runs.append(n) or run(n, *a))
    choices = ["keep", "full", "selective"]

    def held(profile):
        return {
            c: (o.internal_bytes, o.saves_input, o.saves_output, o.recompute_flops)
            for c, o in profile.options.items()
        }

    together = [held(p) for p in profile_blocks(model, blocks, inputs=inputs, choices=choices)]
    profiled = len(runs)
    alone = [held(profile_blocks(model, [block], inputs=inputs, choices=choices)[0]) for block in blocks]
    assert together == alone
    if name in GQA:
        assert profiled == 1 < len(blocks)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_forced_modes_train_exactly(name, mode):
    module, _, seen, _ = _fit(name, [AutoCheckpoint(mode=mode)], SMALL)
    assert seen[0] == dict.fromkeys(EXPECTED_BLOCKS[name], mode) == seen[1]
    _assert_same_parameters(name, module, _plain(name, SMALL, False)[0])
    _assert_nothing_left(module)


# Under bf16-mixed (float32 parameters, CPU bf16 autocast, as a GPU user trains): the grouped-query causal
# LMs (fewer key/value heads than query heads: Llama 3, Mistral, Qwen 2, Gemma 2, Phi-3, Mixtral) with each
# treatment; the others of the zoo with pointwise, whose recomputation of norms and casts is the one that
# once differed under bf16 (tests/checkpointing/test_pointwise.py): GPT-2, BERT, T5 and ViT (the CNNs
# and torch's Transformer cost the most CI time). Recomputation replays the forward's own ops on the same
# inputs under the same autocast: the update is bit-equal to the plain bf16-mixed run's, not merely close
# (measured with planned, full and pointwise: 0.0 on all 17 models of the zoo on torch 2.13, and on the
# GQA models, GPT-2, BERT and T5 on torch 2.11).
GQA = ["gemma2", "llama", "mistral", "mixtral", "phi3", "qwen2"]
# max_memory for the planned runs: ~1.1x the least that fits (parameters, gradients, SGD state, what runs
# outside the blocks, the blocks' smallest peak at batch 2, bf16-mixed), so the plan must recompute.
PLANNED_MAX_MEMORY = {
    "gemma2": "345KiB",
    "llama": "410KiB",
    "mistral": "330KiB",
    "mixtral": "580KiB",
    "phi3": "325KiB",
    "qwen2": "330KiB",
}
BF16_RUNS = [(n, m) for n in GQA for m in ("planned", "full", "pointwise")] + [
    (n, "pointwise") for n in ("gpt2", "bert", "t5", "vit")
]


def test_the_zoo_has_grouped_query_causal_lms():
    grouped = []
    for name, entry in ZOO.items():
        cfg = getattr(entry.build(), "config", None)
        heads = getattr(cfg, "num_attention_heads", None)
        if entry.kind == "causal_lm" and getattr(cfg, "num_key_value_heads", heads) < heads:
            grouped.append(name)
    assert sorted(grouped) == GQA


def _bf16_batch(name: str):
    # the GQA models on packed batches (no attention_mask): grouped-query attention then runs inside SDPA
    return packed_causal_lm_batch if name in GQA else None


@functools.cache
def _plain_bf16(name: str) -> dict:
    module, _, _, _ = _fit(name, [], SMALL, precision="bf16-mixed", batch=_bf16_batch(name))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize(("name", "mode"), BF16_RUNS)
def test_bf16_mixed_checkpointing_is_bit_equal(name, mode):
    # head="keep": the model's own head, so that only checkpointing is compared (the chunked head under
    # bf16-mixed: tests/zoo/test_chunked_head_zoo.py)
    # planned: priced in FLOPs (use_time=False), deterministic and with no treatment timed (seconds in CI)
    options = {"mode": mode}
    if mode == "planned":
        options = {
            "max_memory": PLANNED_MAX_MEMORY[name],
            "headroom": 0.0,
            "cost_model": CostModel(use_time=False),
        }
    callback = AutoCheckpoint(head="keep", **options)
    module, _, seen, _ = _fit(name, [callback], SMALL, precision="bf16-mixed", batch=_bf16_batch(name))
    reference = _plain_bf16(name)
    assert list(module.state_dict()) == list(reference)
    for key, value in module.state_dict().items():
        assert torch.equal(value, reference[key]), key
    checkpointed = [n for n, c in callback.plan.choices.items() if c != "keep"]
    assert seen[1] == callback.plan.choices and list(seen[1]) == EXPECTED_BLOCKS[name]
    if (
        mode == "planned"
    ):  # planned under the limit: at least one block recomputes (the goal: all GQA)
        assert checkpointed and callback.plan.predicted, callback.plan.choices
        print(f"{name}: {callback.plan.choices}")
    else:
        assert seen[0] == dict.fromkeys(EXPECTED_BLOCKS[name], mode) == seen[1]
    _assert_nothing_left(module)


# The bound: AutoCheckpoint() takes the step peak to at most 0.75x *where activations dominate*.
# The basic ResNet's floor is the backward of its stem (checkpointed or not): parameters and all
# gradients (2.13 + 2.10 MB, float64, SGD) plus the batch and one conv-output-sized tensor per sample are
# live at its ReLU's backward: at 24 samples that is 0.82x of the plain step (activations do not
# dominate there); at 96 samples the same floor is ~0.73x. So it is measured at 96.
MAX_PEAK = 0.75
PEAK_BATCH = dict.fromkeys(ZOO, LARGE) | {"resnet": 96}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zero_arguments_cuts_the_peak_and_trains_exactly(name):
    callback = AutoCheckpoint()
    module, trainer, seen, peaks = _fit(name, [callback], PEAK_BATCH[name], measure=True)
    reference, plain_peak = _plain(name, PEAK_BATCH[name], True)
    _assert_same_parameters(name, module, reference)
    assert seen[0] == dict.fromkeys(EXPECTED_BLOCKS[name], "full")
    assert seen[1] == callback.plan.choices and list(seen[1]) == EXPECTED_BLOCKS[name]
    measured = trainer.callback_metrics["checkpoint/activation_bytes_measured"].item()
    print(
        f"| {name} | auto | ok | {peaks[1] / plain_peak:.2f}x (first step, profiling included: "
        f"{peaks[0] / plain_peak:.2f}x) | {len(seen[1])} | {dict(Counter(seen[1].values()))} | "
        f"measured/predicted {measured / callback.plan.activation_bytes:.3f} |"
    )
    assert peaks[1] <= MAX_PEAK * plain_peak  # the training step, with the final plan
    assert peaks[0] <= plain_peak  # the first step, blocks profiled after it: never above the plain step
    assert measured == pytest.approx(callback.plan.activation_bytes, rel=0.1)
    _assert_nothing_left(module)


class _Failing(ZooModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 1:  # after profiling and planning
            raise ValueError("user bug")
        return loss


@pytest.mark.parametrize("fails", [False, True])
def test_nothing_holds_the_model_after_fit(fails):
    name = "t5"  # an encoder-decoder with a key/value cache: the most there is to leave behind
    callback = AutoCheckpoint()
    module = (_Failing if fails else ZooModule)(name)
    trainer = quiet_trainer([callback], max_steps=2)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="user bug") if fails else nullcontext():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(name, SMALL))
    assert callback.plan is not None and callback.plan.predicted  # it got as far as planning
    _assert_nothing_left(module)
    ref = weakref.ref(module)
    del trainer, module  # the callback stays referenced, as a user's would
    gc.collect()
    assert ref() is None


def test_hf_gradient_checkpointing_is_not_doubled():
    module = ZooModule("gpt2")
    module.model.gradient_checkpointing_enable({"use_reentrant": False})
    with pytest.warns(
        UserWarning, match=r"GPT2LMHeadModel.is_gradient_checkpointing\) already checkpoints"
    ) as rec:
        _, _, seen, _ = _fit("gpt2", [AutoCheckpoint()], SMALL, module=module, quiet=False)
    assert sum("already checkpoints" in str(w.message) for w in rec) == 1
    assert seen == [{}, {}]  # HF checkpoints, AutoCheckpoint stepped aside
    _assert_same_parameters("gpt2", module, _plain("gpt2", SMALL, False)[0])


if __name__ == "__main__":
    # The zoo table: every model x mode at the peak test's batch size (not run by pytest).
    #   PYTHONPATH=$PWD python tests/zoo/test_auto_checkpoint_zoo.py
    print("| model | mode | result | step peak vs plain (first step) | blocks | plan |")
    print("|---|---|---|---|---|---|")
    for name in sorted(ZOO):
        reference, plain_peak = _plain(name, LARGE, True)
        for mode in ("auto", "full", "selective"):
            callback = AutoCheckpoint(mode=mode)
            try:
                module, _, seen, peaks = _fit(name, [callback], LARGE, measure=True)
                _assert_same_parameters(name, module, reference)
                result = "ok"
            except Exception as err:  # noqa: BLE001 - a table row per failure
                result, peaks, seen = f"FAILED: {str(err)[:60]}", [0, 0], [{}, {}]
            plan = dict(Counter(seen[-1].values()))
            print(
                f"| {name} | {mode} | {result} | {peaks[-1] / plain_peak:.2f}x ({peaks[0] / plain_peak:.2f}x) "
                f"| {len(seen[-1])} | {plan} |"
            )
