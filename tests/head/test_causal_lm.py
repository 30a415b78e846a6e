"""take_over_heads / ChunkedHead on a tiny Hugging Face GPT-2, without Lightning: which calls it takes, what
it returns, the first batch's check, and that its undo leaves the model as it was."""

from __future__ import annotations

import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_memopt import AutoCheckpoint
from lightning_memopt.head.causal_lm import (
    ChunkedHead,
    causal_lms,
    check_tolerances,
    decline_reason,
    take_over_heads,
)

transformers = pytest.importorskip("transformers")
V = 50


def _gpt2(**extra):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_layer=2, n_embd=16, n_head=2, n_positions=80, **extra)
    return transformers.GPT2LMHeadModel(config).double().eval()


def _batch(n=3, t=12, seed=0):
    ids = torch.randint(0, V, (n, t), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, 7:] = -100
    return ids, labels


def _own_float64(model, ids, labels, num_items=None):
    logits = model(input_ids=ids).logits[:, :-1].reshape(-1, V)
    reduction = "mean" if num_items is None else "sum"
    loss = F.cross_entropy(logits, labels[:, 1:].reshape(-1), reduction=reduction)
    return loss if num_items is None else loss / num_items


@pytest.mark.parametrize("num_items", [None, 17])
def test_loss_and_gradients_equal_the_own_logits(num_items):
    model = _gpt2()
    ids, labels = _batch()
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    undo = take_over_heads(model, "chunked", note=pytest.fail)
    out = model(ids, labels=labels, **extra)  # input_ids positional, as a user may call it
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
    # no logits: reading them says why and what to do, rather than handing back None
    with pytest.raises(AttributeError, match=r"no logits.*head='keep'"):
        out.logits  # noqa: B018
    assert "logits" not in out and out.to_tuple()[0] is out.loss
    assert repr(out).endswith("logits not computed)")
    got = torch.autograd.grad(out.loss, list(model.parameters()))
    undo()
    ref = _own_float64(model, ids, labels, num_items)
    want = torch.autograd.grad(ref, list(model.parameters()))
    assert abs(float(out.loss.detach() - ref.detach())) <= 1e-12 * abs(float(ref.detach()))
    for a, b in zip(got, want):
        assert float((a - b).abs().max()) <= 1e-10 * float(b.abs().max())


def test_calls_without_labels_or_gradient_run_the_own_forward():
    model = _gpt2()
    ids, labels = _batch()
    undo = take_over_heads(model, "auto", note=pytest.fail)
    assert model(ids).logits.shape == (3, 12, V)
    with torch.no_grad():
        assert model(ids, labels=labels).logits is not None
    assert "forward" in vars(model)  # still patched: those calls passed through
    undo()
    assert "forward" not in vars(model)


def test_keep_logits_returns_them_without_gradient():
    model = _gpt2()
    ids, labels = _batch()
    head = ChunkedHead(model, note=pytest.fail, keep_logits=True)
    out = model(ids, labels=labels)
    head.undo()
    assert torch.equal(out.logits, model(ids).logits.detach()) and not out.logits.requires_grad


def test_first_check_waits_for_a_slice_with_counted_labels():
    """A first sample whose labels are all ignored gives a NaN loss: nothing to compare; the next call is
    checked instead."""
    model = _gpt2()
    head = ChunkedHead(model, note=pytest.fail)
    ids, labels = _batch()
    labels[0] = -100
    model(ids, labels=labels)
    assert not head.verified
    model(*_batch(seed=1)[:1], labels=_batch(seed=1)[1])
    assert head.verified and head.declined is None
    head.undo()


def test_the_check_compares_on_a_64_token_prefix_of_one_sample():
    model = _gpt2()
    ids, labels = _batch(n=4, t=80)
    seen = []
    model.transformer.wte.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
    head = ChunkedHead(model, note=pytest.fail)
    model(ids, labels=labels)
    head.undo()
    assert seen == [(1, 64), (1, 64), (4, 80)]  # own, chunked, then the step itself


