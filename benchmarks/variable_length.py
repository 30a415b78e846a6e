"""Variable-length data: padding with max-tokens batching, and what today's callbacks do when shapes vary.

Run from the repository root (a few minutes on 2 CPU cores; never run by the test suite)::

    PYTHONPATH=. python benchmarks/variable_length.py               # 100 training steps per run
    PYTHONPATH=. python benchmarks/variable_length.py --steps 1000  # the issue's "per 1,000 steps"
    PYTHONPATH=. python benchmarks/variable_length.py --padding     # only the padding table (seconds)

The corpus is made in code (``tests/data/corpus.py``): log-normal lengths (median 128 tokens, sigma 1)
clipped to 16-2,048 tokens, random token ids.

**Padding.** Padding tokens of an epoch (20,000 samples) batched by
:class:`~lightning_memopt.data.token_batching.TokenBudgetBatchSampler` (default ``bucket_size=4096``)
against random batching with a fixed sample count chosen to give the same number of batches (the same
number of optimizer steps per epoch). Padding is counted with each batch right-padded to its longest
sample, which is what ``pad_collate`` builds.

**Per-batch sizing** (and the baselines it beats). A GPT-style model (``examples/gpt/gpt.py``'s
``GPT``, 2 blocks of width 32, AdamW, float32) trained on *randomly* batched samples of a corpus made the
same way with a median of 32 tokens and lengths clipped to 16-``--max-len`` (default 512, so that a step's
T x T attention stays well under a second on CPU), ``--batch-size`` samples per batch (default 8): the
padded length of a batch is its longest sample, so it varies a lot from batch to batch. The device is
:class:`~lightning_memopt.testing.MemoryCap`: live tensor bytes counted exactly, the op that passes the
capacity raises a CUDA-style out-of-memory error. The capacity is the peak of a whole-batch step (batch
alive, forward, backward, AdamW step; measured with ``MemoryTracker``) at the median padded length of the
run's batches: about half the batches fit whole, the others need 2 or more micro-batches.

- ``OOMBackoff`` alone (default: never grows back; and ``grow_after=10``: doubles the micro-batch again
  after 10 clean steps), and ``AutoAccumulation(max_memory=capacity) + OOMBackoff`` (per-batch sizing
  from its memory model over shapes; with the default ``headroom=0.1`` and with ``0.05``), also against
  the fewest that fit its share (the capacity less the headroom): out-of-memory errors
  (failed attempts) per 1,000 steps, in all steps and after the first 10; micro-batches per step against
  the fewest that fit that batch. "Fewest that fit" is probed for each batch shape outside the fit: the
  smallest k whose step (k micro-batches of ``ceil(B / k)`` samples, the whole batch alive, then the
  AdamW step) peaks at or under the capacity. It does not count Lightning's own few small tensors, so
  it may be 1 lower than what the cap allows at a boundary; ratios are means and maxima over steps.
- ``AutoCheckpoint(max_memory=capacity, headroom=0)`` alone (no cap, so nothing fails): it plans per
  batch shape (a batch longer than every planned one runs every block full and is planned for); each
  step's blocks' activation bytes (``ActivationMeter``, end of forward) over the blocks' share of the
  plan made for it (``Plan.max_bytes``, read after the step), max over steps; and how many plans were made.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from examples.gpt.gpt import GPT
from lightning_memopt import AutoAccumulation, AutoCheckpoint, OOMBackoff
from lightning_memopt.checkpointing import ActivationMeter, find_blocks
from lightning_memopt.data.token_batching import TokenBudgetBatchSampler, pad_collate, padding_tokens
from lightning_memopt.memory import MemoryTracker, format_bytes
from lightning_memopt.testing import MemoryCap
from tests.batching.helpers import quiet_trainer
from tests.data.corpus import long_tailed_lengths, random_batches, token_sequences

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
VOCAB = 256
TRAIN_MEDIAN = 32  # tokens: the training runs' corpus, shorter than the padding table's for CPU time


# ------------------------------------------------------------------------------------------ padding
def padding_table(n: int = 20_000) -> None:
    lengths = long_tailed_lengths(n)
    print(
        f"## Padding: {n} samples, lengths {min(lengths)}-{max(lengths)} (median "
        f"{statistics.median(lengths):.0f}, mean {statistics.fmean(lengths):.0f}), {sum(lengths)} real tokens"
    )
    header = f"{'max_tokens':>10} {'batches':>7} {'sampler pad':>12} {'pad %':>6} {'random B':>8} {'random pad':>12} {'pad %':>6} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for max_tokens in (4096, 16_384, 65_536):
        batches = list(TokenBudgetBatchSampler(lengths, max_tokens, seed=0))
        pad, padded = padding_tokens(batches, lengths)
        size = max(1, round(n / len(batches)))  # as many steps per epoch as the sampler gives
        r_pad, r_padded = padding_tokens(random_batches(n, size, seed=0), lengths)
        print(
            f"{max_tokens:>10} {len(batches):>7} {pad:>12} {100 * pad / padded:>5.1f}% {size:>8} {r_pad:>12} "
            f"{100 * r_pad / r_padded:>5.1f}% {r_pad / max(pad, 1):>6.1f}x"
        )
    print()


# ------------------------------------------------------------------------------------ the training run
class LM(pl.LightningModule):
    """``examples/gpt``'s GPT on padded dict batches; the loss is the mean over real target tokens."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(block_size=block_size, n_layer=2, n_head=2, n_embd=32, dropout=0.0)

    def training_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"])  # (B, T, vocab)
        targets = batch["labels"][:, 1:]  # position t predicts token t + 1; padding is -100
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def target_tokens(batch) -> int:
    """What the loss averages over: AutoAccumulation's ``count_fn``, so micro-batches weigh by tokens."""
    return int((batch["labels"][:, 1:] != -100).sum())


