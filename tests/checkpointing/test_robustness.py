"""Blocks that cannot be recomputed, blocks the forward does not run, hybrid stacks (issue 21), in plain torch."""

import random

import pytest
import torch
from torch import nn

from lightning_memopt.checkpointing import (
    apply_checkpointing,
    blocks_run,
    capture_block_inputs,
    checkpointed_blocks,
    evaluate_plan,
    find_blocks,
    plan_checkpointing,
    profile_blocks,
    profile_blocks_run,
    remove_checkpointing,
)
from lightning_memopt.checkpointing.written import Snapshot


class _Layer(nn.Module):
    def __init__(self, h: int = 8) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class _Other(_Layer):
    """Another class with the same shape mapping: a hybrid stack's second kind of layer."""

    def forward(self, x):
        return x + self.fc2(torch.sigmoid(self.fc1(x)))


class _Recurrent(_Layer):
    """Keeps its last output as state (a recurrent cache) and reads it on the next call."""

    def __init__(self, h: int = 8) -> None:
        super().__init__(h)
        self.state = None

    def forward(self, x):
        out = super().forward(x) if self.state is None else super().forward(x) + self.state.mean()
        self.state = out.detach()
        return out


class _AttachedState(_Recurrent):
    """Keeps its last output with its graph (as RecurrentGemma's recurrent states in training)."""

    def forward(self, x):
        out = super().forward(x)
        self.state = out + 0  # (B, h), part of this step's graph
        return out


class _Observer(_Layer):
    """Updates a range buffer in place in every forward and scales by it (a quantization observer)."""

    def __init__(self, h: int = 8) -> None:
        super().__init__(h)
        self.register_buffer("x_max", torch.ones(()))

    def forward(self, x):
        self.x_max.copy_(torch.maximum(self.x_max, x.detach().abs().max()))
        return super().forward(x / self.x_max)


class _PyRandom(_Layer):
    def forward(self, x):
        return super().forward(x) * random.random()


class _Net(nn.Module):
    def __init__(self, *layers: nn.Module, calls: str = "call") -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(8, 3)
        self.calls = calls

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x) if self.calls == "forward" else layer(x)
        return self.head(x)


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_snapshot_names_rebound_attributes_in_place_writes_and_python_random_and_restores_them():
    layer = _Observer()
    snap = Snapshot(layer, values=True)
    layer(torch.full((2, 8), 4.0))
    random.random()
    layer.cache = torch.zeros(1)
    assert snap.written() == ["cache", "random (Python's or NumPy's generator)", "x_max"]
    snap.restore()
    assert layer.x_max.item() == 1.0 and not hasattr(layer, "cache") and Snapshot(layer).written() == []


def test_batchnorm_statistics_are_no_state_written():
    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    snap = Snapshot(block)
    block(torch.randn(3, 4))
    assert snap.written() == []


@pytest.mark.parametrize("layer", [_Recurrent, _Observer, _PyRandom])
@pytest.mark.parametrize("choice", ["full", "selective"])
def test_a_block_writing_state_trains_exactly_and_keeps_from_then_on(layer, choice):
    torch.manual_seed(0)
    plain = _Net(_Layer(), layer(), _Layer()).double()
    ours = _Net(_Layer(), layer(), _Layer()).double()
    ours.load_state_dict(plain.state_dict())
    apply_checkpointing(ours, {f"layers.{i}": choice for i in range(3)})
    x = torch.randn(4, 8, dtype=torch.float64)
    for _ in range(3):  # the first step (watched: recomputed from the state it started from), then kept
        random.seed(5)
        expected = _grads(plain, x)
        random.seed(5)
        got = _grads(ours, x)
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)
    state = ours.layers[1].__dict__["_memopt_checkpoint"]
    assert state.unrepeatable is not None and "writes state" in state.unrepeatable
    assert ours.layers[0].__dict__["_memopt_checkpoint"].verified
    remove_checkpointing(ours)


