"""``auto_checkpoint`` outside Lightning: a plain torch training loop on a tiny GPT-2, under a limit."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt.checkpointing import (
    AutoCheckpointer,
    CostModel,
    NoPlanFitsError,
    auto_checkpoint,
    checkpointed_blocks,
)
from lightning_memopt.memory import MemoryTracker

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, STEPS = 99, 32, 8, 3
FLOPS = CostModel(use_time=False)  # plans priced in FLOPs: the same plan on every machine


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_layer=4, n_embd=32, n_head=2, n_positions=SEQ, use_cache=False
    )
    return transformers.GPT2LMHeadModel(config).double()  # dropout 0.1 kept: masks must match too


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits  # (B, T, V), float64 (the model's own loss would upcast to float32)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def train(model: nn.Module) -> tuple[list[int], list[torch.Tensor]]:
    """A plain loop: SGD, STEPS steps; each step's peak live bytes (MemoryTracker) and the final parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(2)
    peaks = []
    for ids in batches():
        with MemoryTracker(model, optimizer) as tracker:
            loss_of(model, ids).backward()
            optimizer.step()
            optimizer.zero_grad()
        peaks.append(tracker.peak)
    return peaks, [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def plain() -> tuple[list[int], list[torch.Tensor]]:
    return train(gpt2())


@pytest.mark.parametrize("fraction", [0.8, 0.6])
def test_plain_loop_fits_the_limit_and_learns_the_same(plain, fraction):
    plain_peaks, plain_params = plain
    limit = int(plain_peaks[0] * fraction)
    model = gpt2()
    handle = auto_checkpoint(
        model, lambda: loss_of(model, batches()[0]), max_memory=limit, headroom=0.0, cost_model=FLOPS
    )
    assert set(handle.plan.choices) == {f"transformer.h.{i}" for i in range(4)}
    assert set(handle.plan.choices.values()) != {"keep"}
    assert checkpointed_blocks(model) == handle.plan.choices
    peaks, params = train(model)
    assert max(peaks) <= limit < plain_peaks[0]
    assert all(torch.equal(a, b) for a, b in zip(plain_params, params))  # float64, bit for bit


def test_remove_gives_the_model_back(plain):
    model = gpt2()
    keys, forwards = (
        list(model.state_dict()),
        {n: m.__dict__.get("forward") for n, m in model.named_modules()},
    )
    ids = batches()[0]
    handle = auto_checkpoint(model, ids, mode="full")
    assert list(model.state_dict()) == keys
    assert checkpointed_blocks(model) == dict.fromkeys((f"transformer.h.{i}" for i in range(4)), "full")
    handle.remove()
    handle.remove()  # safe twice
    assert checkpointed_blocks(model) == {} and not handle.active
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == forwards
    torch.save(model, io.BytesIO())  # no local function left on it
    _, params = train(model)
    assert all(torch.equal(a, b) for a, b in zip(plain[1], params))


def test_every_form_of_example_batch_measures_the_same_forward():
    model = gpt2()
    ids = batches()[0]

    class Kwargs(nn.Module):  # a model called with keywords, for the dict form
        def __init__(self) -> None:
            super().__init__()
            self.gpt = model

        def forward(self, input_ids):
            return self.gpt(input_ids=input_ids)

    forms = {
        "tensor": (model, ids),
        "tuple": (model, (ids,)),
        "list": (model, [ids]),
        "dict": (Kwargs(), {"input_ids": ids}),
        "callable": (model, lambda: model(ids)),
    }
    baselines = {}
    for name, (module, example) in forms.items():
        handle = auto_checkpoint(module, example, cost_model=FLOPS)
        baselines[name] = handle.plan.baseline_bytes
        handle.remove()
    assert len(set(baselines.values())) == 1 and baselines["tensor"] > 0, baselines


def test_the_measured_forward_leaves_no_trace():
    model = gpt2()
    grads_before = [p.grad for p in model.parameters()]
    rng = torch.get_rng_state()
    buffers = [b.clone() for b in model.buffers()]
    handle = auto_checkpoint(model, batches()[0], max_memory="1GiB")
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew masks, and the generator was put back
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))
    assert [p.grad for p in model.parameters()] == grads_before
    assert "max_memory='1GiB'" in repr(handle) and "transformer.h.0" in repr(handle)
    handle.remove()


