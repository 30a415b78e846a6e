"""Per-batch sizing: micro-batches budgeted in padded tokens, so each batch's split follows its length."""

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_memopt import AutoAccumulation, OOMBackoff
from lightning_memopt.batching.shape_model import tokens_per_sample
from lightning_memopt.batching.sizes import MicroBatchSizes
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.testing import MemoryCap
from tests.batching.helpers import assert_params_close, quiet_trainer

VOCAB, WIDTH, BATCH = 512, 8, 8


def lm_batch(length: int, seed: int) -> dict[str, torch.Tensor]:
    """``BATCH`` samples right-padded to ``length`` tokens, Hugging Face style: padding labelled -100."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, length), generator=gen)
    lengths = torch.randint(1, length + 1, (BATCH,), generator=gen)
    lengths[0] = length  # the longest sample sets the padded length
    padded = torch.arange(length) >= lengths[:, None]
    return {"input_ids": ids, "labels": ids.masked_fill(padded, -100)}


class TinyLM(pl.LightningModule):
    """Embedding and a wide output layer in float64: the logits dominate a step's memory."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH, dtype=torch.float64)
        self.head = torch.nn.Linear(WIDTH, VOCAB, dtype=torch.float64)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.head(self.embed(batch["input_ids"]))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())  # mean over labels != -100

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Counts(pl.Callback):
    """Micro-batches of each step, as the engine of ``sized`` (a package callback) ran it."""

    def __init__(self, sized: pl.Callback) -> None:
        self.sized, self.counts = sized, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counts.append(self.sized.engine.num_micro_batches)


def train(
    lengths: list[int], sized=None, capacity: int | None = None, steps: int | None = None, **kwargs
) -> tuple[TinyLM, list[int], int]:
    """Train on batches of ``lengths`` tokens; the micro-batches per step and the failed attempts."""
    model = TinyLM()
    loader = DataLoader([lm_batch(length, seed) for seed, length in enumerate(lengths)], batch_size=None)
    callbacks = [] if sized is None else [sized, Counts(sized)]
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = quiet_trainer(
        callbacks + kwargs.pop("callbacks", []), max_steps=steps or len(lengths), **kwargs
    )
    with MemoryCap(capacity or 2**40, modules=model) as cap:
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model, (callbacks[1].counts if callbacks else []), cap.raised


def whole_step_peak(length: int) -> int:
    """Peak bytes of a whole-batch step (forward, backward, SGD) at ``length`` tokens, without Lightning."""
    model = TinyLM()
    optimizer = model.configure_optimizers()
    batch = lm_batch(length, 0)
    with MemoryTracker(model, optimizer) as tracker:
        model.training_step(batch, 0).backward()
        optimizer.step()
    return tracker.peak


def test_tokens_per_sample():
    assert tokens_per_sample(lm_batch(13, 0)) == 13
    images = (torch.zeros(4, 3, 32, 32), torch.zeros(4, dtype=torch.long))
    assert tokens_per_sample(images) == 3  # the channels: constant, so sizes stay in samples
    assert tokens_per_sample((torch.zeros(4), [torch.zeros(4, 7, dtype=torch.bool)], "text")) == 1


def size_for(sizes: MicroBatchSizes, total: int, width: int) -> int:
    sizes.see(width)
    return sizes.size(total)


def test_policy_budget_follows_the_length():
    policy = MicroBatchSizes(grow_after=1)
    assert size_for(policy, 8, 32) == 8  # no size yet: the whole batch
    policy.failed(8, total=8, floor=1, failure="OOM")  # 8 x 32 = 256 tokens failed
    assert (policy.micro_batch_size, policy.tokens, policy.failed_tokens) == (4, 128, 256)
    assert size_for(policy, 8, 8) == 8  # 128 tokens: 16 samples of 8, capped by the batch
    assert size_for(policy, 64, 8) == 16
    assert size_for(policy, 8, 64) == 2  # 128 tokens: 2 samples of 64
    assert size_for(policy, 8, 200) == 1  # at least one sample
    assert size_for(policy, 64, 16) == 8
    policy.succeeded(retried=False, total=64)  # grows from 8 samples of 16 (128 tokens) ...
    assert policy.tokens == 15 * 16  # ... to below the 256 tokens that failed: 240
    size_for(policy, 8, 32)
    assert policy.micro_batch_size == 7  # 224 tokens < 256


def test_sizes_given_before_the_first_batch_are_its_samples():
    budget = MicroBatchSizes(micro_batch_size=2)
    budget.see(16)
    assert (budget.tokens, budget.samples("tokens")) == (32, 2)
    budget.see(4)
    assert budget.samples("tokens") == 8


def test_fixed_size_is_in_samples_of_the_first_batch_and_exact(tmp_path):
    lengths = [16, 8, 32, 4, 16]
    base, _, _ = train(lengths)
    model, counts, _ = train(lengths, AutoAccumulation(micro_batch_size=2))
    # 2 samples of 16 tokens = 32 tokens per micro-batch: 4 samples of 8, 1 of 32, 8 of 4
    assert counts == [4, 2, 8, 1, 4]
    assert_params_close(model, base, rel=1e-10)


def test_oom_backoff_learns_the_length_instead_of_shrinking_every_batch(tmp_path):
    lengths = [8, 32, 8, 32, 16, 32, 8]
    # 256 tokens (8 x 32) do not fit, 128 (4 x 32, or the whole 8 x 16) do
    small, large = whole_step_peak(16), whole_step_peak(32)
    assert large - small > 100 * 1024  # the logits alone: 128 tokens x 512 x 8 bytes, several times
    base, _, _ = train(lengths)
    model, counts, failed = train(lengths, OOMBackoff(), capacity=(small + large) // 2)
    # one failed attempt, at the first 32-token batch; later 32-token batches run in 2 without failing,
    # and the 8- and 16-token batches run whole (a size in samples would have kept 4: 2 per step)
    assert failed == 1
    assert counts == [1, 2, 1, 2, 1, 2, 1]
    assert_params_close(model, base, rel=1e-10)


def test_resume_keeps_the_budget_in_tokens(tmp_path):
    """The sizes are saved with the length they are samples of, so a resumed run sizes as the full one."""
    lengths = [8, 32, 8, 32]  # one epoch; the checkpoint after it, the second epoch runs the same batches
    capacity = (whole_step_peak(16) + whole_step_peak(32)) // 2

    def run(ckpt_path=None):
        saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
        kwargs = dict(callbacks=[saver], enable_checkpointing=True, ckpt_path=ckpt_path)
        return train(lengths, OOMBackoff(), capacity=capacity, steps=8, **kwargs)

    full, full_counts, full_failed = run()
    assert (full_counts, full_failed) == ([1, 2, 1, 2, 1, 2, 1, 2], 1)
    resumed, counts, failed = run(str(tmp_path / "epoch=0-step=4.ckpt"))
    # 4 samples of 32 tokens were saved as 128 tokens: the 8-token batch runs whole again, not as 2 x 4
    assert (counts, failed) == ([1, 2, 1, 2], 0)
    assert_params_close(resumed, full, rel=0.0)
