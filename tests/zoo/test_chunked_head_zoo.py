"""AutoCheckpoint(head="auto") on Hugging Face causal LMs built from tiny configs: each model is either
taken (its loss computed by linear_cross_entropy: parameters after a few steps equal those trained with
the model's own logits, float64) or declined with one note naming why. Nothing stays after fit."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from lightning_memopt import AutoAccumulation, AutoCheckpoint, SplitNotExactWarning
from lightning_memopt.head.causal_lm import take_over_heads
from lightning_memopt.memory import MemoryTracker
from tests.batching.helpers import quiet_trainer
from tests.head.helpers import second_passes
from tests.zoo import models as zoo
from tests.zoo.models import SEQ, VOCAB, ZooModule, transformers

STEPS, BATCH = 3, 4


def _tiny(config_class, **extra):
    sizes = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return config_class(vocab_size=VOCAB, pad_token_id=0, **sizes, **extra)


def qwen2(dtype):
    return transformers.Qwen2ForCausalLM(_tiny(transformers.Qwen2Config, tie_word_embeddings=True)).to(dtype)


def mistral(dtype):
    return transformers.MistralForCausalLM(_tiny(transformers.MistralConfig, head_dim=8)).to(dtype)


def gemma2(dtype):
    config = _tiny(transformers.Gemma2Config, head_dim=8, final_logit_softcapping=30.0)
    return transformers.Gemma2ForCausalLM(config).to(dtype)


def granite(dtype):
    config = _tiny(transformers.GraniteConfig, logits_scaling=8.0)
    return transformers.GraniteForCausalLM(config).to(dtype)


def mixtral_aux(dtype):
    model = zoo.mixtral(dtype)
    model.config.output_router_logits = True  # the loss adds router_aux_loss_coef * the balancing loss
    return model


def phi3(dtype):
    config = _tiny(transformers.Phi3Config, original_max_position_embeddings=SEQ)
    return transformers.Phi3ForCausalLM(config).to(dtype)


class ZLossGPT2LMHeadModel(transformers.GPT2LMHeadModel):
    """A user's GPT-2 whose loss adds a z-loss (1e-2 * mean squared log-sum-exp of the logits)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + 1e-2 * out.logits.logsumexp(-1).pow(2).mean()
        return out


TAKEN = {
    "gpt2": zoo.gpt2,
    "llama": zoo.llama,
    "qwen2_tied": qwen2,
    "mistral": mistral,
    "mixtral": zoo.mixtral,
    "gemma2_softcap": gemma2,  # its final logit soft-capping computed chunk by chunk
    "granite_scaled": granite,  # its logits divided by logits_scaling, chunk by chunk
}
DECLINED = {
    "mixtral_aux": (
        mixtral_aux,
        r"router auxiliary loss added to the loss \(config.output_router_logits=True\)",
    ),
    # Nothing in the config says so: the first batch's check finds the loss's extra term.
    "gpt2_z_loss": (
        lambda dtype: ZLossGPT2LMHeadModel(zoo.gpt2(dtype).config).to(dtype),
        r"its loss differs",
    ),
}


class LM(ZooModule):
    """``model(**batch).loss``, or (``own_float64``) the model's own logits with a float64 shifted
    cross-entropy: the reference (the model's own loss upcasts logits to float32, also in float64)."""

    def __init__(self, build, own_float64: bool = False, dtype: torch.dtype = torch.float64) -> None:
        super(ZooModule, self).__init__()
        torch.manual_seed(0)
        self.model, self.lr, self.own_float64 = build(dtype), 0.05, own_float64
        self.logits_seen: list[bool] = []
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        if not self.own_float64:
            out = self.model(**batch)
            self.logits_seen.append("logits" in out)  # an output without them has no such key
            self.losses.append(out.loss.detach())
            return out.loss
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
        return F.cross_entropy(shifted, batch["labels"][:, 1:].reshape(-1))


def _fit(module, callbacks, batch=BATCH, dtype=torch.float64, **trainer_options):
    trainer = quiet_trainer(callbacks, max_steps=STEPS, **trainer_options)
    torch.manual_seed(1)  # the same dropout masks in every run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, zoo.loader("gpt2", batch, batches=STEPS, dtype=dtype))
    return [str(w.message) for w in caught if "lightning_memopt.head" in str(w.message)]


