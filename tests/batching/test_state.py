import random

import pytest
import torch
import torchmetrics

from lightning_memopt.batching.distributed import (
    all_reduce_gradients,
    any_rank,
    max_over_ranks,
    min_over_ranks,
)
from lightning_memopt.batching.state import OptimizerSnapshot, StepState, drop_gradients


def test_restores_buffers_rng_metrics_and_scaler():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    model.metric = torchmetrics.MeanMetric()
    model.metric.update(torch.tensor([1.0, 2.0]))
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # the scale tensor is created lazily
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    state = StepState.capture([model], scaler)
    expected_noise = (torch.rand(3), random.random())
    state.restore()  # restoring RNG right away gives the same draws again
    x = torch.randn(5, 3)
    model(x)
    model.metric.update(torch.tensor([10.0]))
    scaler.update(new_scale=1.0)
    state.restore()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in buffers.items())
    assert float(model.metric.compute()) == 1.5 and model.metric.update_count == 1
    assert scaler.get_scale() == 8.0
    noise = (torch.rand(3), random.random())
    assert torch.equal(noise[0], expected_noise[0]) and noise[1] == expected_noise[1]
    assert state.nbytes > 0


def test_drop_gradients():
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    drop_gradients([model])
    assert all(p.grad is None for p in model.parameters())


def test_agreement_helpers_are_local_without_a_process_group():
    assert any_rank(True) is True and any_rank(False) is False
    assert min_over_ranks(3) == 3 and max_over_ranks(5) == 5
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    all_reduce_gradients(model.parameters())  # one process: nothing to average
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, torch.optim.AdamW])
def test_optimizer_snapshot_undoes_a_step(optimizer_class):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    kwargs = {"momentum": 0.9} if optimizer_class is torch.optim.SGD else {}
    optimizer = optimizer_class(model.parameters(), lr=0.1, **kwargs)
    x = torch.randn(4, 3)

    def step():
        optimizer.zero_grad()
        model(x).square().sum().backward()
        optimizer.step()

    fresh = OptimizerSnapshot.capture([optimizer])  # before the first step: no optimizer state yet
    params = [p.detach().clone() for p in model.parameters()]
    step()
    assert len(optimizer.state) == 2
    fresh.restore()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert len(optimizer.state) == 0  # the lazily created state is gone: the retry creates it again
    step()
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    params = [p.detach().clone() for p in model.parameters()]
    later = OptimizerSnapshot.capture([optimizer])
    assert later.nbytes == sum(p.numel() * 4 for p in model.parameters()) + sum(
        v.numel() * v.element_size() for s in state.values() for v in s.values()
    )
    step()
    later.restore()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    for p, saved in state.items():
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in saved.items())
    step()  # the restored state keeps training: the same step as the undone one
    params_again = [p.detach().clone() for p in model.parameters()]
    later.restore()
    step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params_again))
