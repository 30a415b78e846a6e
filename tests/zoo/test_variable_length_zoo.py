"""Variable-length data on a model nobody here wrote: Hugging Face BERT (masked LM, float64, its defaults
but dropout 0 and 256 positions), random batches of long-tailed lengths padded per batch.

- ``AutoAccumulation(max_memory) + OOMBackoff`` under a memory cap: no step runs out of memory, the
  micro-batch count follows the length, and the parameters equal the unsplit run's (rel 1e-10).
- ``AutoCheckpoint(max_memory)``: no step's blocks hold more than the max_bytes of the plan it ran.
"""

import statistics

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_memopt import AutoAccumulation, AutoCheckpoint, OOMBackoff
from lightning_memopt.checkpointing import ActivationMeter, find_blocks
from lightning_memopt.data import pad_collate
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.testing import MemoryCap
from tests.batching.helpers import quiet_trainer
from tests.data.corpus import long_tailed_lengths, random_batches, token_sequences
from tests.zoo.models import VOCAB, ZooModule, bert, no_dropout
from tests.zoo.test_micro_batching_zoo import relative_difference

STEPS, BATCH = 12, 8


class LongBert(ZooModule):
    """The zoo's BERT with room for 256 positions (the zoo's own keeps 16), float64, dropout 0."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.model = no_dropout(bert(torch.float64, positions=256))
        self.lr = 0.05


def samples() -> list[dict[str, torch.Tensor]]:
    """Masked-LM samples of long-tailed lengths (8-256 tokens): every third token predicted."""
    lengths = long_tailed_lengths(STEPS * BATCH, low=8, high=256, median=32, seed=5)
    out = []
    for ids in token_sequences(lengths, vocab=VOCAB, seed=5):
        labels = ids.clone()
        labels[1::3] = -100
        out.append({"input_ids": ids, "labels": labels})
    order = [i for b in random_batches(len(out), BATCH, seed=5) for i in b]
    return [out[i] for i in order]


def assert_same_training(model: torch.nn.Module, base: torch.nn.Module) -> None:
    """Parameters equal, to 1e-10 of the largest change training made (a key bias, whose gradient is 0 in
    exact arithmetic, moves by rounding alone: relative to itself it would measure only that)."""
    start = {k: p.detach().clone() for k, p in LongBert().named_parameters()}
    assert relative_difference(start, model, base) <= 1e-10


def loader() -> DataLoader:
    return DataLoader(samples(), batch_size=BATCH, collate_fn=pad_collate())


def whole_step_peak(length: int) -> int:
    """Peak bytes of a whole-batch step at ``length`` tokens (SGD has no state), outside Lightning."""
    module = LongBert()
    ids = torch.randint(1, VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    with MemoryTracker(module) as tracker:
        module.training_step(batch, 0).backward()
    return tracker.peak


class Steps(pl.Callback):
    def __init__(self, sized=None) -> None:
        self.sized, self.counts, self.lengths = sized, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counts.append(self.sized.engine.num_micro_batches if self.sized else 1)
        self.lengths.append(batch["input_ids"].shape[1])


@pytest.mark.filterwarnings(
    "error::lightning_memopt.SplitNotExactWarning"
)  # exact, so the check says nothing
def test_bert_variable_lengths_no_failed_attempt_and_exact():
    steps = Steps()
    base = LongBert()
    quiet_trainer([steps], max_steps=STEPS).fit(base, loader())
    capacity = whole_step_peak(int(statistics.median(steps.lengths)))
    auto = AutoAccumulation(max_memory=capacity, headroom=0.1)
    sized_steps = Steps(auto)
    model = LongBert()
    with MemoryCap(capacity, modules=model):
        quiet_trainer([auto, OOMBackoff(), sized_steps], max_steps=STEPS).fit(model, loader())
    assert auto.engine.sizes.oom_retries == 0  # no failed attempt, the first steps included
    longest, shortest = max(steps.lengths), min(steps.lengths)
    counts = dict(zip(sized_steps.lengths, sized_steps.counts))
    assert counts[longest] > counts[shortest] == 1  # the count follows the length
    assert_same_training(model, base)


class BlockBudget(pl.Callback):
    """Per step: the blocks' activation bytes at the end of the forward, and the max_bytes of the plan run."""

    def __init__(self, auto: AutoCheckpoint) -> None:
        self.auto, self.held, self.max_bytes_seen = auto, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.meter = ActivationMeter(pl_module, find_blocks(pl_module)).__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        self.meter.__exit__(None, None, None)
        self.held.append(self.meter.total)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.max_bytes_seen.append(self.auto.plan.max_bytes)


def test_bert_variable_lengths_autocheckpoint_never_over_its_budget():
    steps = Steps()
    base = LongBert()
    quiet_trainer([steps], max_steps=STEPS).fit(base, loader())
    limit = 2 * whole_step_peak(max(steps.lengths))  # room for every batch, not for every block kept
    auto = AutoCheckpoint(max_memory=limit, headroom=0.0)
    meter = BlockBudget(auto)
    model = LongBert()
    quiet_trainer([auto, meter], max_steps=STEPS).fit(model, loader())
    assert auto.shape_plans.made >= 2  # longer batches were planned for again
    assert all(h <= b for h, b in zip(meter.held, meter.max_bytes_seen)), list(
        zip(meter.held, meter.max_bytes_seen)
    )
    assert_same_training(model, base)


class LlamaLM(ZooModule):
    """The zoo's Llama (causal LM, rotary positions: any length), float32 (its loss upcasts logits with
    ``.float()``), dropout 0."""

    def __init__(self) -> None:
        super().__init__("llama", dtype=torch.float32)
        no_dropout(self.model)


def test_llama_variable_lengths_no_failed_attempt_and_exact():
    """Causal-LM batches padded with -100 labels (the one-position shift told from the model), lengths
    8-160: per-batch sizing under a cap of a whole 64-token step, no failed attempt, exact in float32."""
    lengths = long_tailed_lengths(STEPS * BATCH, low=8, high=160, median=32, seed=5)
    sequences = token_sequences(lengths, vocab=VOCAB, seed=5)
    order = [i for b in random_batches(len(sequences), BATCH, seed=5) for i in b]
    data = [sequences[i].tolist() for i in order]

    def batches() -> DataLoader:
        return DataLoader(data, batch_size=BATCH, collate_fn=pad_collate())

    base = LlamaLM()
    quiet_trainer([], max_steps=STEPS).fit(base, batches())
    probe = LlamaLM()
    ids = torch.randint(1, VOCAB, (BATCH, 64), generator=torch.Generator().manual_seed(0))
    with MemoryTracker(probe, probe.configure_optimizers()) as tracker:
        probe.training_step(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, 0
        ).backward()
    auto = AutoAccumulation(max_memory=tracker.peak, headroom=0.1)
    steps = Steps(auto)
    model = LlamaLM()
    with MemoryCap(tracker.peak, modules=model) as cap:
        quiet_trainer([auto, OOMBackoff(), steps], max_steps=STEPS).fit(model, batches())
    assert auto.engine.sizes.oom_retries == 0 and cap.raised == 0
    counts = dict(zip(steps.lengths, steps.counts))
    assert counts[max(counts)] > counts[min(counts)]
    start = {k: p.detach().clone() for k, p in LlamaLM().named_parameters()}
    assert relative_difference(start, model, base) <= 1e-5