def _assert_same(module, reference, start) -> None:
    params, ref = dict(module.named_parameters()), dict(reference.named_parameters())
    assert params.keys() == ref.keys()
    diff = sum(((params[k] - ref[k]).detach() ** 2).sum() for k in ref)
    update = sum(((ref[k] - start[k]) ** 2).sum() for k in ref)
    assert update > 0
    rel = float((diff / update).sqrt().detach())
    assert rel <= 1e-10, f"parameters differ from the own head's by {rel:.3g} of the update"


def _assert_nothing_left(module) -> None:
    assert not [m for m in module.modules() if "forward" in vars(m)]


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_taken_trains_like_the_model_own_head(name):
    build = TAKEN[name]
    reference = LM(build, own_float64=True)
    start = {k: v.detach().clone() for k, v in reference.named_parameters()}
    _fit(reference, [AutoCheckpoint(head="keep")])
    module = LM(build)
    notes = _fit(module, [AutoCheckpoint()])
    assert notes == []
    assert module.logits_seen == [False] * STEPS  # the chunked head ran every step: no logits made
    _assert_same(module, reference, start)
    _assert_nothing_left(module)
    assert module.model(**zoo.causal_lm_batch(2)).logits is not None  # the model's own forward again


# Grouped-query models (and GPT-2) under CPU autocast: float32 parameters, bf16 matmuls.
BF16_TAKEN = {
    "gpt2": zoo.gpt2,
    "llama": zoo.llama,
    "mistral": mistral,
    "qwen2_tied": qwen2,
    "gemma2_softcap": gemma2,
    "phi3": phi3,
}


@pytest.mark.parametrize("weight_gradient", ["summed", "by_columns"])
@pytest.mark.parametrize("name", sorted(BF16_TAKEN))
def test_taken_under_bf16_mixed_with_the_model_own_float32_loss(name, weight_gradient, monkeypatch):
    """Issue 33: bf16-mixed runs take the head (they were declined: "its gradient differs from the model's
    own by 0.005"); the first step's loss is the model's own under bf16-mixed (bf16 logits, logits.float(),
    float32 cross-entropy) to 1e-5, and later steps follow it (bf16 gradients, rounded apart). With the
    weight's gradient summed over chunks (a CPU's way) and by columns (CUDA's, switched on here: the
    first-batch check and every step go through it)."""
    calls = second_passes(monkeypatch, ("cpu",) if weight_gradient == "by_columns" else ())
    build = BF16_TAKEN[name]
    reference = LM(build, dtype=torch.float32)
    start = {k: v.detach().clone() for k, v in reference.named_parameters()}
    _fit(reference, [AutoCheckpoint(head="keep")], dtype=torch.float32, precision="bf16-mixed")
    module = LM(build, dtype=torch.float32)
    notes = _fit(module, [AutoCheckpoint()], dtype=torch.float32, precision="bf16-mixed")
    assert notes == []
    assert reference.logits_seen == [True] * STEPS and module.logits_seen == [False] * STEPS
    assert all(loss.dtype == torch.float32 for loss in module.losses)
    got, want = float(module.losses[0]), float(reference.losses[0])
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    params, ref = dict(module.named_parameters()), dict(reference.named_parameters())
    diff = sum(((params[k] - ref[k]).detach() ** 2).sum() for k in ref)
    update = sum(((ref[k] - start[k]) ** 2).sum() for k in ref)
    assert float((diff / update).sqrt().detach()) <= 2e-2  # bf16's rounding of the gradients, 3 steps
    _assert_nothing_left(module)
    if weight_gradient == "by_columns":
        assert len(calls) >= STEPS  # every step's head (and the first batch's check)
    else:
        assert calls == []  # a float32 weight on a CPU: summed over the chunks