def test_no_blocks_warns_and_changes_nothing():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.warns(UserWarning, match="auto_checkpoint found no repeated blocks in Sequential"):
        handle = auto_checkpoint(model, torch.randn(2, 4))
    assert not handle.active and handle.plan is None and checkpointed_blocks(model) == {}
    assert repr(handle) == "AutoCheckpointer(mode='auto', not installed)"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_memory": "6 parsecs"}, ValueError, "max_memory"),
        ({"max_memory": 0.5}, ValueError, r"max_memory=0.5 is a fraction of the device's capacity"),
        ({"max_memory": -1}, ValueError, "max_memory"),
        ({"mode": "fast"}, ValueError, r"mode must be one of .* got 'fast'"),
        ({"mode": "full", "max_memory": "1GiB"}, ValueError, r"only used by mode='auto', got mode='full'"),
        ({"headroom": 1.5}, ValueError, r"headroom must be a number in \[0, 1\)"),
        ({"blocks": 3}, ValueError, "blocks must be module classes"),
        ({"blocks": ["nothing.*"]}, ValueError, r"candidate block classes found: \['GPT2Block'\]"),
        ({"allow_offload": "yes"}, TypeError, "allow_offload"),
        ({"cost_model": "flops"}, ValueError, "cost_model must be a CostModel"),
    ],
)
def test_bad_options_raise_before_anything_runs(kwargs, error, match):
    model = gpt2()
    with pytest.raises(error, match=match):
        auto_checkpoint(model, batches()[0], **kwargs)
    assert checkpointed_blocks(model) == {}


@pytest.mark.parametrize(
    ("model", "example", "match"),
    [
        ("not a model", torch.zeros(1), "model must be a torch.nn.Module, got str"),
        (nn.Linear(2, 2), 3, "example_batch must be a tensor, a tuple or list .* got int"),
        (nn.Linear(2, 2), nn.Linear(2, 2), "example_batch must be .* got Linear"),
    ],
)
def test_bad_model_or_example_raises_type_error(model, example, match):
    with pytest.raises(TypeError, match=match):
        auto_checkpoint(model, example)


def test_a_callable_that_runs_backward_is_refused_and_the_model_left_alone():
    model = gpt2()
    ids = batches()[0]
    with pytest.raises(ValueError, match=r"example_batch ran backward .* return the loss only"):
        auto_checkpoint(model, lambda: loss_of(model, ids).backward())
    assert checkpointed_blocks(model) == {}


def test_a_limit_too_small_names_what_the_step_needs_and_leaves_the_model_alone():
    model = gpt2()
    with pytest.raises(NoPlanFitsError, match=r"max_memory='100KiB' .* Pass max_memory >="):
        auto_checkpoint(model, batches()[0], max_memory="100KiB")
    assert checkpointed_blocks(model) == {}


def test_the_model_checkpointing_itself_is_left_alone():
    model = gpt2()
    model.gradient_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' own deprecation of the flag's name
        with pytest.warns(
            UserWarning, match="already checkpoints activations and auto_checkpoint does nothing"
        ):
            handle = auto_checkpoint(model, batches()[0])
    assert isinstance(handle, AutoCheckpointer) and not handle.active


def test_docstring_examples_run():
    import doctest

    import lightning_memopt.checkpointing.auto as auto

    assert doctest.testmod(auto, raise_on_error=True).attempted == 15


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class _CallsForward(nn.Module):
    """Calls its layers as ``layer.forward(x)``: no block can be recomputed (its hooks never run)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x.sum()


def test_a_forced_mode_that_no_block_takes_raises_with_each_blocks_reason():
    model = _CallsForward()
    with pytest.raises(
        ValueError, match=r"mode='full'\) applies to no block of _CallsForward .*called as \.forward\(\)"
    ):
        auto_checkpoint(model, torch.randn(2, 8), mode="full")
    assert checkpointed_blocks(model) == {}  # left as it was


def test_a_plan_that_treats_no_block_says_why_in_one_line():
    model = _CallsForward()
    with pytest.warns(
        UserWarning, match=r"^auto_checkpoint checkpoints no block of _CallsForward: layers\.0, layers\.1"
    ) as seen:
        auto_checkpoint(model, torch.randn(2, 8))
    assert sum("checkpoints no block" in str(w.message) for w in seen) == 1
    # Under a limit the step fits with every block kept: that is said too (no recompute is the fastest plan).
    model = nn.Sequential(*[_Layer() for _ in range(3)])
    with pytest.warns(
        UserWarning, match=r"checkpoints no block of Sequential: the step fits max_memory='1GiB'"
    ):
        handle = auto_checkpoint(model, torch.randn(2, 8), max_memory="1GiB", cost_model=FLOPS)
    assert set(handle.plan.choices.values()) == {"keep"}