def test_decline_reasons_from_the_config():
    model = _gpt2()
    assert decline_reason(model) is None
    # computed chunk by chunk (linear_cross_entropy's logit_scale and softcap): not declined
    config = model.config
    config.logit_scale, config.logits_scaling, config.final_logit_softcapping = 0.5, 8.0, 30.0
    assert decline_reason(model) is None
    model.config.output_router_logits = True
    assert decline_reason(model) == (
        "GPT2LMHeadModel has a router auxiliary loss added to the loss (config.output_router_logits=True)"
    )
    model.config.output_router_logits = False
    model.logit_scale = torch.nn.Parameter(torch.tensor(2.0))  # learned: its gradient would be lost
    assert decline_reason(model) == "GPT2LMHeadModel has a learned logit scale (a tensor logit_scale)"


def test_decline_reasons_from_the_structure():
    class PlainLMHeadModel(torch.nn.Module):  # a user's class, named as transformers names causal LMs
        def __init__(self, head):
            super().__init__()
            self.lm_head, self.body = head, torch.nn.Linear(4, 4)

    assert causal_lms(torch.nn.Sequential(PlainLMHeadModel(torch.nn.Linear(4, V))))[0].body.in_features == 4
    assert decline_reason(PlainLMHeadModel(torch.nn.Linear(4, V))) == (
        "PlainLMHeadModel has no base model (base_model_prefix) whose output feeds the head"
    )
    assert decline_reason(PlainLMHeadModel(torch.nn.Sequential(torch.nn.Linear(4, V)))) == (
        "PlainLMHeadModel's output embeddings are not an nn.Linear"
    )
    notes = []
    with pytest.raises(RuntimeError, match="head='chunked': PlainLMHeadModel's output embeddings are not"):
        take_over_heads(PlainLMHeadModel(torch.nn.Identity()), "chunked", note=notes.append)
    take_over_heads(PlainLMHeadModel(torch.nn.Identity()), "auto", note=notes.append)()
    assert notes == [
        "the chunked output head (lightning_memopt.head) is not used: PlainLMHeadModel's output embeddings "
        "are not an nn.Linear"
    ]


def _assert_equal(loss, ref, got, want):
    """The loss within 1e-12 of the reference, every gradient within 1e-10 of the largest (float64)."""
    assert abs(float(loss.detach() - ref.detach())) <= 1e-12 * abs(float(ref.detach()))
    largest = max(float(b.abs().max()) for b in want)
    assert max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)) <= 1e-10 * largest


def _hf(config):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).double().eval()


def opt():  # its forward runs model.decoder, not the base model (model.model)
    return _hf(
        transformers.OPTConfig(
            vocab_size=V,
            hidden_size=16,
            num_hidden_layers=2,
            ffn_dim=32,
            num_attention_heads=2,
            word_embed_proj_dim=16,
            max_position_embeddings=80,
        )
    )


def biogpt():  # its output embeddings are output_projection
    sizes = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    return _hf(transformers.BioGptConfig(vocab_size=V, max_position_embeddings=80, **sizes))


@pytest.mark.parametrize("build", [opt, biogpt])
def test_taken_where_the_head_is_reached_otherwise(build):
    model, (ids, labels) = build(), _batch()
    undo = take_over_heads(model, "chunked", note=pytest.fail)
    out = model(input_ids=ids, labels=labels)
    assert "logits" not in out
    got = torch.autograd.grad(out.loss, list(model.parameters()))
    undo()
    ref = _own_float64(model, ids, labels)
    want = torch.autograd.grad(ref, list(model.parameters()))
    _assert_equal(out.loss, ref, got, want)


def roberta():  # a dense layer and a LayerNorm between the base model's output and the decoder
    sizes = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    return _hf(transformers.RobertaConfig(vocab_size=V, is_decoder=True, max_position_embeddings=90, **sizes))


