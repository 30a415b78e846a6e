"""The pieces of the one-time exactness check, without a Trainer."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_memopt.batching import exactness


def test_no_dropout_runs_every_dropout_as_the_identity_even_in_a_recomputation():
    lin = torch.nn.Linear(4, 4)

    def block(x):
        h = torch.nn.Dropout(0.5)(lin(x).relu())
        q = h[:, None, None, :]  # (B, heads=1, T=1, D)
        return F.scaled_dot_product_attention(q, q, q, None, 0.5).flatten(1)  # dropout_p given by position

    x = torch.randn(3, 4, requires_grad=True)
    rng = torch.get_rng_state()
    with exactness.no_dropout():
        checkpoint(block, x, use_reentrant=False).sum().backward()  # the recompute must match the forward
        plain = block(x)
    assert torch.equal(rng, torch.get_rng_state())  # nothing was drawn
    assert (
        F.dropout is torch.nn.functional.__dict__["dropout"] and F.dropout.__module__ == "torch.nn.functional"
    )
    torch.testing.assert_close(
        plain, lin(x).relu(), rtol=0, atol=0
    )  # one key, one value: attention is the value


def norms(*grads):
    """The norms the check reads of gradients (None: none)."""
    module = torch.nn.Module()
    for i, g in enumerate(grads):
        like = torch.zeros(1) if g is None else torch.zeros_like(g)
        module.register_parameter(f"p{i}", torch.nn.Parameter(like))
        module.get_parameter(f"p{i}").grad = g
    return exactness.norms(module)


def test_norms_are_each_parameter_s_gradient_s_in_float64():
    assert norms(torch.tensor([3.0, 4.0]), None, torch.tensor([[1.0], [0.0]], dtype=torch.bfloat16)) == [
        5.0,
        None,
        1.0,
    ]
    tiny = torch.full((4,), 1e-30)  # squares under float32's range: float64 keeps them
    assert norms(tiny) == [pytest.approx(2e-30, rel=1e-6)]


def test_difference_is_per_parameter_and_treats_a_missing_gradient_as_zeros():
    a = norms(torch.tensor([3.0, 4.0]), None, torch.tensor([1.0]))
    assert exactness.difference(a, norms(torch.zeros(2), None, torch.zeros(1))) == 0.0
    assert exactness.difference(a, [0.0, None, 2.0]) == 0.5  # b = [3]: |1 - 3| / (2 x 1 + 2)
    assert exactness.difference([None], norms(torch.ones(2))) == 1.0  # no gradient against one


def test_difference_measures_a_tiny_gradient_against_a_tenth_of_the_largest():
    """A gradient that is zero in exact arithmetic (a key bias under softmax) differs between two exact
    splits by rounding alone: relative to itself that is 100%, relative to the step's gradients nothing."""
    a = [5.0, 1e-17]  # |a - b| of the largest is 0: its scale is 2 x 5, a tenth of it 1.0
    assert exactness.difference(a, [0.0, 2e-17]) == 2e-17 / 1.0
    assert exactness.difference(a, [0.0, 0.5]) == 0.5  # a real difference in a small gradient still shows
    assert exactness.difference(a, [0.0, 0.5], floor=1.0) == 0.05  # half precision's: against the largest


def test_tolerance_follows_the_gradients_dtype():
    assert exactness.tolerance(torch.nn.Linear(2, 2).double(), mixed=False) == (1e-9, 0.1)
    assert exactness.tolerance(torch.nn.Linear(2, 2), mixed=False) == (1e-5, 0.1)
    assert exactness.tolerance(torch.nn.Linear(2, 2), mixed=True) == (2e-2, 1.0)
    assert exactness.tolerance(torch.nn.Linear(2, 2).half(), mixed=False) == (2e-2, 1.0)
    # a float64 model whose loss comes back in float32 (Hugging Face's losses upcast to float32)
    assert exactness.tolerance(torch.nn.Linear(2, 2).double(), mixed=False, loss=torch.float32) == (1e-5, 0.1)
    assert exactness.tolerance(torch.nn.Linear(2, 2).double(), mixed=False, loss=torch.float64) == (1e-9, 0.1)


def test_batchnorms_in_training_mode_are_named():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert exactness.batchnorms(net) == ["1"]
    assert exactness.batchnorms(net.eval()) == []


def test_writes_in_place_are_named_but_not_batchnorm_statistics():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    net.register_buffer("queue", torch.zeros(3))
    teacher = torch.nn.Linear(2, 2).requires_grad_(False)
    net.add_module("teacher", teacher)
    with exactness.written_in_place(net) as written:
        net(torch.randn(4, 2))  # BatchNorm updates its statistics: not a user's write
    assert written == []
    with exactness.written_in_place(net) as written:
        with torch.no_grad():
            teacher.weight.mul_(0.5)
        net.queue[0] = 1.0
    assert written == ["teacher.weight", "queue"]


def test_causes_name_what_was_found_and_the_fix():
    message = exactness.causes(batchnorm=["net.1"], written=["teacher.weight"], unexplained=False)
    assert "BatchNorm layers (net.1)" in message and "BatchNormToGroupNorm" in message
    assert "writes teacher.weight in place" in message
    assert "count_fn" in exactness.causes(batchnorm=[], written=[], unexplained=True)
    assert "depends on how the batch is split" in exactness.causes(
        batchnorm=[], written=[], unexplained=False
    )
