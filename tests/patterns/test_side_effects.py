"""Steps that a split cannot reproduce, and must say so: BatchNorm statistics, EMA teachers and queues
written inside ``training_step``, losses that couple the samples of a batch, random draws per forward
beside dropout (LayerDrop).

Each is trained plain and with the package forcing a split; the split run must warn with a
:class:`~lightning_memopt.SplitNotExactWarning` (default), or raise a
:class:`~lightning_memopt.SplitNotExactError` with ``exactness="raise"``, whose message names the cause:
the BatchNorm layers and ``BatchNormToGroupNorm``, the qualified name of what was written "in place", or
that the loss "depends on how the batch is split". Each module is first shown to be inexact when split
(the test could not fail otherwise), and the BatchNorm model with ``BatchNormToGroupNorm`` to be exact.
"""

from __future__ import annotations

import copy
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt import (
    AutoAccumulation,
    BatchNormToGroupNorm,
    SplitNotExactError,
    SplitNotExactWarning,
)
from tests.patterns.helpers import (
    BATCH,
    FEATURES,
    MODES,
    assert_exact,
    loader,
    no_split_warning,
    relative_update,
    train,
)

DIM, QUEUE = 6, 2 * BATCH
SAMPLES = 3 * BATCH


def regression():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return loader(x, x[:, :1] * 2 + 0.3 * torch.randn(SAMPLES, 1, generator=g))


def views():
    """Two noisy views of each sample, as contrastive recipes augment them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return loader(x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn(SAMPLES, FEATURES, generator=g))


class Base(pl.LightningModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BatchNormNet(Base):
    """A plain MLP with BatchNorm1d, as a user writes it (no BatchNormToGroupNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)


class EMATeacher(Base):
    """Self-distillation: the student regresses the target and the frozen teacher's output; the teacher
    is an exponential moving average of the student, updated at the end of ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, 1)
        self.teacher = copy.deepcopy(self.net).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        loss = F.mse_loss(out, y) + F.mse_loss(out, self.teacher(x))
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.net.parameters()):
                t.mul_(0.5).add_(s.detach(), alpha=0.5)
        return loss


class MoCoQueue(Base):
    """MoCo-style: each query against its own key (positive) and a queue of earlier keys (negatives);
    the batch's keys are written into the queue buffer inside ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, DIM))
        self.register_buffer("queue", F.normalize(torch.randn(QUEUE, DIM), dim=1))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))

    def training_step(self, batch, batch_idx):
        x1, x2 = batch
        q = F.normalize(self.net(x1), dim=1)  # (B, D)
        with torch.no_grad():
            k = F.normalize(self.net(x2), dim=1)  # (B, D)
        positives = (q * k).sum(dim=1, keepdim=True)  # (B, 1)
        negatives = q @ self.queue.clone().detach().T  # (B, QUEUE): a copy, the queue is written below
        logits = torch.cat([positives, negatives], dim=1) / 0.2
        loss = F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long))
        ptr = int(self.queue_ptr)
        self.queue[ptr : ptr + len(k)] = k
        self.queue_ptr.fill_((ptr + len(k)) % QUEUE)
        return loss