def test_declined_at_the_first_batch_where_the_head_has_a_transform():
    model, (ids, labels) = roberta(), _batch()
    own = model(input_ids=ids, labels=labels).loss
    notes = []
    undo = take_over_heads(model, "auto", note=notes.append)
    out = model(input_ids=ids, labels=labels)
    undo()
    assert notes == [
        "the chunked output head (lightning_memopt.head) is not used: the hidden states entering its output "
        "head are not its base model's output; the model's own head computes the loss"
    ]
    assert float(out.loss.detach()) == float(own.detach()) and out.logits is not None


def bart():  # BartForCausalLM's loss compares position t's logits with label t: it does not shift
    sizes = dict(
        d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_ffn_dim=32
    )
    config = transformers.BartConfig(vocab_size=V, decoder_attention_heads=2, use_cache=False, **sizes)
    return _hf(config)


def test_a_loss_without_the_shift_is_learned_at_the_first_batch():
    model, (ids, labels) = bart(), _batch()
    head = ChunkedHead(model, note=pytest.fail)
    out = model(input_ids=ids, labels=labels)
    assert head.verified and not head.shift and "logits" not in out
    got = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    head.undo()
    logits = model(input_ids=ids).logits
    ref = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))  # no shift, in float64
    want = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
    assert [g is None for g in got] == [w is None for w in want]  # the encoder's positions: unused
    _assert_equal(out.loss, ref, [g for g in got if g is not None], [w for w in want if w is not None])


def test_a_wrapper_named_like_a_causal_lm_is_not_one():
    class GPTLMHeadModel(torch.nn.Module):  # a user's wrapper, named as transformers names causal LMs
        def __init__(self):
            super().__init__()
            self.lm = _gpt2()

    wrapper = GPTLMHeadModel()
    assert causal_lms(wrapper) == [wrapper.lm]
    undo = take_over_heads(wrapper, "chunked", note=pytest.fail)
    assert "forward" in vars(wrapper.lm)
    undo()
    assert "forward" not in vars(wrapper.lm)


def test_found_inside_a_wrapper_and_declined_with_a_note():
    notes = []
    wrapper = torch.nn.ModuleDict({"lm": _gpt2(), "other": torch.nn.Linear(2, 2)})
    assert causal_lms(wrapper) == [wrapper["lm"]]
    wrapper["lm"].config.output_router_logits = True  # as a mixture of experts with its auxiliary loss
    undo = take_over_heads(wrapper, "auto", note=notes.append)
    assert notes == [
        "the chunked output head (lightning_memopt.head) is not used: GPT2LMHeadModel has a router auxiliary "
        "loss added to the loss (config.output_router_logits=True)"
    ]
    assert "forward" not in vars(wrapper["lm"])
    undo()


def test_keep_changes_nothing():
    model = _gpt2()
    take_over_heads(model, "keep", note=pytest.fail)
    assert "forward" not in vars(model)


