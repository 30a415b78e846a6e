"""The whole job: is adding the callbacks with no arguments ever slower than the best manual way? (issue 30)

Run from the repository root (never run by the test suite; minutes on 2 CPU cores, timings are only
meaningful on a quiet machine)::

    PYTHONPATH=. python benchmarks/fastest_step.py                          # every model, 32-true
    PYTHONPATH=. python benchmarks/fastest_step.py --precision bf16-mixed
    PYTHONPATH=. python benchmarks/fastest_step.py --quick                  # a smoke run (smaller, fewer)
    PYTHONPATH=. python benchmarks/fastest_step.py --only gpt llama
    PYTHONPATH=. python benchmarks/fastest_step.py --only gpt2 llama --layers 12   # deeper: start-up
    PYTHONPATH=. python benchmarks/fastest_step.py --device cuda   # on a GPU: the issue's Llama (below)

The models (built in code, nothing downloaded, dropout off, AdamW): the GPT of ``examples/gpt/gpt.py``
(``CharGPT`` at ``memopt.yaml``'s shape: 4 blocks, 4 heads, width 128, 128 tokens, its own AdamW and
warm-up schedule), a Hugging Face Llama-shaped causal LM with grouped-query attention (2 key/value heads
for 4 query heads), Hugging Face GPT-2, a ViT and a ResNet (``ViTForImageClassification``,
``ResNetForImageClassification``; 4 layers each, ``--layers`` for the transformers, whose profile times one
block of many alike), each a ``model(**batch).loss`` LightningModule, at a batch of
``--batch`` samples (48: its divisors give a user room to pick micro-batches) a step.

The memory limit ``L`` of a model (bytes of live tensors, as :class:`~lightning_memopt.memory.MemoryTracker`
counts them on a CPU) is chosen so that the whole batch does not fit: the plain way's peak at a quarter of
the batch plus half the growth from an eighth to a quarter (plain fits about 5/16 of the batch).

Peaks are measured like a user would see them, under Lightning: a MemoryTracker of the module and its
optimizers around the second micro-batch of the second optimizer step (``accumulate_grad_batches=2``): a
forward and backward with the gradients held, then the optimizer step with its state. The ways:

- ``plain + accumulate``: the DataLoader batch is the largest divisor of the batch whose peak fits ``L``
  (found by trying: a binary search over the divisors, each try one tracked fit), and
  ``accumulate_grad_batches`` = batch / that;
- ``full ckpt + accumulate``: the same with every block recomputed: Hugging Face's
  ``gradient_checkpointing_enable()`` (``AutoCheckpoint(mode="full")`` for the GPT, and for the ResNet,
  whose Hugging Face class does not support gradient checkpointing);
- ``defaults``: ``AutoCheckpoint(max_memory=L), AutoAccumulation(max_memory=L), OOMBackoff()`` with the
  DataLoader batch = the whole batch (their default headroom of 10% of ``L`` included).

Timing: every way of a model is one ``trainer.fit`` in its own thread, all in this process, paced so that
only one runs at a time: each runs ``--warmup`` optimizer steps alone (not counted), then the ways take
turns, ``--rounds`` rounds of ``--steps`` optimizer steps each (the order rotated every round), nothing
tracked. A step's time runs from the end of the step before (or ``on_train_start`` for the first) to the
end of its optimizer step; ``s/step`` is the median of the rounds' steps. ``start-up / step`` is what the
warm-up steps took beyond as many steps of that median, in steps (for the defaults: the search's probes,
the trial steps' slower ways, profiling; for every way its first-time costs). The micro-batches of the defaults are those a steady step ran (seen by a forward
pre-hook on the model). The defaults' peak is measured separately (a tracked fit, its first step after the warm-up).

Every fit that is timed, or that decides by timing (the defaults' peak fit), runs in a thread of its own:
on a loaded machine the same step ran several times slower in the main thread than in a fresh one (each
Python thread has its own OpenMP team), and the ways must be compared under the same conditions.

On CUDA (``--device cuda``, bf16-mixed unless ``--precision`` says otherwise) the model is the Llama-shaped
1.3B of issue 30 (hidden 2,048, 16 layers, SwiGLU 8,192, 32 heads and 8 key/value heads, vocabulary
128,256, tied embeddings, 4,096 tokens; ``--layers`` and ``--seq`` shrink it) at 32 sequences a step, and
the limit is the card itself (``--cap-gib`` caps it with ``torch.cuda.set_per_process_memory_fraction``,
and gives the defaults ``max_memory`` of that many GiB): the manual ways' micro-batches are found by real
out-of-memory errors (two optimizer steps of two micro-batches each), the defaults get no arguments but
``OOMBackoff``'s, one micro-step of the plain way warms the device (its first kernels) before any way is
timed, the ways run one after another, the defaults first (three copies of the model and its
AdamW state do not fit the card together), every step time is read after ``torch.cuda.synchronize()``, and peaks are
``torch.cuda.max_memory_allocated`` over the timed steps.

It prints a Markdown table per model run, then the defaults' start-up by phase (what the warm-up steps
took beyond steady steps, each warm-up step in steady steps; the seconds and calls of the size search's
probes and AutoCheckpoint's profiling, each also in steady steps), on CUDA the seconds of each training
probe of the search (what its decision to try the later ways at all reads), what the defaults decided
(``AutoCheckpoint``'s one-line note) and whether their steady peak stayed within ``L``; progress and
tracebacks go to stderr.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import statistics
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import transformers
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from lightning_memopt import AutoAccumulation, AutoCheckpoint, OOMBackoff
from lightning_memopt.batching.probe import BatchProbes
from lightning_memopt.checkpointing.auto import AutoCheckpointer
from lightning_memopt.memory import MemoryTracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from gpt import CharGPT  # noqa: E402

MiB = 2**20
T0 = time.perf_counter()
DEVICE = "cpu"  # --device
CAP: int | None = None  # --cap-gib, in bytes (CUDA)


def cuda() -> bool:
    return DEVICE == "cuda"


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def stamp() -> str:
    return f"{time.perf_counter() - T0:.0f} s"


WAYS = ("plain + accumulate", "full ckpt + accumulate", "defaults")

# The defaults' start-up, by phase: seconds and calls of the size search's probes and AutoCheckpoint's
# profiling (the trial's steps are training steps: their cost is what they take beyond a steady step), counted in the timed fit's thread only (named "defaults")
PHASES = {"search probes": (BatchProbes, "peak")}
PHASES["profiling"] = (AutoCheckpointer, "_plan_from")
spent: dict[str, list[float]] = {}
# the defaults' training probes that ran and were timed (on CUDA): samples, seconds (BatchProbes.seconds)
probed: list[tuple[int, float]] = []


def count_phases() -> None:
    """Wrap each phase's method to add its seconds (and a call) to ``spent`` in the defaults' thread."""
    for name, (owner, attribute) in PHASES.items():
        original = getattr(owner, attribute)

        def timed(*args, _name=name, _original=original, _owner=owner, **kwargs):
            if threading.current_thread().name != "defaults":
                return _original(*args, **kwargs)
            start = time.perf_counter()
            try:
                result = _original(*args, **kwargs)
            finally:
                sync()
                entry = spent.setdefault(_name, [0.0, 0])
                entry[0] += time.perf_counter() - start
                entry[1] += 1
            evaluation = args[2] if len(args) > 2 else kwargs.get("evaluation", False)
            if (
                _owner is BatchProbes
                and result is not None
                and not evaluation
                and args[0].seconds is not None
            ):
                probed.append((args[1], args[0].seconds))  # timed on CUDA only (untracked)
            return result

        setattr(owner, attribute, timed)


NOTE_PREFIXES = ("AutoCheckpoint checkpoints no block", "AutoCheckpoint recomputes")


# ------------------------------------------------------------------------------------------- models
class HFModule(pl.LightningModule):
    """What a user writes around a Hugging Face model: ``model(**batch).loss``, AdamW."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