def test_recomputation_freezes_batchnorm_statistics_instead_of_copying_them(monkeypatch):
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()) for _ in range(2)])
    ours = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()) for _ in range(2)])
    ours.load_state_dict(plain.state_dict())
    apply_checkpointing(ours, {"0": "full", "1": "full"})
    seen = []
    forward = nn.BatchNorm1d.forward

    def spy(self, x):
        seen.append((self.momentum, self.num_batches_tracked is None))
        return forward(self, x)

    monkeypatch.setattr(nn.BatchNorm1d, "forward", spy)
    x = torch.randn(6, 8)
    _grads(plain, x)
    _grads(ours, x)
    # Forward: as set; recomputation: momentum 0 and no batch count (nothing copied); afterwards as before.
    assert seen[2:] == [(0.1, False), (0.1, False), (0.0, True), (0.0, True)]
    assert all(m.momentum == 0.1 for m in ours.modules() if isinstance(m, nn.BatchNorm1d))
    for (n, a), b in zip(plain.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), n  # running statistics and batch count: updated once, as without


def test_find_blocks_takes_hybrid_and_one_layer_stacks():
    assert [n for n, _ in find_blocks(_Net(_Layer(), _Other(), _Layer(), _Other()))] == [
        "layers.0",
        "layers.1",
        "layers.2",
        "layers.3",
    ]
    assert [n for n, _ in find_blocks(_Net(_Other()))] == ["layers.0"]


def test_blocks_run_keeps_what_the_forward_ran():
    class Shrink(_Layer):
        def forward(self, x):
            return self.fc1(x)[..., :4]

    model = _Net(_Layer(), _Other())
    model.unused = nn.ModuleList([_Layer(), _Other()])  # never called
    model.shrink = nn.ModuleList([Shrink()])  # called below, output shape differs from its input's
    blocks = find_blocks(model)
    assert [n for n, _ in blocks] == ["layers.0", "layers.1", "unused.0", "unused.1", "shrink.0"]
    x = torch.randn(2, 8)
    seen = _seen(model, blocks, x)
    kept, notes = blocks_run(model, blocks, seen)
    assert [n for n, _ in kept] == ["layers.0", "layers.1"] and notes == []
    # Given by the user: no shape rule.
    assert [n for n, _ in blocks_run(model, blocks, seen, discovered=False)[0]] == [
        "layers.0",
        "layers.1",
        "shrink.0",
    ]


def _seen(model, blocks, x):
    from lightning_memopt.checkpointing.capture import record_block_inputs

    with record_block_inputs(blocks) as seen:
        model(x)
        model.shrink[0](x)
    return seen


def test_blocks_called_as_forward_or_without_gradients_keep_with_one_note():
    model = _Net(_Layer(), _Layer(), calls="forward")
    blocks = find_blocks(model)
    apply_checkpointing(model, {n: "full" for n, _ in blocks})
    seen = capture_block_inputs(model, blocks, torch.randn(2, 8))
    kept, notes = blocks_run(model, blocks, seen)
    assert kept == [] and len(notes) == 1
    assert notes[0].startswith("layers.0, layers.1 (_Layer): called as .forward()")
    remove_checkpointing(model)
    model = _Net(_Layer(), _Layer())
    with torch.no_grad():
        seen = capture_block_inputs(model, find_blocks(model), torch.randn(2, 8))
    kept, notes = blocks_run(model, find_blocks(model), seen)
    assert kept == [] and "runs with gradients off" in notes[0]


def test_profiling_a_block_that_writes_state_gives_keep_alone_and_the_planner_keeps_it():
    torch.manual_seed(0)
    model = _Net(_Layer(), _AttachedState(), _Layer())
    blocks = find_blocks(model)
    x = torch.randn(4, 8)
    model(x).sum().backward()  # the layer now holds a state from a graph already backwarded: not again
    kept, profiles, notes = profile_blocks_run(model, blocks, capture_block_inputs(model, blocks, x))
    assert [p.note is not None for p in profiles] == [False, True, False]
    assert list(profiles[1].options) == ["keep"] and "writes state (state)" in profiles[1].note
    assert notes == [f"layers.1 (_AttachedState) keep their activations: {profiles[1].note}"]
    assert evaluate_plan(profiles, ["full"] * 3).choices == {
        "layers.0": "full",
        "layers.1": "keep",
        "layers.2": "full",
    }
    plan = plan_checkpointing(profiles, 10**9)
    assert plan.choices["layers.1"] == "keep"
    assert checkpointed_blocks(model) == {}


