"""The one-time exactness check runs the batch's leading micro-batches again, not the whole batch, where
they hold at least ``CHECKED_SAMPLES`` samples; and it still tells a split that changes the step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import AutoAccumulation, SplitNotExactError
from lightning_memopt.batching.step import CHECKED_SAMPLES, checked_micro_batches
from tests.batching.helpers import Net, dataset, quiet_trainer


def first_step_sizes(net: Net, micro: int, batch: int) -> list[int]:
    callback = AutoAccumulation(micro_batch_size=micro, log=False, exactness="raise")
    loader = DataLoader(dataset(n=batch), batch_size=batch, shuffle=False)
    quiet_trainer([callback], max_steps=1).fit(net, loader)
    return net.seen_sizes


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_check_runs_the_first_micro_batch_whole_and_as_two_halves(dropout: float) -> None:
    # the step's 4 micro-batches of 10, then the first 10 samples as 10 (without dropout) and as 5 + 5; the
    # whole batch again as 5 + 10 + 10 + 10 + 5 cost 40 samples (80 with dropout: the step again as well)
    assert first_step_sizes(Net(dropout=dropout), 10, 40) == [10, 10, 10, 10, 10, 5, 5]


def test_the_check_runs_micro_batches_until_they_hold_enough_samples() -> None:
    # 3 + 3 + 3 hold CHECKED_SAMPLES = 8: those 9 samples again as the step ran them, then moved by half
    assert CHECKED_SAMPLES == 8
    assert first_step_sizes(Net(), 3, 12) == [3, 3, 3, 3, 3, 3, 3, 1, 3, 3, 2]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_batch_of_few_samples_is_checked_whole_as_before(dropout: float) -> None:
    # 2 + 2 + 2 + 2 hold 8: the whole batch; the step's own gradients are the reference without dropout
    again = [2, 2, 2, 2] if dropout else []
    assert first_step_sizes(Net(dropout=dropout), 2, 8) == [2, 2, 2, 2, *again, 1, 2, 2, 2, 1]


def test_checked_micro_batches() -> None:
    assert checked_micro_batches([12, 12, 12, 12]) == 1
    assert checked_micro_batches([8]) == 1
    assert checked_micro_batches([5, 5, 4]) == 2
    assert checked_micro_batches([2, 2, 2]) == 3  # 6 in all: every one


class Unlogged(Net):
    """Net's layers, a ``training_step`` that logs nothing."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass


class InBatchNegatives(Unlogged):
    """InfoNCE over the batch's similarity matrix: every other sample is a negative."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.seen_sizes.append(len(x))
        a = F.normalize(self.net[0](x), dim=1)
        b = F.normalize(self.net[0](x + 0.1), dim=1)
        return F.cross_entropy(a @ b.T / 0.2, torch.arange(len(a)))


class TokenMean(Unlogged):
    """Cross-entropy over the labels that are not ``-100``, how many varying from sample to sample."""

    def training_step(self, batch, batch_idx):
        x, labels = batch
        self.seen_sizes.append(len(x))
        return F.cross_entropy(self.net[0](x).view(len(x) * 4, 4), labels.view(-1))


def labelled(n: int = 48) -> TensorDataset:
    """Features and 4 labels a sample, each ``-100`` (not counted) with probability 0.4."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    labels = torch.randint(0, 4, (n, 4), generator=g)
    return TensorDataset(x, labels.masked_fill(torch.rand(n, 4, generator=g) < 0.4, -100))


def samples(micro_batch) -> int:
    return len(micro_batch[0])