@dataclass
class Bench:
    """One benchmark model: how to build it, a sample, and how its full-checkpointing way is had."""

    build: Callable[[], pl.LightningModule]  # seeded: every call gives the same weights
    sample: Callable[[int], Any]  # the i-th sample (deterministic)
    hf_checkpointing: bool  # gradient_checkpointing_enable() exists for it
    inner: Callable[[pl.LightningModule], torch.nn.Module] = lambda m: m.model


def _seeded(make: Callable[[], Any]) -> Callable[[], Any]:
    def build():
        torch.manual_seed(0)
        return make()

    return build


def _tokens(vocab: int, seq: int, causal_lm: bool) -> Callable[[int], Any]:
    def sample(i: int):
        ids = torch.randint(0, vocab, (seq + 1,), generator=torch.Generator().manual_seed(i))
        if causal_lm:
            return {"input_ids": ids[:-1], "labels": ids[:-1]}
        return ids[:-1], ids[1:]  # CharGPT's (x, y)

    return sample


def _pixels(image: int, classes: int) -> Callable[[int], Any]:
    def sample(i: int):
        gen = torch.Generator().manual_seed(i)
        return {
            "pixel_values": torch.randn(3, image, image, generator=gen),
            "labels": torch.randint(0, classes, (), generator=gen),
        }

    return sample