class Recorder(Callback):
    """Per step: the batch shape and, from the micro-batching engine, micro-batches and cumulative OOMs."""

    def __init__(self, engine_owner=None) -> None:
        self.owner = engine_owner
        self.shapes: list[tuple[int, int]] = []
        self.micro: list[int] = []
        self.ooms: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.shapes.append(tuple(batch["input_ids"].shape))
        engine = self.owner._engine if self.owner is not None else None
        self.micro.append(engine.num_micro_batches if engine is not None else 1)
        self.ooms.append(engine.sizes.oom_retries if engine is not None else 0)


class BlockMeter(Callback):
    """Per step, the bytes the blocks hold at the end of the forward (``ActivationMeter``) and the blocks'
    share of ``auto``'s plan after the step (a step that profiled runs every block full: the plan made
    on it)."""

    def __init__(self, auto: AutoCheckpoint) -> None:
        self.auto = auto
        self.bytes: list[int] = []
        self.shares: list[int] = []
        self._meter: ActivationMeter | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._meter = ActivationMeter(pl_module, find_blocks(pl_module)).__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        meter, self._meter = self._meter, None
        meter.__exit__(None, None, None)
        self.bytes.append(meter.total)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.shares.append(self.auto.plan.max_bytes)


def loader(samples, steps: int, batch_size: int) -> DataLoader:
    order = [i for b in random_batches(len(samples), batch_size, seed=1)[:steps] for i in b]
    # Token ids as lists: the collated batch is the only tensor a step adds. (Tensors would be counted by
    # MemoryCap, a simulated device, from the first step that reads them on: the host dataset filling the
    # device, 5-10 KiB a step.)
    return DataLoader([samples[i].tolist() for i in order], batch_size=batch_size, collate_fn=pad_collate())


def fit(samples, callbacks, *, steps: int, batch_size: int, block_size: int, capacity: int | None):
    module = LM(block_size)
    trainer = quiet_trainer(callbacks, max_steps=steps)
    if capacity is None:
        trainer.fit(module, loader(samples, steps, batch_size))
        return None
    with MemoryCap(capacity, modules=module) as cap:
        trainer.fit(module, loader(samples, steps, batch_size))
    return cap