@pytest.mark.parametrize(
    ("module", "options", "cause"),
    [
        (InBatchNegatives, {}, "depends on how the batch is split"),
        (TokenMean, {"count_fn": samples}, "relative difference"),  # weighed by samples: wrong
    ],
)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_first_micro_batch_alone_still_tells_a_split_that_changes_the_step(
    module, options, cause, precision
) -> None:
    data = labelled() if module is TokenMean else dataset(n=48)
    callback = AutoAccumulation(micro_batch_size=12, log=False, exactness="raise", **options)
    trainer = quiet_trainer([callback], max_steps=1, precision=precision)
    with pytest.raises(SplitNotExactError, match=cause):
        trainer.fit(module(), DataLoader(data, batch_size=48))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_mean_over_counted_labels_learned_from_the_loss_passes_the_check(precision: str) -> None:
    # the engine learns the count from the loss: the check passes (exactness="raise" would raise)
    module = TokenMean()
    callback = AutoAccumulation(micro_batch_size=12, log=False, exactness="raise")
    trainer = quiet_trainer([callback], max_steps=1, precision=precision)
    trainer.fit(module, DataLoader(labelled(), batch_size=48))
    assert module.seen_sizes == [12, 12, 12, 12, 12, 6, 6]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_check_copies_the_step_s_gradients_once_and_puts_them_back_exactly(
    precision, monkeypatch
) -> None:
    """The moved split runs with its loss negated on top of the reference's gradients: they end as the
    difference, so the only copy is the step's own gradients, and the step trains as an unchecked one."""
    from lightning_memopt.batching import exactness

    copies = []
    original = exactness.gradients
    monkeypatch.setattr(
        exactness, "gradients", lambda module, **kw: copies.append(kw) or original(module, **kw)
    )
    trained = []
    for check in ("raise", "off"):
        torch.manual_seed(0)
        net = Net()
        callback = AutoAccumulation(micro_batch_size=3, log=False, exactness=check)
        quiet_trainer([callback], max_steps=1, precision=precision).fit(
            net, DataLoader(dataset(n=12), batch_size=12)
        )
        trained.append([p.detach().clone() for p in net.parameters()])
        if check == "raise":  # the step, its first 9 samples again as the step ran them, then moved
            assert net.seen_sizes == [3, 3, 3, 3, 3, 3, 3, 1, 3, 3, 2]
            assert copies == [{"on_device": False}]  # a CPU: in host memory
    assert all(torch.equal(a, b) for a, b in zip(*trained, strict=True))


def test_the_check_keeps_the_gradients_on_a_gpu_where_the_first_optimizer_state_leaves_room() -> None:
    """Before the optimizers' first step, the state it creates (AdamW: twice the parameters) is room every
    later micro-batch holds: a copy of the gradients (the parameters' bytes) fits there, on CUDA."""
    from lightning_memopt.batching.exactness import room_for_gradients

    model = torch.nn.Linear(4, 3)
    model(torch.ones(2, 4)).sum().backward()
    grads = sum(p.grad.numel() * 4 for p in model.parameters())  # 60 bytes
    adamw, sgd = torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert room_for_gradients(model, [adamw], cuda, None)  # measured: AdamW's 2 x 60 bytes and a count
    assert room_for_gradients(model, [adamw], cuda, grads) and not room_for_gradients(
        model, [adamw], cuda, grads - 1
    )
    assert not room_for_gradients(model, [sgd], cuda, None)  # plain SGD creates no state: no room
    assert not room_for_gradients(model, [adamw], cpu, None)  # a CPU's memory is the host's alike
    adamw.step()
    assert not room_for_gradients(model, [adamw], cuda, None)  # the state is there: the room is taken


@pytest.mark.cuda
def test_on_cuda_the_first_step_s_check_copies_no_gradient_to_the_host(monkeypatch) -> None:
    """On CUDA before the optimizer's first step the step's gradients are kept on the device for the check
    (a host copy of a 1.3B model's took 3 s on an H200), and put back exactly: it trains as unchecked."""
    from lightning_memopt.batching import exactness

    hosted = []
    original = exactness.host_copy
    monkeypatch.setattr(exactness, "host_copy", lambda t: hosted.append(tuple(t.shape)) or original(t))
    trained = []
    for check in ("raise", "off"):
        torch.manual_seed(0)
        net = Net(optimizer="adamw")
        callback = AutoAccumulation(micro_batch_size=3, log=False, exactness=check)
        quiet_trainer([callback], max_steps=1, accelerator="cuda", deterministic=True).fit(
            net, DataLoader(dataset(n=12), batch_size=12)
        )
        trained.append([p.detach().cpu() for p in net.parameters()])
        if check == "raise":
            assert net.seen_sizes == [3, 3, 3, 3, 3, 3, 3, 1, 3, 3, 2]  # the check ran
    assert hosted == []
    assert all(torch.equal(a, b) for a, b in zip(*trained, strict=True))
