"""The pointwise treatment (checkpointing/pointwise.py): which sub-modules it recomputes, the bytes it
holds (exact, MemoryTracker), and gradients equal to the plain run's, on the tests' blocks and on
third-party models (tests/zoo)."""

import copy
import functools
import inspect

import pytest
import torch
from torch import nn

from lightning_memopt.checkpointing import (
    ActivationMeter,
    apply_checkpointing,
    find_blocks,
    profile_blocks,
    remove_checkpointing,
)
from lightning_memopt.checkpointing.apply import is_compute_op
from lightning_memopt.checkpointing.dry_run import dry_run
from lightning_memopt.checkpointing.pointwise import Pointwise, pointwise_modules
from lightning_memopt.checkpointing.written import treatment_state
from tests.checkpointing.helpers import LiveTensors, live_tensors
from tests.checkpointing.models import TinyGPT


def _found(block: nn.Module, *args) -> tuple:
    fn = lambda *a: type(block).forward(block, *a)  # noqa: E731
    return pointwise_modules(block, functools.partial(dry_run, block, fn, args, {}), is_compute=is_compute_op)


def _no_cache(model) -> dict:
    """``use_cache=False`` where the model takes it: the plain run on the inputs a treated block gets."""
    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}


def _grads(model, *args, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(*args, **kwargs)
    (out.loss if hasattr(out, "loss") else out.square().mean()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _Mixed(nn.Module):
    """Sub-modules the treatment must and must not take: see the test below."""

    def __init__(self, h: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(h)  # output saved by fc: taken
        self.fc = nn.Linear(h, 4 * h)  # a matmul: never
        self.act = nn.Sequential(nn.GELU())  # pointwise wrapper: the outermost is taken, not the GELU
        self.mid = nn.Linear(4 * h, 4 * h)
        self.drop = nn.Dropout(0.1)  # random: never
        self.relu = nn.ReLU(inplace=True)  # writes its input in place: never
        self.bn = nn.BatchNorm1d(4 * h)  # updates running statistics in training: never
        self.soft = nn.Softmax(dim=-1)  # saves its own output: nothing to drop
        self.same = nn.Identity()  # returns its input: nothing of its own
        self.proj = nn.Linear(4 * h, h)
        self.ln_out = nn.LayerNorm(h)  # output only added to the input (not saved): nothing to drop

    def forward(self, x):  # (B, h)
        y = self.drop(self.mid(self.act(self.fc(self.ln(x)))))
        y = self.relu(self.bn(y))
        y = self.soft(self.same(y)) * y
        return x + self.ln_out(self.proj(y))


def test_pointwise_takes_the_outermost_deterministic_pointwise_modules_whose_output_is_saved():
    torch.manual_seed(0)
    found = _found(_Mixed(), torch.randn(4, 8, requires_grad=True))
    # Width 8: the LayerNorm's own mean and rstd are a quarter of its output's bytes, so it runs again with
    # grad (they go too); the GELU saves only its input, so only its output goes.
    assert found == Pointwise(("ln", "act"), rerun=("ln",))


def test_pointwise_takes_nothing_where_the_dry_run_cannot_run():
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(self.ln(x)) * (x.nonzero().shape[0] > 0)  # fake tensors cannot size nonzero

    block, x = DataDependent(), torch.randn(4, 8, requires_grad=True)
    assert _found(block, x) == Pointwise() and not _found(block, x)
    ref = _grads(block, x)
    apply_checkpointing(block, {"": "pointwise"})
    got = _grads(block, x)
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_pointwise_holds_exact_bytes_and_gradients_equal_on_the_tests_gpt():
    torch.manual_seed(0)
    B, T, h = 2, 8, 16
    model = TinyGPT(3, h=h)
    idx = torch.randint(0, 32, (B, T))
    blocks = find_blocks(model)
    ref = _grads(model, idx)
    profiles = profile_blocks(model, blocks, idx)
    keep, pointwise = profiles[1].options["keep"], profiles[1].options["pointwise"]
    # The block's two LayerNorms: their outputs (B,T,h fp32, saved by the next linear layer) go; their
    # inputs, mean and rstd (B,T fp32 each, an eighth of the output at h=16) stay with their own backward.
    # And the functional GELU's output (B,T,4h, saved by fc_proj): recomputed from its input.
    assert keep.internal_bytes - pointwise.internal_bytes == 2 * B * T * h * 4 + B * T * 4 * h * 4
    assert pointwise.recompute_flops == 0 < pointwise.recompute_bytes
    # Predicted = measured bytes for plans with pointwise blocks: test_checkpointing.py's profile test.
    apply_checkpointing(model, dict.fromkeys((n for n, _ in blocks), "pointwise"))
    got = _grads(model, idx)
    assert treatment_state(model.h[0]).pointwise.popitem()[1] == Pointwise(("ln_1", "ln_2"))
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_pointwise_holds_what_selective_holds_on_vit_and_its_peak():
    zoo = pytest.importorskip("tests.zoo.models")
    torch.manual_seed(0)
    model = zoo.no_dropout(zoo.ZOO["vit"].build())
    batch = zoo.ZOO["vit"].batch(4, 0)
    blocks = find_blocks(model)
    held, peaks = {}, {}
    for choice in ("keep", "selective", "pointwise"):
        apply_checkpointing(model, dict.fromkeys((n for n, _ in blocks), choice))
        model.zero_grad(set_to_none=True)
        with ActivationMeter(model, blocks) as meter:
            start = meter.tracker.current
            meter.tracker.reset_peak()
            model(**batch).loss.backward()
            peaks[choice] = meter.tracker.peak - start
        held[choice] = meter.total
    # Every tensor op-level selection drops in a ViT layer is the output or an intermediate of a norm or
    # the GELU. Recomputed as modules, the same bytes go but the norms' mean and rstd, which stay with
    # their own backward (width 32: a sixteenth of the output): 3 layers x 2 norms x 2 x (4 images x 17
    # tokens) fp32.
    assert held["pointwise"] == held["selective"] + 3 * 2 * 2 * (4 * 17) * 4 < held["keep"]
    assert held == {"keep": 367392, "selective": 259680, "pointwise": 262944}
    # The step's peak is below selective's: each output is made again only when its reader's backward
    # needs it, not the whole layer's at once, and a recipe (with the inputs it recomputes from) goes with
    # its last reader's backward, not with the whole block's graph (328,124 while the block's hooks
    # still reached every recipe).
    assert peaks == {"keep": 402780, "selective": 330972, "pointwise": 315740}
    names = treatment_state(model.vit.layers[0]).pointwise.popitem()[1].names
    assert names == ("layernorm_before", "layernorm_after", "mlp.activation_fn")


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit", "convnext", "t5", "swin", "mixtral"])
def test_pointwise_gradients_equal_the_plain_run_on_the_zoo(name):
    zoo = pytest.importorskip("tests.zoo.models")
    torch.manual_seed(0)
    model = zoo.no_dropout(zoo.ZOO[name].build(torch.float64))
    batch = {k: v.double() if v.is_floating_point() else v for k, v in zoo.ZOO[name].batch(4, 0).items()}
    plain = _grads(model, **batch)
    # A treated block runs without the key/value cache (checkpointing/apply.py drops it). T5's decoder
    # computes its cross-attention another way without one: its logits differ by an ulp from the cached
    # run's, in the forward, whatever the treatment (full too). Bit for bit therefore against the plain run
    # on the blocks' own inputs, and against the default (cached) run at float64 rounding.
    ref = _grads(model, **batch, **_no_cache(model))
    keys = list(model.state_dict())
    apply_checkpointing(model, {n: "pointwise" for n, _ in find_blocks(model)})
    got = _grads(model, **batch)
    assert list(model.state_dict()) == keys and got.keys() == ref.keys()
    for n in ref:  # bit for bit: the modules' own autograd nodes do their backward, in the plain order
        assert torch.equal(got[n], ref[n]), n
        # T5 (transformers 5.17 to 5.24): up to 4.3 eps of the largest gradient, every parameter
        eps = torch.finfo(plain[n].dtype).eps
        torch.testing.assert_close(
            got[n], plain[n], rtol=0, atol=64 * eps * plain[n].abs().max().item(), msg=n
        )
    live = live_tensors()  # a step's gradients replace the last's: the count stays
    _grads(model, **batch)
    assert live_tensors() == live  # nothing a step made again stays behind (GPT-2's GELU, Llama's norms)
    found = [
        names
        for m in model.modules()
        if treatment_state(m) is not None
        for names in treatment_state(m).pointwise.values()
    ]
    # Every model has norms or activations the treatment recomputes, but Mixtral: its experts' routing
    # (nonzero) does not run on fake tensors, so the dry run finds nothing and the treatment equals keep.
    assert any(found) != (name == "mixtral")


def test_pointwise_under_autocast_eval_no_grad_and_a_retained_graph():
    torch.manual_seed(0)
    model, idx = TinyGPT(2), torch.randint(0, 32, (2, 8))
    plain = copy.deepcopy(model)
    apply_checkpointing(model, {"h.0": "pointwise", "h.1": "pointwise"})
    with torch.autocast("cpu", dtype=torch.bfloat16):  # recomputed under the forward's autocast
        ref, got = _grads(plain, idx), _grads(model, idx)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    with torch.no_grad():  # nothing to recompute: the plain forward
        out = model(idx)
    model.eval()
    assert torch.equal(out, model(idx)) and torch.equal(out, plain.eval()(idx))
    model.train()
    loss = model(idx).square().mean()
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(model.parameters()))  # the modules run again from their inputs
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    remove_checkpointing(model)


@pytest.mark.parametrize(
    "width, act, label",
    [(8, None, "LayerNorm"), (64, None, "LayerNorm"), (8, torch.nn.functional.gelu, "gelu")],
    ids=["run-again-with-grad", "output-only", "functional"],
)
def test_pointwise_refuses_an_input_changed_in_place_after_the_forward(width, act, label):
    class Mutating(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

        def forward(self, x):
            h = x * 2
            y = self.fc(self.ln(h) if act is None else act(h))
            h.add_(1)  # under keep, the norm's (gelu's) saved input fails autograd's version check
            return y

    block = Mutating()
    apply_checkpointing(block, {"": "pointwise"})
    out = block(torch.randn(4, width, requires_grad=True))
    with pytest.raises(RuntimeError, match=f"an input of {label} was modified in place after its forward"):
        out.sum().backward()


class _SwiGLU(nn.Module):
    """torchtitan's feed-forward: ``w2(silu(w1(x)) * w3(x))``, the activation called as a function."""

    def __init__(self, h: int = 16, hidden: int = 48) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.w1, self.w2, self.w3 = nn.Linear(h, hidden), nn.Linear(hidden, h), nn.Linear(h, hidden)

    def forward(self, x):
        y = self.norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(y)) * self.w3(y))


def _held(block, x) -> int:
    with ActivationMeter(block, [("", block)]) as meter:
        block(x).sum()
    return meter.total


def test_pointwise_recomputes_functional_activations_from_the_input_their_backward_keeps():
    torch.manual_seed(0)
    B, T, h, hidden = 2, 8, 16, 48
    block, x = _SwiGLU(h, hidden).double(), torch.randn(B, T, h, dtype=torch.float64, requires_grad=True)
    plain = copy.deepcopy(block)
    apply_checkpointing(block, {"": "pointwise"})
    # The LayerNorm's output (B,T,h float64, saved by w1 and w3: once) and silu's output (B,T,hidden,
    # saved by the product) go; silu's input stays, its own backward saves it.
    assert _held(plain, x) - _held(block, x) == B * T * h * 8 + B * T * hidden * 8
    loss, ref_loss = block(x).square().sum(), plain(x).square().sum()
    got = torch.autograd.grad(loss, [x, *block.parameters()], create_graph=True)
    ref = torch.autograd.grad(ref_loss, [x, *plain.parameters()], create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # Second order (a gradient penalty): recomputed with grad under create_graph, differentiated through.
    second = torch.autograd.grad(got[0].square().sum(), list(block.parameters()))
    ref_second = torch.autograd.grad(ref[0].square().sum(), list(plain.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(second, ref_second))


class _RMSNorm(nn.Module):
    """Llama's norm as transformers writes it: its normalized input, saved by the product with the
    weight, is as large as its output."""

    def __init__(self, h: int = 32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_pointwise_second_order_gradients_flow_through_a_module_run_again():
    # The rerun's nodes keep detached aliases of what its ops save (holding the tensors themselves would
    # tie the nodes in a cycle no collector frees): a gradient penalty still differentiates through them.
    class Block(nn.Module):
        def __init__(self, h: int = 16) -> None:
            super().__init__()
            self.fc, self.norm, self.out = nn.Linear(h, h), _RMSNorm(h), nn.Linear(h, h)

        def forward(self, x):
            return x + self.out(self.norm(torch.tanh(self.fc(x))))

    torch.manual_seed(0)
    block, x = Block().double(), torch.randn(4, 8, 16, dtype=torch.float64, requires_grad=True)
    plain = copy.deepcopy(block)
    assert _found(block, x) == Pointwise(("norm",), rerun=("norm",))
    apply_checkpointing(block, {"": "pointwise"})
    got = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()], create_graph=True)
    ref = torch.autograd.grad(plain(x).square().sum(), [x, *plain.parameters()], create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    second = torch.autograd.grad(got[0].square().sum(), list(block.parameters()))
    ref_second = torch.autograd.grad(ref[0].square().sum(), list(plain.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(second, ref_second))


def test_pointwise_keeps_an_output_changed_in_place_after_its_module():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act, self.out = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)
            self.norm = _RMSNorm()

        def forward(self, x):
            y = self.act(self.fc(x))
            y.mul_(2)  # what `out` saves is no longer what `act` made: it cannot be made again from its input
            n = self.norm(y)
            n.add_(1)  # the same for a module run again with grad (its own intermediates are large)
            z = torch.nn.functional.gelu(self.fc(x))
            with torch.no_grad():
                z.add_(1)  # nor can this one, changed without a trace in the graph
            return self.out(y) + self.out(z) + self.out(n)

    torch.manual_seed(0)
    block, x = Scaled().double(), torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    ref = _grads(copy.deepcopy(block), x)
    assert _found(block, x) == Pointwise(("act", "norm"), rerun=("norm",))
    apply_checkpointing(block, {"": "pointwise"})
    got = _grads(block, x)
    assert got.keys() == ref.keys()
    for n in ref:  # float64: equal but for the order autograd sums fc's two gradients in (2e-16)
        torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-15)


class _CastingRMSNorm(nn.Module):
    """Llama's RMSNorm as transformers writes it for bf16 weights: normalized in float32, then cast back."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


def test_pointwise_takes_a_norm_whose_input_only_it_would_hold_where_that_costs_less_than_what_goes():
    class Block(nn.Module):
        def __init__(self, h: int = 32) -> None:
            super().__init__()
            self.fc, self.norm, self.out = nn.Linear(h, h), _CastingRMSNorm(h), nn.Linear(h, h)

        def forward(self, x):
            return x + self.out(self.norm(self.fc(x)))

    torch.manual_seed(0)
    B, T, h = 4, 8, 32
    block = Block(h).to(torch.bfloat16)
    x = torch.randn(B, T, h, dtype=torch.bfloat16, requires_grad=True)
    plain = copy.deepcopy(block)
    # Nothing else holds fc's bf16 output (the norm saves only its float32 copy), so keeping it costs
    # B*T*h*2 bytes; what goes: the float32 copy (saved by pow and the product), the bf16 normalized
    # tensor (saved by the product with the weight), the output (saved by `out`), and rsqrt's B*T float32.
    assert _found(block, x) == Pointwise(("norm",), rerun=("norm",))
    apply_checkpointing(block, {"": "pointwise"})
    assert _held(plain, x) - _held(block, x) == B * T * h * (4 + 2 + 2) + B * T * 4 - B * T * h * 2
    ref, got = _grads(plain, x), _grads(block, x)
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_pointwise_prefers_the_parts_of_a_module_whose_input_only_it_would_hold():
    class AddNorm(nn.Module):  # FNet's output block: LayerNorm(input + sublayer output)
        def __init__(self, h: int) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(h)

        def forward(self, x, h):
            return self.ln(x + h)

    class Block(nn.Module):
        def __init__(self, h: int = 32) -> None:
            super().__init__()
            self.fc, self.add_norm, self.out = nn.Linear(h, h), AddNorm(h), nn.Linear(h, h)

        def forward(self, x):
            return self.out(self.add_norm(x, self.fc(x)))

    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8, 32, requires_grad=True)
    # add_norm would qualify too (its output and the sum its LayerNorm saves go, fc's output stays), but
    # its LayerNorm recomputes from the sum autograd holds anyway: the part is taken, keeping nothing new.
    assert _found(block, x) == Pointwise(("add_norm.ln",))
    ref = _grads(block, x)
    apply_checkpointing(block, {"": "pointwise"})
    assert all(torch.equal(g, ref[n]) for n, g in _grads(block, x).items())


def test_pointwise_fails_backward_where_keep_does_on_a_saved_tensor_changed_in_place():
    class Changing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(64), nn.Linear(64, 64)

        def forward(self, x):
            y = self.fc(self.ln(x)).sigmoid()  # sigmoid saves its output
            out = y * 2
            with torch.no_grad():
                y.add_(1)  # under keep, sigmoid's saved output fails autograd's version check
            return out

    block, x = Changing(), torch.randn(4, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        block(x).sum().backward()
    apply_checkpointing(block, {"": "pointwise"})
    assert _found(block, x) == Pointwise(("ln",))
    with pytest.raises(RuntimeError, match="modified by an inplace operation: .* expected version 0"):
        block(x).sum().backward()


def test_pointwise_fails_backward_where_keep_does_on_a_weight_changed_in_place():
    """A leaf an op saved as it is (``h @ w`` saves ``w`` itself; held as it is, not detached) changed
    between forward and backward fails backward under pointwise as under keep."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.w = nn.LayerNorm(16), nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            return self.ln(x) @ self.w

    block, x = Block(), torch.randn(4, 16, requires_grad=True)
    assert _found(block, x) == Pointwise(("ln",))
    for choice in ("keep", "pointwise"):
        apply_checkpointing(block, {"": choice})
        loss = block(x).sum()
        with torch.no_grad():
            block.w.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("name", [None, "gpt2"], ids=["tests-gpt", "hf-gpt2-conv1d"])
def test_pointwise_drops_the_copies_autocast_makes_of_an_output(name):
    # Under bf16 autocast a LayerNorm runs in float32 and the next linear layer saves autocast's bf16
    # copy of its output, not the output: the copy goes too, made again in backward by running the norm
    # and the same cast (HF GPT-2's Conv1D casts a reshaping view of the output: also taken).
    torch.manual_seed(0)
    if name is None:
        B, T, h = 2, 8, 16
        model, args, kwargs = TinyGPT(2, h=h), (torch.randint(0, 32, (B, T)),), {}
    else:
        zoo = pytest.importorskip("tests.zoo.models")
        model, args, kwargs = zoo.no_dropout(zoo.ZOO[name].build()), (), zoo.ZOO[name].batch(4, 0)
    plain = copy.deepcopy(model)
    blocks = find_blocks(model)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    profiles = profile_blocks(model, blocks, *args, context=autocast, choices=["keep", "pointwise"], **kwargs)
    layer = profiles[-1]
    dropped = layer.options["keep"].internal_bytes - layer.options["pointwise"].internal_bytes
    if name is None:  # two bf16 copies of (B,T,h) and the bf16 GELU output (B,T,4h)
        assert dropped == 2 * B * T * h * 2 + B * T * 4 * h * 2
    apply_checkpointing(model, dict.fromkeys((n for n, _ in blocks), "pointwise"))
    with autocast():  # the plain run without a key/value cache, as the treated blocks run (see the zoo test)
        ref, got = _grads(plain, *args, **kwargs, **_no_cache(plain)), _grads(model, *args, **kwargs)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    found = next(iter(treatment_state(model.get_submodule(blocks[-1][0])).pointwise.values()))
    assert {"ln_1", "ln_2"} <= set(found.names)
    if name == "gpt2":  # batch 4 x 16 tokens, width 32, bf16: the tanh GELU's four (64, 128) tensors and
        # the two norms' copies of (64, 32), which Conv1D casts as a view (64 x 32): 65536 + 8192 bytes
        assert dropped == 4 * 64 * 128 * 2 + 2 * 64 * 32 * 2 and "mlp.act" in found.names


@pytest.mark.parametrize("name", ["gemma2", "t5_qa", "llama"])
def test_pointwise_under_bf16_autocast_is_bit_equal_where_norms_run_again(name, monkeypatch):
    # Their RMSNorms run again with grad. Run as an autograd Function of their own, a norm handed back its
    # input's gradient summed over its own uses before autograd added the residual stream's: the same
    # terms in another order, which a bf16 cast after the sum turned into 2.8e-3 (Gemma2) and 2.5e-4
    # (T5-QA) of the largest gradient. The forward's own nodes now do the backward: bit for bit.
    pytest.importorskip("transformers")
    zoo = pytest.importorskip("benchmarks.pointwise_zoo")
    monkeypatch.setattr(zoo, "MIXED", True)
    arch = next(a for a in zoo.ARCHS if a.name == name)
    outcome, dropped, detail = zoo.sweep_one(arch)
    assert (outcome, detail.split(";")[0]) == ("exact", "0.0e+00") and "(rerun)" in detail
    assert int(dropped.rstrip("%")) > 0


def test_pointwise_forward_that_raises_leaves_nothing_behind():
    # An attempt that runs out of memory half-way (which OOMBackoff retries) never runs backward: what
    # the treatment holds of it must go with its tensors, or every retry leaves its graph behind.
    class SiLU(nn.Module):  # hand-written: its sigmoid's output is as large as its own, so it runs again
        def forward(self, x):
            return x * torch.sigmoid(x)

    class Block(nn.Module):
        def __init__(self, h: int = 16) -> None:
            super().__init__()
            self.fc, self.act, self.out = nn.Linear(h, 4 * h), SiLU(), nn.Linear(4 * h, h)
            self.fails = False

        def forward(self, x):
            y = self.out(self.act(self.fc(x)))
            if self.fails:
                raise torch.OutOfMemoryError("injected after the module ran")
            return x + y

    model, x = nn.Sequential(Block(), Block()), torch.randn(2, 8, 16, requires_grad=True)
    assert _found(model[0], x) == Pointwise(("act",), rerun=("act",))
    apply_checkpointing(model, {"0": "pointwise", "1": "pointwise"})
    model(x).sum().backward()
    model[1].fails = True
    live_tensors, counts = LiveTensors(), []
    for _ in range(3):
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            model(x)
        counts.append(live_tensors())
    assert counts == [counts[0]] * 3


def test_pointwise_finds_its_modules_once_per_input_signature(monkeypatch):
    """The dry run runs again exactly where the forward's inputs differ in what the op sequence may depend
    on: a shape, a dtype, grad, a non-tensor argument (True is not 1), a tensor inside a namedtuple."""
    from collections import namedtuple

    from lightning_memopt.checkpointing import apply as apply_module

    Pair = namedtuple("Pair", "x scale")
    runs = []

    def counted(*args, **kwargs):
        runs.append(1)
        return pointwise_modules(*args, **kwargs)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x, flag=False, pair=None):
            return self.fc(self.ln(x)) + (0 if pair is None else pair.x.sum())

    monkeypatch.setattr(apply_module, "pointwise_modules", counted)
    block = Block()
    apply_checkpointing(nn.Sequential(block), {"0": "pointwise"})
    x = torch.randn(2, 8, requires_grad=True)
    calls = [
        ((x,), {}),
        ((x,), {}),  # the same: no new run
        ((torch.randn(3, 8, requires_grad=True),), {}),  # a shape
        ((x.double(),), {}),  # a dtype
        ((x.detach(),), {}),  # grad
        ((x,), {"flag": True}),
        ((x,), {"flag": 1}),
        ((x,), {"pair": Pair(torch.ones(2), 1.0)}),
        ((x,), {"pair": Pair(torch.ones(2), 1.0)}),  # the same: no new run
        ((x,), {"pair": Pair(torch.ones(3), 1.0)}),
    ]
    counts = []
    for args, kwargs in calls:
        if args[0].dtype == torch.double:
            block.double()
        block(*args, **kwargs).sum().backward()
        block.float()
        counts.append(len(runs))
    assert counts == [1, 1, 2, 3, 4, 5, 6, 7, 7, 8]