@pytest.mark.parametrize("name", ["gemma2_softcap", "llama", "qwen2_tied"])
def test_taken_under_bf16_true_with_the_weight_gradient_by_columns(name, monkeypatch):
    """``bf16-true`` (bf16 parameters) on a CPU: the chunked head is taken (no note), computes the weight's
    gradient by columns every step (a half-precision weight; a tied one gets the embedding's gradient added),
    and its first loss is the model's own bf16 logits' float32 cross-entropy to 1e-5; the later steps' losses
    follow the own head's run to bf16's rounding."""
    calls = second_passes(monkeypatch)
    build = BF16_TAKEN[name]
    reference = LM(build, dtype=torch.bfloat16)
    _fit(reference, [AutoCheckpoint(head="keep")], dtype=torch.bfloat16, precision="bf16-true")
    assert calls == []
    module = LM(build, dtype=torch.bfloat16)
    notes = _fit(module, [AutoCheckpoint()], dtype=torch.bfloat16, precision="bf16-true")
    assert notes == []
    assert reference.logits_seen == [True] * STEPS and module.logits_seen == [False] * STEPS
    assert len(calls) >= STEPS  # every step's head (and the first batch's check)
    assert all(loss.dtype == torch.float32 for loss in module.losses)
    got, want = float(module.losses[0]), float(reference.losses[0])
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    for got, want in zip(module.losses[1:], reference.losses[1:], strict=True):
        assert abs(float(got) - float(want)) <= 1e-2 * abs(float(want))
    _assert_nothing_left(module)