# ------------------------------------------------------------------------------- fewest that fit
class StepPeak:
    """Peak live bytes of one step at k micro-batches, by batch shape (memory depends only on shapes)."""

    def __init__(self, block_size: int) -> None:
        self.module = LM(block_size)
        self.optimizer = self.module.configure_optimizers()
        self._step(self._batch(1, 16), 1)  # AdamW's state exists from the first step on, as in the fit
        self.cache: dict[tuple[int, int, int], int] = {}

    @staticmethod
    def _batch(size: int, length: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, VOCAB, (size, length))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def _step(self, batch, k: int) -> None:
        size = len(batch["input_ids"])
        if k == 1:
            # As Lightning runs a step: the previous step's gradients live through the forward (it zeroes
            # them after training_step, before backward).
            loss = self.module.training_step(batch, 0)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        else:
            # As the micro-batching engine runs one: gradients zeroed first, then each micro-batch.
            self.optimizer.zero_grad(set_to_none=True)
            micro = math.ceil(size / k)
            for start in range(0, size, micro):
                part = {key: value[start : start + micro] for key, value in batch.items()}
                (self.module.training_step(part, 0) * len(part["input_ids"]) / size).backward()
        self.optimizer.step()

    def peak(self, size: int, length: int, k: int) -> int:
        key = (size, length, k)
        if key not in self.cache:
            with MemoryTracker(self.module, self.optimizer) as tracker:
                self._step(self._batch(size, length), k)
            self.cache[key] = tracker.peak
        return self.cache[key]

    def fewest(self, size: int, length: int, capacity: int) -> int | None:
        """The fewest micro-batches whose step peaks at or under ``capacity``; None if not even k = size."""
        for k in range(1, size + 1):
            if math.ceil(size / math.ceil(size / k)) != k:
                continue  # same micro-batch size as a smaller k
            if self.peak(size, length, k) <= capacity:
                return k
        return None


# ------------------------------------------------------------------------------------------- report
def report_sizing(name: str, rec: Recorder, cap: MemoryCap, fewest: list[int], seconds: float) -> None:
    steps = len(rec.shapes)
    after = rec.ooms[-1] - rec.ooms[min(9, steps - 1)]
    ratios = [m / f for m, f in zip(rec.micro, fewest)]
    over = sum(m > f for m, f in zip(rec.micro, fewest))
    print(
        f"{name:<34} {steps:>5} {1000 * rec.ooms[-1] / steps:>9.0f} {1000 * after / max(steps - 10, 1):>9.0f} "
        f"{cap.raised:>6} {sum(rec.micro) / steps:>7.2f} {sum(fewest) / steps:>7.2f} "
        f"{statistics.fmean(ratios):>6.2f}x {max(ratios):>5.1f}x {over:>5} {seconds:>6.0f}"
    )


def measure_today(steps: int, batch_size: int, max_len: int, *, padding_only: bool = False) -> None:
    lengths = long_tailed_lengths(steps * batch_size, median=TRAIN_MEDIAN, high=max_len, seed=1)
    samples = token_sequences(lengths, vocab=VOCAB, seed=1)
    batches = random_batches(len(samples), batch_size, seed=1)[:steps]
    padded_len = [max(lengths[i] for i in b) for b in batches]
    probe = StepPeak(max_len)
    capacity = probe.peak(batch_size, int(statistics.median(padded_len)), 1)
    fewest = [probe.fewest(len(b), t, capacity) for b, t in zip(batches, padded_len)]
    if None in fewest:
        raise SystemExit(f"a single sample does not fit in {format_bytes(capacity)}; use a smaller --max-len")
    print(
        f"## Per-batch sizing: GPT 2x32, AdamW, {steps} random batches of {batch_size} samples, lengths "
        f"{min(lengths)}-{max(lengths)} (padded per batch {min(padded_len)}-{max(padded_len)}, median "
        f"{statistics.median(padded_len):.0f})"
    )
    print(
        f"   MemoryCap capacity {format_bytes(capacity)} (a whole-batch step at the median padded length); "
        f"whole batches that fit: {sum(f == 1 for f in fewest)}/{steps}"
    )
    header = (
        f"{'callbacks':<34} {'steps':>5} {'OOM/1k':>9} {'>10:/1k':>9} {'raised':>6} {'micro':>7} "
        f"{'fewest':>7} {'mean':>7} {'max':>6} {'>few':>5} {'sec':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, make in (
        ("OOMBackoff", lambda: [OOMBackoff(log=False)]),
        ("OOMBackoff(grow_after=10)", lambda: [OOMBackoff(grow_after=10, log=False)]),
        (
            "AutoAccumulation + OOMBackoff",
            lambda: [
                AutoAccumulation(max_memory=capacity, count_fn=target_tokens, log=False),
                OOMBackoff(log=False),
            ],
        ),
        (
            "AutoAccumulation(headroom=0.05) + OOMB",
            lambda: [
                AutoAccumulation(max_memory=capacity, headroom=0.05, count_fn=target_tokens, log=False),
                OOMBackoff(log=False),
            ],
        ),
    ):
        callbacks = make()
        rec = Recorder(callbacks[0])
        start = time.perf_counter()
        cap = fit(
            samples,
            [*callbacks, rec],
            steps=steps,
            batch_size=batch_size,
            block_size=max_len,
            capacity=capacity,
        )
        report_sizing(name, rec, cap, fewest, time.perf_counter() - start)
        if isinstance(callbacks[0], AutoAccumulation):
            auto = callbacks[0]
            share = int(capacity * (1 - auto.headroom))
            within = [probe.fewest(len(b), t, share) or len(b) for b, t in zip(batches, padded_len)]
            ratios = [m / f for m, f in zip(rec.micro, within)]
            print(
                f"   probed {auto.probes} on the first batch {rec.shapes[0]}; then one probe per length the model "
                f"did not know: {[(w, n) for w, n, _ in auto.engine.sizes.shape_probes]} (tokens, samples)"
            )
            print(
                f"   vs the fewest within its share ({format_bytes(share)}: the capacity less headroom "
                f"{auto.headroom}): mean {statistics.fmean(ratios):.2f}x, max {max(ratios):.1f}x, "
                f"steps over: {sum(r > 1 for r in ratios)}"
            )
    print(
        "   OOM/1k: out-of-memory retries per 1,000 steps (all; after the first 10). raised: MemoryCap's errors,"
    )
    print("   probes included. micro/fewest: mean micro-batches per step, mean fewest that fit; mean/max: of")
    print("   micro/fewest per step; >few: steps run as more micro-batches than the fewest that fit.")
    print()
    checkpoint_today(samples, batches, steps=steps, batch_size=batch_size, max_len=max_len, capacity=capacity)