class ZLossGPT2LMHeadModel(transformers.GPT2LMHeadModel):
    """A user's GPT-2 whose loss adds a z-loss (1e-2 * the mean squared log-sum-exp of the logits)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss + 1e-2 * out.logits.float().logsumexp(-1).pow(2).mean()
        return out


class SkipOneGPT2LMHeadModel(transformers.GPT2LMHeadModel):
    """A user's GPT-2 whose position t predicts token t + 2 (a different shift)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        if labels is not None:
            logits = out.logits[:, :-2].float()
            out.loss = F.cross_entropy(logits.reshape(-1, V), labels[:, 2:].reshape(-1))
        return out


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_taken_under_autocast_with_the_model_own_float32_loss(half):
    """Under autocast (bf16-mixed, 16-mixed) the chunked loss is the model's own under the same precision
    (half-precision logits, logits.float(), float32 cross-entropy) to float32 rounding."""
    model, (ids, labels) = _gpt2().float(), _batch(t=40)
    with torch.autocast("cpu", dtype=half):
        own = model(ids, labels=labels).loss
        head = ChunkedHead(model, note=pytest.fail, strict=True)
        out = model(ids, labels=labels)
    head.undo()
    assert head.verified and head.declined is None and "logits" not in out
    assert out.loss.dtype == own.dtype == torch.float32
    assert abs(float(out.loss.detach() - own.detach())) <= 1e-5 * abs(float(own.detach()))


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda: ZLossGPT2LMHeadModel(_gpt2().config), r"its loss differs from the model's own by 0.0\d"),
        # An untrained model's loss is near log(V) whatever the shift: 0.0015 apart, 15 x the tolerance.
        (lambda: SkipOneGPT2LMHeadModel(_gpt2().config), r"its loss differs from the model's own by 0.001"),
        (roberta, "the hidden states entering its output head are not its base model's output"),
    ],
    ids=["z_loss", "shift_by_two", "transform_before_the_head"],
)
def test_a_real_difference_is_declined_under_autocast(half, build, reason):
    """The half-precision tolerance (:func:`check_tolerances`) still declines a loss with an extra term, a
    different shift and a transform before the projection, with the model's own loss computed."""
    torch.manual_seed(0)
    model, (ids, labels) = build().float().eval(), _batch(t=40)  # eval: no dropout, one own loss
    notes = []
    with torch.autocast("cpu", dtype=half):
        own = model(input_ids=ids, labels=labels).loss
        undo = take_over_heads(model, "auto", note=notes.append)
        out = model(input_ids=ids, labels=labels)
    undo()
    assert len(notes) == 1 and re.search(reason, notes[0]), notes
    assert float(out.loss.detach()) == float(own.detach()) and out.logits is not None


def test_check_tolerances_follow_the_precision_run():
    assert check_tolerances(torch.float64) == check_tolerances(torch.float32) == (1e-4, 1e-4)
    assert check_tolerances(torch.bfloat16) == (1e-4, 4 * 2**-7)
    assert check_tolerances(torch.float16) == (1e-4, 4 * 2**-10)


class _LM(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model, self.losses, self.logits_seen = model, [], []

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        out = self.model(input_ids=ids, labels=labels)
        self.losses.append(out.loss.detach())
        self.logits_seen.append("logits" in out)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _llama():
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=80)
    config = transformers.LlamaConfig(vocab_size=V, num_attention_heads=4, num_key_value_heads=2, **sizes)
    return transformers.LlamaForCausalLM(config)


def test_bf16_mixed_grouped_query_llama_takes_the_chunked_head_with_a_float32_loss():
    """Issue 33: under Trainer(precision="bf16-mixed") a grouped-query Llama's head was declined ("its
    gradient differs from the model's own by 0.005"). Now taken, its loss the model's own float32 loss
    (over bf16 logits) to 1e-5."""
    ids, labels = _batch(n=4, t=24)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=2)
    runs = {}
    for head in ("keep", "auto"):
        module = _LM(_llama())
        trainer = pl.Trainer(
            accelerator="cpu",
            precision="bf16-mixed",
            max_steps=2,
            callbacks=[AutoCheckpoint(head=head)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, data)
        notes = [str(w.message) for w in caught if "lightning_memopt.head" in str(w.message)]
        runs[head] = module, notes
    (own, _), (chunked, notes) = runs["keep"], runs["auto"]
    assert notes == []
    assert own.logits_seen == [True, True] and chunked.logits_seen == [False, False]
    assert chunked.losses[0].dtype == torch.float32
    assert abs(float(chunked.losses[0] - own.losses[0])) <= 1e-5 * abs(float(own.losses[0]))
    # the second step after one update with half-precision gradients rounded apart
    assert abs(float(chunked.losses[1] - own.losses[1])) <= 1e-3 * abs(float(own.losses[1]))


def _xlm_like(name):
    torch.manual_seed(0)
    sizes = dict(emb_dim=16, n_layers=2, n_heads=2, max_position_embeddings=128, n_langs=2, use_lang_emb=True)
    config = getattr(transformers, f"{name}Config")(vocab_size=V, bos_token_id=0, **sizes)
    return getattr(transformers, f"{name}WithLMHeadModel")(config).double().eval()


@pytest.mark.parametrize("name", ["XLM", "Flaubert"])
def test_per_sample_lengths_are_checked_on_the_whole_first_sample(name):
    """Issue 33: XLM's and FlauBERT's forward asserts ``lengths.max() <= slen``; a 64-position prefix broke
    it (AssertionError out of the check). The check runs the whole first sample instead and takes the head:
    the same loss and gradients as the model's own (its loss does not shift the labels)."""
    model, (ids, labels) = _xlm_like(name), _batch(n=3, t=80)
    call = dict(input_ids=ids, labels=labels, lengths=torch.full((3,), 80))
    want_loss = model(**call).loss
    want = torch.autograd.grad(want_loss, list(model.parameters()), allow_unused=True)
    head = ChunkedHead(model, note=pytest.fail, strict=True)
    out = model(**call)
    assert head.verified and not head.shift and "logits" not in out
    got = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    head.undo()
    assert [g is None for g in got] == [w is None for w in want]
    _assert_equal(out.loss, want_loss, [g for g in got if g is not None], [w for w in want if w is not None])


def git():  # its base model prepends the image's tokens to the text's
    torch.manual_seed(0)
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
    )
    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    config = transformers.GitConfig(
        vision_config=vision,
        vocab_size=V,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=80,
        **sizes,
    )
    return transformers.GitForCausalLM(config).double().eval()