@pytest.mark.parametrize(
    ("name", "flat", "fit"),
    [(name, True, 5) for name in sorted(BF16_TAKEN)] + [("llama", False, 5), ("llama", True, 2)],
)
def test_bf16_lms_whose_micro_steps_cost_their_samples_keep_their_own_head_untried(
    name, flat, fit, monkeypatch
):
    """``AutoCheckpoint()`` beside ``AutoAccumulation`` under bf16-mixed, a batch of 16 where ``fit`` samples
    fit (the probes' bytes priced: a million + 1,000 a sample with the model's own head, 700 with the chunked
    head, 200 recomputed; the own head searched first): where the search's timed probes say a micro-step
    costs its samples alone (``flat``: priced 0.01 s a sample), the model's own head runs 4 micro-batches
    of 4 (8 of 2 where 2 fit: its first probe, of 1 sample, timed again), and neither the chunked head nor
    recompute is probed, profiled or tried; with a launch cost (1 s a micro-step) the later ways are
    searched and the trial starts (3 steps: it goes on)."""
    from lightning_memopt.batching.probe import BatchProbes
    from lightning_memopt.checkpointing.auto import AutoCheckpointer

    used, use = [], AutoCheckpointer.use
    monkeypatch.setattr(AutoCheckpointer, "use", lambda self, way: used.append(way) or use(self, way))
    profiled, plan_from = [], AutoCheckpointer._plan_from
    monkeypatch.setattr(
        AutoCheckpointer, "_plan_from", lambda *a, **k: profiled.append(1) or plan_from(*a, **k)
    )
    peak = BatchProbes.peak

    def priced(self, samples, evaluation=False):
        peak(self, samples, evaluation)  # the real micro-step, as the search runs it
        self.seconds = (0.0 if flat else 1.0) + 0.01 * samples
        return 10**6 + {"own head": 1_000, "keep": 700, "full": 200}[used[-1]] * samples

    monkeypatch.setattr(BatchProbes, "peak", priced)
    module = LM(BF16_TAKEN[name], dtype=torch.float32)
    keys = list(module.state_dict())
    accumulation = AutoAccumulation(max_memory=10**6 + fit * 1_000 + 500, headroom=0.0)  # the own head's
    checkpoint = AutoCheckpoint()
    trainer = quiet_trainer([checkpoint, accumulation], max_steps=STEPS, precision="bf16-mixed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, zoo.loader("gpt2", 16, batches=STEPS, dtype=torch.float32))
    said = [str(w.message) for w in caught if str(w.message).startswith("AutoCheckpoint")]
    assert list(module.state_dict()) == keys
    _assert_nothing_left(module)
    if not flat:
        assert "full" in used and profiled and said == []
        return
    assert set(used) == {"own head"} and not profiled  # searched, then decided
    count, low = -(-16 // fit), {5: "0.02 s at 2 samples", 2: "0.01 s at 1 sample"}[fit]
    runs = 16 // count  # where 5 fit, the search stops at 4: 16 samples run as 4 of 4 at 4 or 5 alike
    assert said == [
        f"AutoCheckpoint checkpoints no block of LM and leaves its own output head: {count} micro-batches of "
        f"{runs} with the model's own head: fewer, larger micro-batches would save at most 0.0% of the "
        f"step (a micro-step: {low}, {0.01 * runs:g} s at {runs})"
    ]
    assert module.logits_seen[-count:] == [True] * count  # the own head: logits made


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_declined_with_one_note_and_trains_as_without(name):
    build, reason = DECLINED[name]
    reference = LM(build)
    _fit(reference, [AutoCheckpoint(head="keep")])
    module = LM(build)
    notes = _fit(module, [AutoCheckpoint()])
    assert len(notes) == 1, notes
    assert "the chunked output head (lightning_memopt.head) is not used" in notes[0]
    assert re.search(reason, notes[0]), notes[0]
    assert module.logits_seen == [True] * STEPS
    for (key, got), want in zip(module.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(got, want), key
    _assert_nothing_left(module)


def test_chunked_raises_where_auto_declines():
    with pytest.raises(
        RuntimeError,
        match=r"head='chunked': MixtralForCausalLM has a router auxiliary loss added to the loss",
    ):
        _fit(LM(mixtral_aux), [AutoCheckpoint(head="chunked")])
    with pytest.raises(RuntimeError, match=r"head='chunked': its loss differs from the model's own"):
        _fit(LM(DECLINED["gpt2_z_loss"][0]), [AutoCheckpoint(head="chunked")])
    with pytest.raises(RuntimeError, match=r"found no Hugging Face causal LM .* in ZooModule"):
        _fit(ZooModule("bert"), [AutoCheckpoint(head="chunked")])


def test_bad_head_option():
    with pytest.raises(ValueError, match=r"head must be one of \('auto', 'chunked', 'keep'\), got 'yes'"):
        AutoCheckpoint(head="yes")


def test_micro_batches_with_the_chunked_head_equal_the_unsplit_run():
    """AutoAccumulation sees the chunked loss (labels[:, 1:] != -100 counted): splitting is exact, silently."""
    reference = LM(zoo.gpt2)
    start = {k: v.detach().clone() for k, v in reference.named_parameters()}
    zoo.no_dropout(reference)
    _fit(reference, [AutoCheckpoint()])
    module = zoo.no_dropout(LM(zoo.gpt2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitNotExactWarning)
        _fit(module, [AutoCheckpoint(), AutoAccumulation(micro_batch_size=1, log=False)])
    assert module.logits_seen[:2] == [False, False]
    _assert_same(module, reference, start)


def test_the_step_holds_no_logits():
    """MemoryTracker's peak of one step with a 4,096-token vocabulary: the chunked head's is lower than the
    own head's by at least two logits tensors (the logits and the log-softmax saved for backward)."""
    config = transformers.GPT2Config(vocab_size=4096, n_layer=2, n_embd=32, n_head=2, n_positions=SEQ)
    batch = zoo.causal_lm_batch(8)
    peaks = {}
    for head in ("keep", "auto"):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        undo = take_over_heads(model, head, note=pytest.fail)
        with MemoryTracker(model) as tracker:
            model(**batch).loss.backward()
        undo()
        peaks[head] = tracker.peak
    logits = 8 * SEQ * 4096 * 4
    assert peaks["keep"] - peaks["auto"] >= 2 * logits, peaks


def _sweep_rows():
    from benchmarks.micro_batching_zoo import ARCHS

    return [arch for arch in ARCHS if arch.task == "causal_lm"]


SWEEP_DECLINED = {
    "roberta_causal": "the hidden states entering its output head are not its base model's output",
}


@pytest.mark.parametrize("arch", _sweep_rows(), ids=lambda arch: arch.name)
def test_every_causal_lm_of_the_sweep_is_taken_exactly_or_declined_with_its_reason(arch):
    """benchmarks/head_zoo.py's rows: taken (loss and gradients within 1e-10 of a float64 cross-entropy
    over the head's own logits) or declined with the note naming why; never silent, never different."""
    from benchmarks.head_zoo import sweep_one

    outcome, detail = sweep_one(arch)
    if arch.name == "xglm":
        assert outcome == "skipped" and "overflow" in detail  # its sinusoidal positions, in float64
    elif arch.name in SWEEP_DECLINED:
        assert outcome == "declined" and SWEEP_DECLINED[arch.name] in detail, detail
    else:
        assert outcome == "taken", detail