def benches(quick: bool, layers: int | None = None) -> dict[str, Bench]:
    """The CPU models; ``layers``: the transformers' depth (4; quick 2; the ResNet's stays)."""
    depth, seq, width, image = (2, 64, 64, 32) if quick else (4, 128, 128, 64)
    layers = layers or depth
    vocab = 1024

    def llama():
        config = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=width,
            intermediate_size=width * 11 // 4,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=seq,
        )
        return HFModule(transformers.LlamaForCausalLM(config))

    def gpt2():
        config = transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=seq,
            n_embd=width,
            n_layer=layers,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return HFModule(transformers.GPT2LMHeadModel(config))

    def vit():
        config = transformers.ViTConfig(
            image_size=image,
            patch_size=8,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=4 * width,
            num_labels=10,
        )
        return HFModule(transformers.ViTForImageClassification(config))

    def resnet():
        config = transformers.ResNetConfig(
            embedding_size=width // 4,
            hidden_sizes=[width // 4, width // 2, width, 2 * width],
            depths=[1, 1, 2, 1] if not quick else [1, 1, 1, 1],
            layer_type="basic",
            num_labels=10,
        )
        return HFModule(transformers.ResNetForImageClassification(config))

    def gpt():
        return CharGPT(block_size=seq, n_layer=layers, n_head=4, n_embd=width, dropout=0.0, warmup_steps=2)

    return {
        "gpt": Bench(_seeded(gpt), _tokens(256, seq, causal_lm=False), hf_checkpointing=False),
        "llama": Bench(_seeded(llama), _tokens(vocab, seq, causal_lm=True), hf_checkpointing=True),
        "gpt2": Bench(_seeded(gpt2), _tokens(vocab, seq, causal_lm=True), hf_checkpointing=True),
        "vit": Bench(_seeded(vit), _pixels(image, 10), hf_checkpointing=True),
        "resnet": Bench(_seeded(resnet), _pixels(image, 10), hf_checkpointing=False),
    }


def gpu_benches(layers: int, seq: int) -> dict[str, Bench]:
    """Issue 30's model: a Llama-shaped 1.3B with grouped-query attention (Llama 3.2 1B's shape)."""

    def llama():
        config = transformers.LlamaConfig(
            vocab_size=128_256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=seq,
            tie_word_embeddings=True,
            use_cache=False,
        )
        return HFModule(transformers.LlamaForCausalLM(config))

    return {"llama": Bench(_seeded(llama), _tokens(128_256, seq, causal_lm=True), hf_checkpointing=True)}


class Samples(Dataset):
    def __init__(self, sample: Callable[[int], Any], n: int, pool: int) -> None:
        self.items = [sample(i) for i in range(pool)]
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.items[i % len(self.items)]


# ------------------------------------------------------------------------------------------- trainers
def trainer(callbacks: list[Callback], precision: str, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        callbacks=callbacks,
        accelerator="gpu" if cuda() else "cpu",
        devices=1,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **kwargs,
    )


def way_setup(way: str, bench: Bench, limit: int) -> tuple[pl.LightningModule, list[Callback]]:
    """A fresh module (same weights every time) and the callbacks of ``way``."""
    with torch.device(DEVICE):  # on CUDA the weights are drawn there: seconds, not minutes, for 1.3B
        module = bench.build()
    if way == "plain + accumulate":
        return module, []
    if way == "full ckpt + accumulate":
        if bench.hf_checkpointing:
            bench.inner(module).gradient_checkpointing_enable()
            return module, []
        return module, [AutoCheckpoint(mode="full", log=False)]
    if cuda() and CAP is None:  # the card is the limit: the callbacks with no arguments
        return module, [AutoCheckpoint(), AutoAccumulation(), OOMBackoff()]
    return module, [AutoCheckpoint(max_memory=limit), AutoAccumulation(max_memory=limit), OOMBackoff()]


def predicted_peak(trainer: pl.Trainer) -> int | None:
    """AutoAccumulation's predicted peak of the step that just trained: held + workspace + its micro-batch's
    samples x bytes each (None without a memory model)."""
    sizing = next((c for c in trainer.callbacks if isinstance(c, AutoAccumulation)), None)
    sizes = sizing.engine.sizes if sizing is not None and sizing.engine is not None else None
    if sizes is None or sizes.model is None or sizes.ran is None:
        return None
    model = sizes.model
    return round(model.held + model.workspace + sizes.ran * model.per_sample(sizes.width))


class TrackBatch(Callback):
    """A MemoryTracker of the module and its optimizers from the start to the end of batch ``index``
    (after its optimizer step, where one ends there)."""

    def __init__(self, index: int) -> None:
        self.index, self.tracker, self.peak, self.breakdown = index, None, None, None
        self.predicted: int | None = None  # AutoAccumulation's predicted peak of that batch's micro-steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.index:
            self.tracker = MemoryTracker(pl_module, trainer.optimizers)
            self.tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.index and self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.peak, self.breakdown = self.tracker.peak, self.tracker.peak_breakdown
            self.tracker = None
            self.predicted = predicted_peak(trainer)


def free_cuda() -> None:
    """What the fits before left on the card, back to the allocator's pool and then to the driver."""
    if cuda():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def warm_device(bench: Bench, precision: str) -> float:
    """On CUDA, before any way is timed: one micro-step of one sample of the plain way, so that the device's
    first kernels (loaded and tuned once per process) are not charged to the way that runs first; its
    seconds, the model's build included."""
    began = time.perf_counter()
    module, _ = way_setup("plain + accumulate", bench, 0)
    trainer([], precision, max_steps=1).fit(module, DataLoader(Samples(bench.sample, 1, 1), batch_size=1))
    del module
    free_cuda()
    return time.perf_counter() - began


def cuda_peak(way: str, bench: Bench, micro: int, precision: str) -> tuple[float, dict]:
    """On CUDA: the device's peak over two optimizer steps of two micro-batches of ``micro`` samples (the
    second of each with the gradients held, the second step with AdamW's state), or infinity where that
    raised an out-of-memory error."""
    free_cuda()
    peak: float = math.inf
    try:
        module, callbacks = way_setup(way, bench, 0)
        data = DataLoader(Samples(bench.sample, 4 * micro, 4 * micro), batch_size=micro)
        trainer(callbacks, precision, max_steps=2, accumulate_grad_batches=2).fit(module, data)
        sync()
        peak = torch.cuda.max_memory_allocated()
    except torch.OutOfMemoryError:
        pass
    finally:
        module = callbacks = data = None
        free_cuda()
    shown = "out of memory" if math.isinf(peak) else f"peak {peak / MiB:,.0f} MiB"
    print(f"    {way}: micro-batch {micro}: {shown} ({stamp()})", file=sys.stderr)
    return peak, {}


def manual_peak(way: str, bench: Bench, micro: int, precision: str) -> tuple[float, dict]:
    """Peak live bytes of one micro-batch of ``micro`` samples with gradients held, its optimizer step
    included: the second micro-batch of the second step at ``accumulate_grad_batches=2``."""
    if cuda():
        return cuda_peak(way, bench, micro, precision)
    module, callbacks = way_setup(way, bench, 0)
    track = TrackBatch(3)
    data = DataLoader(Samples(bench.sample, 4 * micro, 4 * micro), batch_size=micro)
    trainer(callbacks + [track], precision, max_steps=2, accumulate_grad_batches=2).fit(module, data)
    assert track.peak is not None
    print(f"    {way}: micro-batch {micro}: peak {track.peak / MiB:.2f} MiB ({stamp()})", file=sys.stderr)
    return track.peak, track.breakdown


def largest_fitting(
    way: str, bench: Bench, batch: int, limit: int, precision: str, peaks: dict[int, tuple[float, dict]]
) -> int | None:
    """The largest divisor of ``batch`` whose peak fits ``limit``, by trying (binary search; ``peaks``
    caches what was tried); None if not even one sample fits."""
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]

    def fits(d: int) -> bool:
        if d not in peaks:
            peaks[d] = manual_peak(way, bench, d, precision)
        return peaks[d][0] <= limit

    lo, hi = -1, len(divisors)  # divisors[lo] fits (or lo = -1), divisors[hi] does not (or hi = len)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(divisors[mid]):
            lo = mid
        else:
            hi = mid
    return divisors[lo] if lo >= 0 else None