def test_profile_blocks_still_says_which_block_was_not_called():
    model = _Net(_Layer(), _Layer())
    model.unused = nn.ModuleList([_Layer()])
    with pytest.raises(ValueError, match="block 'unused.0' was not called"):
        profile_blocks(model, find_blocks(model), torch.randn(2, 8))


class _StateLayer(_Layer):
    """Takes its recurrent state in a tuple and returns its new one beside its output (xLSTM's blocks)."""

    def forward(self, x, state):
        out = super().forward(x + (state[0] if isinstance(state, tuple) else state))
        return out, out.mean(0)


class _StateNet(nn.Module):
    """Hands each block a state tensor and copies the block's new state into it once the block returned,
    in place (xLSTM's cache): a block's recorded input is written after it ran. ``write``: which blocks';
    ``nested``: the state in a tuple (xLSTM's), else a keyword argument."""

    def __init__(self, write=(0, 1), nested=True) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_StateLayer(), _StateLayer()])
        self.head, self.write, self.nested = nn.Linear(8, 3), write, nested

    def forward(self, x):
        states = [torch.zeros(8, dtype=x.dtype) for _ in self.layers]
        for i, layer in enumerate(self.layers):
            x, new = layer(x, (states[i],)) if self.nested else layer(x, state=states[i])
            if i in self.write:
                states[i].copy_(new)
        return self.head(x)


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("choice", ["full", "selective"])
def test_a_block_whose_input_the_model_writes_after_it_ran_trains_exactly_and_keeps_from_then_on(
    choice, nested
):
    torch.manual_seed(0)
    plain, ours = _StateNet(write=(1,), nested=nested).double(), _StateNet(write=(1,), nested=nested).double()
    ours.load_state_dict(plain.state_dict())
    apply_checkpointing(ours, {f"layers.{i}": choice for i in range(2)})
    x = torch.randn(4, 8, dtype=torch.float64)
    for _ in range(3):  # the first step recomputes from the recorded state, then the written block keeps
        expected, got = _grads(plain, x), _grads(ours, x)
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)
    written, untouched = (ours.layers[i].__dict__["_memopt_checkpoint"] for i in (1, 0))
    assert (
        written.unrepeatable
        == f"the model writes its inputs after it ran ({'args[1][0]' if nested else 'state'})"
    )
    assert not written.verified
    assert untouched.unrepeatable is None and untouched.verified  # its recomputation found its inputs alike
    remove_checkpointing(ours)


def test_without_the_record_that_recomputation_reads_the_written_state():
    # What the record prevents: a block whose watch ended before the model wrote its input recomputes
    # from the written state (here: other values, the same shapes: a silently wrong gradient). Torch checks
    # the version of a checkpoint's top-level tensor arguments only, not of a tuple's (xLSTM's).
    torch.manual_seed(0)
    plain, ours = _StateNet(write=(1,)).double(), _StateNet(write=(1,)).double()
    ours.load_state_dict(plain.state_dict())
    apply_checkpointing(ours, {"layers.1": "full"})
    ours.layers[1].__dict__["_memopt_checkpoint"].verified = True
    x = torch.randn(4, 8, dtype=torch.float64)
    expected, got = _grads(plain, x), _grads(ours, x)
    assert not torch.allclose(got["layers.1.fc1.weight"], expected["layers.1.fc1.weight"])


def test_an_input_that_needs_a_gradient_written_after_the_block_ran_raises_naming_it():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, extra):
            return torch.tanh(self.fc(x) + extra)

    model = nn.Sequential(Block())
    apply_checkpointing(model, {"0": "full"})
    x = torch.randn(2, 8)
    extra = torch.randn(2, 8, requires_grad=True) * 1  # an activation: it needs a gradient, is not copied
    out = model[0](x, extra=extra)
    extra.mul_(2)  # legal for autograd (nothing it saves is extra); a recomputation would read other values
    with pytest.raises(
        RuntimeError, match=r"input extra in place after the block ran.*AutoCheckpoint\(blocks"
    ):
        out.sum().backward()