def checkpoint_today(samples, batches, *, steps: int, batch_size: int, max_len: int, capacity: int) -> None:
    auto = AutoCheckpoint(max_memory=capacity, headroom=0.0)
    meter = BlockMeter(auto)
    try:
        fit(samples, [auto, meter], steps=steps, batch_size=batch_size, block_size=max_len, capacity=None)
    except MisconfigurationException as err:  # a batch no plan fits: said, not run over the share
        print(
            f"## AutoCheckpoint(max_memory={format_bytes(capacity)}, headroom=0) raised at step {len(meter.shares)}:"
        )
        print(f"   {err}")
        print(f"   steps 0-{len(meter.shares) - 1}: over share: ", end="")
        print(
            sum(m > b for m, b in zip(meter.bytes, meter.shares)),
            f"/{len(meter.shares)}; again with twice the limit:",
        )
        return checkpoint_today(
            samples, batches, steps=steps, batch_size=batch_size, max_len=max_len, capacity=2 * capacity
        )
    lengths = [len(samples[i]) for i in batches[0]]
    ratios = [m / b for m, b in zip(meter.bytes, meter.shares)]
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    longest = [signature[0][1] for signature in auto.shape_plans.plans]  # input_ids: (B, T)
    print(
        f"## AutoCheckpoint(max_memory={format_bytes(capacity)}, headroom=0): plans per batch shape, the first "
        f"on batch 0 ({len(lengths)} x {max(lengths)} tokens); {auto.shape_plans.made} plans made, for padded "
        f"lengths {longest}; the last: {dict(auto.plan.choices)}"
    )
    print(
        f"   blocks' shares in the plans {format_bytes(min(meter.shares))}-{format_bytes(max(meter.shares))}"
    )
    print(
        f"   steps 0-{steps - 1}: block activations / share of the plan made for the step: max "
        f"{ratios[worst]:.2f} (step {worst}), mean {statistics.fmean(ratios):.2f}; steps over share: "
        f"{sum(r > 1 for r in ratios)}/{len(ratios)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps per run (default 100)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per random batch (default 8)")
    parser.add_argument("--max-len", type=int, default=512, help="longest sample in the training runs")
    parser.add_argument("--padding", action="store_true", help="only the padding table")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    padding_table()
    if not args.padding:
        measure_today(args.steps, args.batch_size, args.max_len)


if __name__ == "__main__":
    main()