# ------------------------------------------------------------------------------------------- timing
class Pacer(Callback):
    """Times every optimizer step of one fit and pauses the fit's thread between grants of steps."""

    def __init__(self, model_of: Callable[[pl.LightningModule], torch.nn.Module], first_grant: int) -> None:
        self.model_of = model_of
        self.granted = first_grant
        self.go, self.paused = threading.Event(), threading.Event()
        self.times: list[float] = []  # seconds of each optimizer step, in order
        self.rounds: list[float] = []  # those of the granted rounds (after the first grant)
        self.in_round = False
        self.sizes: list[int] = []  # samples of each forward of the step running
        self.steady_sizes: list[int] = []
        self.t0 = 0.0
        self.last_step = 0
        self._handle = None
        self.peak: int | None = None  # CUDA: the device's peak over the granted rounds
        self.predicted: int | None = None  # AutoAccumulation's largest predicted peak of those steps

    def on_train_start(self, trainer, pl_module):
        def seen(module, args, kwargs):
            x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            self.sizes.append(int(x.shape[0]))

        self._handle = self.model_of(pl_module).register_forward_pre_hook(seen, with_kwargs=True)
        sync()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.last_step:
            return  # between micro-batches of one accumulated step
        sync()
        now = time.perf_counter()
        self.last_step = trainer.global_step
        self.times.append(now - self.t0)
        if self.in_round:
            self.rounds.append(now - self.t0)
            predicted = predicted_peak(trainer)
            if predicted is not None:
                self.predicted = max(self.predicted or 0, predicted)
        self.steady_sizes, self.sizes = self.sizes, []
        self.granted -= 1
        if self.granted == 0 and trainer.global_step < trainer.max_steps:
            self.paused.set()
            self.go.wait()
            self.go.clear()
            if cuda() and not self.in_round:
                torch.cuda.reset_peak_memory_stats()
            self.in_round = True
        self.t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        if self._handle is not None:
            self._handle.remove()
        if cuda() and self.in_round:
            sync()
            self.peak = torch.cuda.max_memory_allocated()

    def grant(self, steps: int, thread: threading.Thread) -> None:
        """Let the fit run ``steps`` optimizer steps, and wait until it pauses again (or ends)."""
        self.granted = steps
        self.paused.clear()
        self.go.set()
        while not self.paused.wait(0.5):
            if not thread.is_alive():
                return