class SingleSampleFailsGPT2LMHeadModel(transformers.GPT2LMHeadModel):
    """A user's model whose forward needs the whole batch (a batch-level statistic)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        if input_ids.shape[0] < 2:
            raise ValueError("batch statistics need at least 2 samples\nsecond line")
        return super().forward(input_ids=input_ids, labels=labels, **kwargs)


def _declined_like_own(model, call, reason):
    want_loss = model(**call).loss
    want = torch.autograd.grad(want_loss, list(model.parameters()), allow_unused=True)
    notes = []
    undo = take_over_heads(model, "auto", note=notes.append)
    out = model(**call)
    got = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    undo()
    assert notes == [
        f"the chunked output head (lightning_memopt.head) is not used: {reason}; the model's own head computes "
        "the loss"
    ]
    assert out.logits is not None and float(out.loss.detach()) == float(want_loss.detach())
    assert all(g is None and w is None or torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_base_model_adding_positions_is_declined_with_a_note():
    """Issue 33: GIT's base model prepends the image's tokens; the chunked head raised "labels must have
    hidden's shape". Declined at the first batch, and the step is the model's own."""
    model, (ids, labels) = git(), _batch(t=10)
    pixels = torch.randn(3, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    reason = (
        "its base model's output has 15 positions where the labels have 10 (the model adds positions of its "
        "own, such as image tokens)"
    )
    _declined_like_own(model, dict(input_ids=ids, labels=labels, pixel_values=pixels), reason)
    with pytest.raises(RuntimeError, match=r"head='chunked': its base model's output has 15 positions"):
        take_over_heads(model, "chunked", note=pytest.fail)
        model(input_ids=ids, labels=labels, pixel_values=pixels)


def test_a_model_failing_on_one_sample_is_declined_with_a_note():
    model, (ids, labels) = SingleSampleFailsGPT2LMHeadModel(_gpt2().config).double().eval(), _batch()
    reason = (
        "the model's own forward fails on the first sample alone (ValueError: batch statistics need at least "
        "2 samples)"
    )
    _declined_like_own(model, dict(input_ids=ids, labels=labels), reason)


def test_a_failing_chunked_loss_is_declined_with_a_note(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("unsupported here")

    monkeypatch.setattr("lightning_memopt.head.causal_lm.linear_cross_entropy", broken)
    model, (ids, labels) = _gpt2(), _batch()
    reason = "the chunked loss fails on the first batch (RuntimeError: unsupported here)"
    _declined_like_own(model, dict(input_ids=ids, labels=labels), reason)
