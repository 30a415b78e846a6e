"""take_over_heads / ChunkedHead on a tiny Hugging Face GPT-2, without Lightning: which calls it takes, what
it returns, the first batch's check, and that its undo leaves the model as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_memopt.head.causal_lm import ChunkedHead, causal_lms, decline_reason, take_over_heads

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