@dataclass
class Run:
    way: str
    micro: int | None = None  # the DataLoader batch (the manual ways)
    pacer: Pacer | None = None
    thread: threading.Thread | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    peak: int | None = None
    breakdown: dict | None = None
    peak_sizes: list[int] = field(default_factory=list)
    peak_notes: list[str] = field(default_factory=list)
    predicted: int | None = None  # the defaults: AutoAccumulation's predicted peak of the tracked step
    activations: tuple[int, int] | None = None  # the defaults: AutoCheckpoint's (predicted, measured)

    @property
    def seconds(self) -> float | None:
        return statistics.median(self.pacer.rounds) if self.pacer and self.pacer.rounds else None


def start(run: Run, bench: Bench, batch: int, limit: int, precision: str, warmup: int, total: int) -> None:
    module, callbacks = way_setup(run.way, bench, limit)
    micro = run.micro or batch
    run.pacer = Pacer(bench.inner, warmup)
    data = DataLoader(Samples(bench.sample, total * batch, batch), batch_size=micro)
    accumulate = batch // micro
    fit_trainer = trainer(
        [run.pacer, *callbacks], precision, max_steps=total, accumulate_grad_batches=accumulate
    )

    def target():
        try:
            fit_trainer.fit(module, data)
        except BaseException:  # reported in the table, the traceback on stderr
            run.error = traceback.format_exc()
            print(f"{run.way} failed:\n{run.error}", file=sys.stderr)
        finally:
            run.pacer.paused.set()

    run.thread = threading.Thread(target=target, name=run.way, daemon=True)
    run.thread.start()
    while not run.pacer.paused.wait(0.5):  # the warm-up steps, alone
        if not run.thread.is_alive():
            break