class InBatchContrastive(Base):
    """InfoNCE over the batch's similarity matrix (SimCLR/CLIP): the other samples are the negatives."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, DIM))

    def training_step(self, batch, batch_idx):
        x1, x2 = batch
        a, b = F.normalize(self.net(x1), dim=1), F.normalize(self.net(x2), dim=1)
        logits = a @ b.T / 0.2  # (B, B)
        return F.cross_entropy(logits, torch.arange(len(a)))


class LoadBalancedMoE(Base):
    """A two-expert mixture with a Switch-style load-balancing term: the fraction of the batch routed to
    each expert times its mean router probability, summed; a property of the whole batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, 2)  # the router
        self.experts = nn.ModuleList(nn.Linear(FEATURES, 1) for _ in range(2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        probs = torch.softmax(self.net(x), dim=-1)  # (B, E)
        choice = probs.argmax(dim=-1)  # (B,)
        outs = torch.stack([e(x) for e in self.experts], dim=1)  # (B, E, 1)
        out = (outs * probs[..., None]).sum(dim=1)
        fraction = F.one_hot(choice, 2).double().mean(dim=0)  # (E,)
        balance = 2 * (fraction * probs.mean(dim=0)).sum()
        return F.mse_loss(out, y) + 0.5 * balance


class LayerDrop(Base):
    """A draw per forward beside dropout's, as LayerDrop (fairseq, M2M-100, Wav2Vec2) draws whether to skip a
    layer: here the middle layer's residual branch is scaled by ``torch.rand(())``, one draw for the whole
    batch (a scale, so that two splits never agree by chance); split, each micro-batch draws its own."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.middle, self.head = nn.Linear(FEATURES, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.tanh(self.net(x))
        h = h + torch.rand(()) * torch.tanh(self.middle(h))
        return F.mse_loss(self.head(h), y)


# What the message must contain, in any order and across lines ((?s): "." matches a newline too)
CASES = {
    "batchnorm": (BatchNormNet, regression, r"(?s)^(?=.*BatchNorm(?!ToGroupNorm))(?=.*BatchNormToGroupNorm)"),
    "ema_teacher": (EMATeacher, regression, r"(?s)^(?=.*teacher\.weight)(?=.*in place)"),
    "moco_queue": (MoCoQueue, views, r"(?s)^(?=.*\bqueue\b)(?=.*in place)"),
    "in_batch_contrastive": (InBatchContrastive, views, re.escape("depends on how the batch is split")),
    "moe_load_balancing": (LoadBalancedMoE, regression, re.escape("depends on how the batch is split")),
    "layer_drop": (LayerDrop, regression, r"(?s)^(?=.*random numbers besides dropout)(?=.*LayerDrop)"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_split_changes_the_update(case: str, mode: str) -> None:
    """Each of these steps really is different when split: naming the cause is the only honest outcome."""
    module, data, _ = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SplitNotExactWarning)
        assert relative_update(train(module, data, mode), train(module, data)) > 1e-6


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_split_warns_with_the_cause(case: str, mode: str) -> None:
    module, data, cause = CASES[case]
    with pytest.warns(SplitNotExactWarning, match=cause):
        train(module, data, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_split_raises_with_the_cause(case: str, mode: str) -> None:
    module, data, cause = CASES[case]
    with pytest.raises(SplitNotExactError, match=cause):
        train(module, data, mode, options={"exactness": "raise"})


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_with_the_swap_is_exact_and_quiet(mode: str) -> None:
    """With ``BatchNormToGroupNorm`` the split run equals the unsplit run with the same swap, and nothing
    warns that it is not exact."""
    reference = train(BatchNormNet, regression, callbacks=[BatchNormToGroupNorm()])
    with no_split_warning():
        run = train(BatchNormNet, regression, mode, callbacks=[BatchNormToGroupNorm()])
    assert_exact(run, reference)


@pytest.mark.parametrize("case", ["ema_teacher", "moco_queue"])
def test_oom_retry_restores_what_the_step_wrote(case: str) -> None:
    """A step whose backward runs out of memory (after ``training_step`` wrote the teacher or the queue)
    is retried from its start: the run equals one split the same way from the start, frozen teacher
    parameters and queue included."""
    module, data, _ = CASES[case]
    half = BATCH // 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SplitNotExactWarning)
        retried = train(module, data, "oom", phase="backward")
        split = train(module, data, callbacks=[AutoAccumulation(micro_batch_size=half, log=False)])
    assert retried.callbacks[0].micro_batch_size == half
    assert_exact(retried, split)
    for name, buffer in split.module.named_buffers():
        assert torch.equal(dict(retried.module.named_buffers())[name], buffer), name