def defaults_peak(run: Run, bench: Bench, batch: int, limit: int, precision: str, warmup: int) -> None:
    """The defaults' peak over one steady optimizer step (the first after ``warmup``), tracked in a fit of
    its own, into
    ``run``: with its breakdown, the micro-batches that step ran, the fit's decision (which is its own),
    AutoAccumulation's predicted peak for that step and AutoCheckpoint's predicted and measured activation
    bytes (its logged keys, where it planned)."""
    module, callbacks = way_setup("defaults", bench, limit)
    track, sizes = TrackBatch(warmup), []  # after the trial, the decision and the plan

    def seen(module, args, kwargs):
        if track.tracker is not None:
            x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            sizes.append(int(x.shape[0]))

    bench.inner(module).register_forward_pre_hook(seen, with_kwargs=True)
    data = DataLoader(Samples(bench.sample, (warmup + 1) * batch, batch), batch_size=batch)
    fit = trainer(callbacks + [track], precision, max_steps=warmup + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(module, data)
    assert track.peak is not None
    run.peak, run.breakdown, run.peak_sizes, run.predicted = (
        track.peak,
        track.breakdown,
        sizes,
        track.predicted,
    )
    run.peak_notes = [str(w.message) for w in caught if str(w.message).startswith(NOTE_PREFIXES)]
    logged = {
        k: int(v) for k, v in fit.callback_metrics.items() if k.startswith("checkpoint/activation_bytes")
    }
    if logged:
        run.activations = (
            logged["checkpoint/activation_bytes_predicted"],
            logged["checkpoint/activation_bytes_measured"],
        )


# ------------------------------------------------------------------------------------------- one model
def bench_model(name: str, bench: Bench, args: argparse.Namespace) -> dict:
    batch, precision = args.batch, args.precision
    print(f"{name}: finding the limit and the manual ways' micro-batches", file=sys.stderr)
    plain_peaks: dict[int, tuple[float, dict]] = {}
    if cuda():  # the card (or its cap) is the limit; the manual ways find it by out-of-memory errors
        limit = CAP or torch.cuda.get_device_properties(0).total_memory
    else:
        quarter, eighth = max(1, batch // 4), max(1, batch // 8)
        for d in (eighth, quarter):
            plain_peaks[d] = manual_peak("plain + accumulate", bench, d, precision)
        limit = plain_peaks[quarter][0] + max(0, plain_peaks[quarter][0] - plain_peaks[eighth][0]) // 2
        limit = -(-limit // 1024) * 1024  # whole KiB
    if not args.micro:
        plain_peaks.setdefault(batch, manual_peak("plain + accumulate", bench, batch, precision))
    whole_fits = batch in plain_peaks and plain_peaks[batch][0] <= limit
    full_peaks: dict[int, tuple[float, dict]] = {}
    runs = [Run(way) for way in WAYS]
    for run, peaks, given in zip(
        runs[:2], (plain_peaks, full_peaks), args.micro or (None, None), strict=True
    ):
        if given:  # --micro: as an earlier run found them
            run.micro = given
            continue
        run.micro = largest_fitting(run.way, bench, batch, limit, precision, peaks)
        run.peak, run.breakdown = peaks[run.micro] if run.micro else (None, None)
        if run.micro is None:
            run.error = "not one sample fits"

    if cuda():
        print(f"{name}: the device warmed in {warm_device(bench, precision):.1f} s", file=sys.stderr)
    print(f"{name}: timing (L = {limit / MiB:.2f} MiB) ({stamp()})", file=sys.stderr)
    spent.clear()
    probed.clear()
    total = args.warmup + args.rounds * args.steps
    live = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # On CUDA the ways run one after another, the defaults first: a call that runs out of time has them
        for run in runs[2:] + runs[:2] if cuda() else runs:
            if run.error is None:
                seen = len(caught)
                free_cuda()
                start(run, bench, batch, limit, precision, args.warmup, total)
                if cuda():  # one way at a time: the card holds one model and its optimizer state
                    for _ in range(args.rounds):
                        if run.thread.is_alive():
                            run.pacer.grant(args.steps, run.thread)
                    run.thread.join()
                    run.peak, run.breakdown = run.pacer.peak, None
                    print(f"  {run.way}: {run.seconds} s/step ({stamp()})", file=sys.stderr)
                run.notes = [
                    str(w.message) for w in caught[seen:] if str(w.message).startswith(NOTE_PREFIXES)
                ]
                if cuda():  # said now: a call that runs out of time keeps what was decided
                    for note in run.notes:
                        print(f"  {run.way} decided: {note}", file=sys.stderr)
                live.append(run)
        for r in range(args.rounds if not cuda() else 0):
            for run in live[r % len(live) :] + live[: r % len(live)]:
                if run.thread.is_alive():
                    run.pacer.grant(args.steps, run.thread)
        for run in live:
            run.thread.join()
    defaults = runs[2]
    phases = {k: tuple(v) for k, v in spent.items()}
    probe_seconds = list(probed)
    if cuda():  # the peaks of the timed steps (the Pacer's)
        defaults.peak_sizes, defaults.peak_notes = defaults.pacer.steady_sizes, defaults.notes
        defaults.predicted = defaults.pacer.predicted
    elif defaults.error is None:
        print(f"{name}: the defaults' steady peak ({stamp()})", file=sys.stderr)

        def target():  # in a thread, as the timed fits (the decision is timed: same conditions)
            try:
                defaults_peak(defaults, bench, batch, limit, precision, args.warmup)
            except Exception:
                print(f"defaults' peak failed:\n{traceback.format_exc()}", file=sys.stderr)

        thread = threading.Thread(target=target, name="defaults' peak", daemon=True)
        thread.start()
        thread.join()
    return {
        "name": name,
        "batch": batch,
        "limit": limit,
        "whole_fits": whole_fits,
        "runs": runs,
        "phases": phases,
        "probe_seconds": probe_seconds,
        "warmup": args.warmup,
    }


# ------------------------------------------------------------------------------------------- printing
def micro_text(run: Run, batch: int) -> str:
    if run.way != "defaults":
        return f"{run.micro} x {batch // run.micro}" if run.micro else "-"
    sizes = run.pacer.steady_sizes if run.pacer else []
    if not sizes:
        return "?"
    if len(set(sizes)) == 1:
        return f"{sizes[0]} x {len(sizes)}"
    return f"{max(sizes)} x {len(sizes)} ({'+'.join(map(str, sizes))})"


def table(results: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "| model | batch | limit | way | micro-batch x count | s/step | ratio vs best manual | start-up / step |",
        "|---|---:|---:|---|---|---:|---:|---:|",
    ]
    for res in results:
        runs = res["runs"]
        manual = [r.seconds for r in runs[:2] if r.error is None and r.seconds is not None]
        best = min(manual) if manual else None
        for run in runs:
            if run.error is not None or run.seconds is None:
                why = (run.error or "no steady step").strip().splitlines()[-1][:80]
                cells = [
                    micro_text(run, res["batch"]) if run.micro or run.pacer else "-",
                    f"error: {why}",
                    "",
                    "",
                ]
            else:
                sec = run.seconds
                ratio = f"{sec / best:.2f}x" if best else "-"
                startup = f"{startup_steps(run, args.warmup):.1f}"
                if run.way == "defaults":
                    ratio = f"**{ratio}**"
                cells = [micro_text(run, res["batch"]), f"{sec:.3f}", ratio, startup]
            lines.append(
                f"| {res['name']} | {res['batch']} | {res['limit'] / MiB:.2f} MiB | {run.way} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines)


def startup_steps(run: Run, warmup: int) -> float:
    """What the warm-up steps took beyond as many steady steps, in steady steps: the search's probes, the
    trial steps' slower ways, profiling and every first-time cost (allocations, lazy initialization)."""
    times = run.pacer.times[:warmup]
    return sum(times) / run.seconds - len(times)


def breakdown(parts: dict | None) -> str:
    return ", ".join(f"{k} {v / MiB:.2f}" for k, v in (parts or {}).items())


def details(results: list[dict]) -> str:
    out = []
    for res in results:
        limit = res["limit"]
        plain, full, defaults = res["runs"]
        out.append(f"- **{res['name']}** (L = {limit / MiB:.2f} MiB = {limit} bytes):")
        if res["whole_fits"]:
            out.append("  - WARNING: the whole batch fits plain under L; this row measures nothing")
        for run in (plain, full):
            if run.peak is not None:
                out.append(
                    f"  - {run.way}: peak at {run.micro}: {run.peak / MiB:.2f} MiB ({run.peak / limit:.2f} L)"
                    f" ({breakdown(run.breakdown)})"
                )
        if defaults.seconds and defaults.pacer and defaults.pacer.times:
            step, warm = defaults.seconds, defaults.pacer.times[: res["warmup"]]
            parts = [
                f"{k} {v:.2f} s ({n} calls, {v / step:.1f} steps)" for k, (v, n) in res["phases"].items()
            ]
            each = ", ".join(f"{t / step:.1f}" for t in warm)
            out.append(
                f"  - defaults' start-up: {startup_steps(defaults, res['warmup']):.1f} steps of {step:.3f} s beyond"
                f" the {len(warm)} warm-up steps (each: {each} steps): "
                + ("; ".join(parts) or "no probe, no profiling")
            )
        if res["probe_seconds"]:  # what the search's decision on recompute reads (sizes.py: decide)
            timed = ", ".join(f"{n}: {t:.3g} s" for n, t in res["probe_seconds"])
            out.append(f"  - defaults' training probes that ran, in order (samples: seconds): {timed}")
        notes = defaults.notes or ["(no AutoCheckpoint note)"]
        for note in notes:
            out.append(f"  - defaults decided: {note}")
        if defaults.peak is None:
            out.append("  - defaults' steady peak: not measured")
        else:
            within = "within L" if defaults.peak <= limit else "**OVER L**"
            sizes = "+".join(map(str, defaults.peak_sizes)) or "?"
            out.append(
                f"  - defaults' steady peak: {defaults.peak / MiB:.2f} MiB ({defaults.peak / limit:.2f} L): {within}"
                f" ({breakdown(defaults.breakdown)}; micro-batches {sizes})"
            )
            if defaults.predicted is not None:
                gap = defaults.predicted / defaults.peak - 1
                out.append(
                    f"  - defaults' peak predicted (AutoAccumulation, micro-batch run): "
                    f"{defaults.predicted / MiB:.2f} MiB, {gap:+.1%} of the measured"
                )
            if defaults.activations is not None:
                predicted, measured = defaults.activations
                out.append(
                    f"  - defaults' activations (AutoCheckpoint's plan, micro-batch run): predicted "
                    f"{predicted / MiB:.2f} MiB, measured {measured / MiB:.2f} MiB ({predicted / measured - 1:+.1%})"
                )
            if [n.split(":")[0] for n in defaults.peak_notes] != [n.split(":")[0] for n in defaults.notes]:
                for note in defaults.peak_notes or ["(no AutoCheckpoint note)"]:
                    out.append(f"    - that fit decided otherwise: {note}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--precision", default=None, help="the Trainer's precision (32-true; bf16-mixed on cuda)"
    )
    parser.add_argument("--quick", action="store_true", help="smaller models, batch 16, few steps")
    parser.add_argument("--only", nargs="+", metavar="MODEL", help="gpt llama gpt2 vit resnet")
    parser.add_argument("--batch", type=int, default=None, help="samples per optimizer step (48; quick 16)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="optimizer steps not counted (CPU 14, cuda 8: the defaults' trial, decision and plan)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds of alternation (4; quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps a way runs per round (2)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: the issue's Llama")
    parser.add_argument(
        "--layers", type=int, default=None, help="the transformers' layers (CPU 4, quick 2; cuda: 16)"
    )
    parser.add_argument("--seq", type=int, default=4096, help="cuda: tokens a sequence (4,096)")
    parser.add_argument(
        "--micro",
        type=int,
        nargs=2,
        metavar=("PLAIN", "FULL"),
        help="the manual ways' micro-batches as an earlier run found them (no search)",
    )
    parser.add_argument("--cap-gib", type=float, default=None, help="cuda: cap the card at this many GiB")
    args = parser.parse_args()
    global DEVICE, CAP
    DEVICE = args.device
    if cuda():
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here")
        if args.cap_gib is not None:
            CAP = int(args.cap_gib * 2**30)
            total_memory = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, CAP / total_memory))
    args.precision = args.precision or ("bf16-mixed" if cuda() else "32-true")
    defaults = (
        dict(batch=16, warmup=8, rounds=1, steps=2)
        if args.quick
        else dict(batch=32, warmup=8, rounds=1, steps=4)
        if cuda()
        else dict(batch=48, warmup=14, rounds=4, steps=2)  # a trial: 3 ways x 4 rounds + the planning turn
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(threads)
    all_benches = gpu_benches(args.layers or 16, args.seq) if cuda() else benches(args.quick, args.layers)
    count_phases()
    names = args.only or list(all_benches)
    unknown = sorted(set(names) - set(all_benches))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(all_benches)}")
    results = []
    t0 = time.perf_counter()
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's and transformers' (the notes are caught inside)
            results.append(bench_model(name, all_benches[name], args))
    print(
        f"\ntorch {torch.__version__}, transformers {transformers.__version__}, lightning {pl.__version__}, "
        f"{threads} threads, precision {args.precision}, batch {args.batch}; s/step: median of "
        f"{args.rounds} rounds x {args.steps} optimizer steps after {args.warmup} warm-up steps per way, "
        f"ways alternated{' (--quick)' if args.quick else ''}; {time.perf_counter() - t0:.0f} s in all\n"
    )
    print(table(results, args))
    print()
    print(details(results))


if __name__ == "__main__":
    main()
