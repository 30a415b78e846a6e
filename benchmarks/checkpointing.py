"""Activation checkpointing benchmark: plans ranked by the step time users pay, with ties where it is noise.

For each model: no checkpointing, the simple plans a user writes by hand (full checkpointing of every
n-th block for n = 1, 2, 3; op-level selective on every block; the pointwise treatment on every block)
and AutoCheckpoint's planner at 25%, 50% and 75% of the blocks' activations without checkpointing. The
planner profiles the blocks with their treatments timed on the same clock the benchmark measures with, so
its plans are priced in seconds.

Timing (what makes plans comparable on a shared machine): every configuration runs one warm-up step,
then ``--reps`` rounds (default 5) in which every configuration runs one step, the order rotated each
round; a step's time is taken as a ratio to the no-checkpointing step of the same round, and each
configuration reports the median ratio and its interquartile range [q25-q75]. Two configurations differ
*measurably* only where their ranges do not overlap; otherwise it is a tie. The clock is the process's
CPU time with one thread by default (``--clock wall`` for wall time): other processes on the machine then
slow the measurement down much less than they slow the wall clock, and a single thread has no idle
spinning to count. On Linux the C allocator is told to keep the memory the process frees (``mallopt``: no
trimming of the heap, no ``mmap`` below 32 MiB), as CUDA's caching allocator keeps it: a training run on
one plan reaches that steady state by itself (no page faults after its third step), but configurations
taking turns do not: glibc gives back what a plan holding less left free, and no checkpointing then
pays 5,000-27,000 page faults a step (HF GPT-2 8L, the baseline every ratio is taken over) to take it
again, a cost of the benchmark's alternation alone (``--malloc default`` leaves the allocator as it is).

Columns: ``peak x``: MemoryTracker peak of live bytes in the step (forward + backward) over no
checkpointing's; ``FLOPs x``: forward + backward FLOPs of compute ops (FlopCounterMode's formulas, CPU
attention included); ``time x``: median [q25-q75] step-time ratio; ``pred x``: the planner's predicted
ratio, ``1 + plan.seconds / t`` where ``t`` is the median no-checkpointing step (the profile's per-block
timings summed; for auto plans the error against the measured median is given). Plans read ``K`` keep,
``S`` selective, ``F`` full, ``P`` pointwise. An auto plan is *dominated* by a simple plan that fits the
same share (the plan's predicted peak of the blocks), holds no more memory (measured peak) and is
measurably faster. The blocks' activation bytes each plan predicts are checked against MemoryTracker's.

Run from the repository root (about 10 minutes on 2 cores; ``--quick``: three small models)::

    PYTHONPATH=. python benchmarks/checkpointing.py
    PYTHONPATH=. python benchmarks/checkpointing.py --quick

On a CUDA device (``--device cuda``) the models are sized as GPUs train them (GPT 12 layers width 1024
sequence 1024, GPT-2 small, ViT-Base, ConvNeXt-Tiny, ResNet-50 at 224 px), run under bf16 autocast,
offload is weighed too, and the clock is CUDA events (a few minutes on an H100)::

    PYTHONPATH=. python benchmarks/checkpointing.py --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt.checkpointing import (
    ActivationMeter,
    NoPlanFitsError,
    apply_checkpointing,
    evaluate_plan,
    find_blocks,
    initial_choices,
    plan_checkpointing,
    profile_blocks,
)
from lightning_memopt.checkpointing.flops import OpCounter
from lightning_memopt.data.clock import HostClock, step_clock

TREATMENTS = ["keep", "selective", "full", "pointwise"]  # offload copies to the same memory on a CPU
BUDGETS = (0.25, 0.50, 0.75)


# ---------------------------------------------------------------------------------------------- models
class GPTBlock(nn.Module):
    """nanoGPT's block (its flash path: scaled_dot_product_attention); the GELU is functional."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.c_fc, self.mlp_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (
            t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v)
        )  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """The project's own GPT (the issue's "GPT benchmark models")."""

    def __init__(self, n_layer: int, h: int, heads: int, seq: int, vocab: int = 256) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.h = nn.ModuleList(GPTBlock(h, heads) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


class HFLoss(nn.Module):
    """A transformers model whose forward returns its own loss (labels in the batch)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return self.model(**batch).loss


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def hf_gpt2(layers: int = 8, h: int = 256, seq: int = 256, b: int = 4):
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=256, n_layer=layers, n_embd=h, n_head=4, n_positions=seq, use_cache=False, bos_token_id=0
    )
    cfg.eos_token_id = 0
    ids = torch.randint(0, 256, (b, seq), generator=_gen())
    return HFLoss(transformers.GPT2LMHeadModel(cfg)), {"input_ids": ids, "labels": ids}


def hf_vit(layers: int = 6, dim: int = 192, image: int = 64, b: int = 8, patch: int = 4, heads: int = 3):
    import transformers

    cfg = transformers.ViTConfig(
        image_size=image,
        patch_size=patch,
        hidden_size=dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * dim,
        num_labels=10,
    )
    batch = {
        "pixel_values": torch.randn(b, 3, image, image, generator=_gen()),
        "labels": torch.arange(b) % 10,
    }
    return HFLoss(transformers.ViTForImageClassification(cfg)), batch


def hf_convnext(image: int = 64, b: int = 8, hidden=(48, 96, 192, 384), depths=(2, 2, 4, 2)):
    import transformers

    cfg = transformers.ConvNextConfig(hidden_sizes=list(hidden), depths=list(depths), num_labels=10)
    batch = {
        "pixel_values": torch.randn(b, 3, image, image, generator=_gen()),
        "labels": torch.arange(b) % 10,
    }
    return HFLoss(transformers.ConvNextForImageClassification(cfg)), batch


def hf_resnet(image: int = 64, b: int = 8, stem: int = 32, hidden=(64, 128, 256, 512), depths=(2, 2, 2, 2)):
    import transformers

    cfg = transformers.ResNetConfig(
        embedding_size=stem,
        hidden_sizes=list(hidden),
        depths=list(depths),
        layer_type="bottleneck",
        num_labels=10,
    )
    batch = {
        "pixel_values": torch.randn(b, 3, image, image, generator=_gen()),
        "labels": torch.arange(b) % 10,
    }
    return HFLoss(transformers.ResNetForImageClassification(cfg)), batch


@dataclass
class Bench:
    name: str
    build: Callable[[], tuple[nn.Module, object]]


def benches(quick: bool, device: str = "cpu") -> list[Bench]:
    ids = lambda seq, b=4: torch.randint(0, 256, (b, seq), generator=_gen())  # noqa: E731
    if device == "cuda":  # sizes a GPU is used at (bf16-mixed): the CPU's models are launch-bound there
        return [
            Bench("gpt 12L h1024 s1024 b8", lambda: (GPT(12, 1024, 16, 1024), ids(1024, 8))),
            Bench("hf-gpt2 12L h768 s1024 b8", lambda: hf_gpt2(12, 768, 1024, 8)),
            Bench("hf-vit-base 12L d768 224px/16 b64", lambda: hf_vit(12, 768, 224, 64, patch=16, heads=12)),
            Bench(
                "hf-convnext-tiny 224px b64",
                lambda: hf_convnext(224, 64, (96, 192, 384, 768), (3, 3, 9, 3)),
            ),
            Bench(
                "hf-resnet50 224px b64",
                lambda: hf_resnet(224, 64, 64, (256, 512, 1024, 2048), (3, 4, 6, 3)),
            ),
        ][: 2 if quick else None]
    small = [
        Bench("gpt-small 6L h128 s256 b4", lambda: (GPT(6, 128, 4, 256), ids(256))),
        Bench("hf-vit 6L d192 64px b8", lambda: hf_vit()),
        Bench("hf-convnext 2-2-4-2 64px b8", lambda: hf_convnext()),
    ]
    if quick:
        return small
    return small[:1] + [
        Bench("gpt-larger 12L h256 s256 b4", lambda: (GPT(12, 256, 4, 256), ids(256))),
        Bench("hf-gpt2 8L h256 s256 b4", lambda: hf_gpt2()),
        *small[1:],
        Bench("hf-resnet50-like 2-2-2-2 64px b8", lambda: hf_resnet()),
    ]


# ---------------------------------------------------------------------------------------------- measuring
class ProcessClock:
    """The process's CPU seconds (a :class:`~lightning_memopt.data.clock.Clock`): less disturbed than wall
    time by the other processes of a shared machine."""

    def mark(self) -> float:
        return time.process_time()

    def settle(self, last: float) -> None:
        """Readable at once."""

    def seconds(self, start: float, end: float) -> float:
        return end - start


def keep_freed_memory() -> bool:
    """glibc keeps what the process frees (the benchmark's docstring says why); False where the C library
    is not glibc's or refuses."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(
        libc.mallopt(m_trim_threshold, (1 << 31) - 1)
    )


@dataclass
class Device:
    """Where the benchmark runs: the treatments weighed there and the precision context (bf16-mixed on
    CUDA, as Lightning's ``precision="bf16-mixed"``; full precision on CPU)."""

    type: str = "cpu"

    @property
    def treatments(self) -> list[str]:
        return TREATMENTS + ["offload"] if self.type == "cuda" else TREATMENTS

    def context(self):
        if self.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


DEVICE = Device()


def loss_of(model: nn.Module, batch) -> torch.Tensor:
    with DEVICE.context():
        return model(**batch) if isinstance(batch, dict) else model(batch)


def measure(model, batch, blocks) -> tuple[int, int, int]:
    """(blocks' activation bytes, peak bytes of the step, forward + backward FLOPs) of one step."""
    model.zero_grad(set_to_none=True)
    with ActivationMeter(model, blocks) as meter:
        before = meter.tracker.current
        meter.tracker.reset_peak()
        loss_of(model, batch).backward()
        peak = meter.tracker.peak - before
    model.zero_grad(set_to_none=True)
    with OpCounter() as counter:
        loss_of(model, batch).backward()
    return meter.total, peak, counter.flops


def step_time(model, batch, clock, launched: list[float] | None = None) -> float:
    """Seconds of one step on ``clock``; where ``launched`` is given, the host's seconds from the step's
    start to the last op launched are appended to it (on CUDA: how long Python takes to launch the step,
    waits included where the step synchronizes; close to the device's seconds, the step is launch-bound)."""
    model.zero_grad(set_to_none=True)
    host = time.perf_counter()
    start = clock.mark()
    loss_of(model, batch).backward()
    end = clock.mark()
    if launched is not None:
        launched.append(time.perf_counter() - host)
    clock.settle(end)
    return clock.seconds(start, end)


@dataclass
class Spread:
    median: float
    q25: float
    q75: float

    @classmethod
    def of(cls, ratios: list[float]) -> Spread:
        q25, _, q75 = statistics.quantiles(ratios, n=4, method="inclusive")
        return cls(statistics.median(ratios), q25, q75)

    def faster_than(self, other: Spread) -> bool:
        """Measurably: the ranges do not overlap."""
        return self.q75 < other.q25

    def __str__(self) -> str:
        return f"{self.median:.2f} [{self.q25:.2f}-{self.q75:.2f}]"


@dataclass
class Row:
    label: str
    choices: list[str]
    share: int | None = None  # auto plans: the blocks' share in bytes
    simple: bool = False
    acts: int = 0
    peak: int = 0
    flops: int = 0
    times: Spread | None = None
    predicted: float = 0.0
    block_peak: int = 0  # the plan's predicted peak of the blocks' activations (what a share bounds)


def summary(choices) -> str:
    return " ".join(
        f"{c[0].upper()}{choices.count(c)}"
        for c in ("keep", "selective", "full", "pointwise", "offload")
        if c in choices
    )


def configurations(names, profiles) -> list[Row]:
    n = len(names)
    rows = [Row("none", ["keep"] * n)]
    for every in (1, 2, 3):
        label = (
            "full every block" if every == 1 else f"full every {every}{'nd' if every == 2 else 'rd'} block"
        )
        rows.append(Row(label, list(initial_choices(names, "every_n", every).values()), simple=True))
    rows.append(Row("selective every block", ["selective"] * n, simple=True))
    rows.append(Row("pointwise every block", ["pointwise"] * n, simple=True))
    if "offload" in DEVICE.treatments:
        rows.append(Row("offload every block", ["offload"] * n, simple=True))
    baseline = evaluate_plan(profiles, ["keep"] * n).activation_bytes
    for frac in BUDGETS:
        share = int(frac * baseline)
        try:
            plan = plan_checkpointing(profiles, share, allowed=DEVICE.treatments)
        except NoPlanFitsError as err:
            print(f"   auto {frac:.0%} share: infeasible, the least peak is {err.minimum / 1e6:.1f} MB")
            continue
        choices = list(plan.choices.values())
        rows.append(Row(f"auto {frac:.0%} share ({summary(choices)})", choices, share))
    return rows


def timed(model, batch, names, rows, clock, reps) -> tuple[float, float]:
    """Set every row's median and IQR of its step time over no checkpointing's in the same round; return
    the median seconds of the no-checkpointing step (rows[0]) and the median host seconds of launching it."""
    for row in rows:  # warm-up: allocator, selective's and pointwise's dry runs
        apply_checkpointing(model, dict(zip(names, row.choices)))
        step_time(model, batch, clock)
    ratios: list[list[float]] = [[] for _ in rows]
    keep: list[float] = []
    launched: list[float] = []
    for r in range(reps):
        order = list(range(len(rows)))
        order = order[r % len(rows) :] + order[: r % len(rows)]  # rotated: no row always follows another
        seconds = [0.0] * len(rows)
        for i in order:
            apply_checkpointing(model, dict(zip(names, rows[i].choices)))
            seconds[i] = step_time(model, batch, clock, launched if i == 0 else None)
        for i, s in enumerate(seconds):
            ratios[i].append(s / seconds[0])
        keep.append(seconds[0])
    for row, rs in zip(rows, ratios):
        row.times = Spread.of(rs)
    return statistics.median(keep), statistics.median(launched)


def run_model(bench: Bench, clock, reps: int) -> list[Row]:
    torch.manual_seed(0)
    model, batch = bench.build()
    model.to(DEVICE.type).train()
    batch = (
        {k: v.to(DEVICE.type) for k, v in batch.items()} if isinstance(batch, dict) else batch.to(DEVICE.type)
    )
    blocks = find_blocks(model)
    names = [n for n, _ in blocks]
    args, kwargs = ((), batch) if isinstance(batch, dict) else ((batch,), {})
    start = time.perf_counter()
    profiles = profile_blocks(
        model, blocks, *args, choices=DEVICE.treatments, clock=clock, context=DEVICE.context, **kwargs
    )
    took = time.perf_counter() - start
    print(
        f"\n## {bench.name}: {len(blocks)} blocks ({names[0]} .. {names[-1]}), profiled and timed in {took:.1f}s"
    )
    rows = configurations(names, profiles)
    for row in rows:
        apply_checkpointing(model, dict(zip(names, row.choices)))
        row.acts, row.peak, row.flops = measure(model, batch, blocks)
    base, launch = timed(model, batch, names, rows, clock, reps)  # seconds of a step without checkpointing
    if DEVICE.type == "cuda":
        print(
            f"   no checkpointing: a step takes {base * 1e3:.1f} ms on the device, {launch * 1e3:.1f} ms to launch "
            "from Python (launch-bound where the two are close: then every Python call a treatment adds is paid)"
        )
    wrong = []
    for row in rows:
        plan = evaluate_plan(profiles, row.choices)
        row.predicted, row.block_peak = 1 + (plan.seconds or 0.0) / base, plan.peak_bytes
        if plan.activation_bytes != row.acts:
            wrong.append(f"{row.label}: predicted {plan.activation_bytes}, measured {row.acts}")
    print(
        "   blocks' activation bytes, predicted = measured: "
        + ("every plan" if not wrong else "; ".join(wrong))
    )
    return rows


def dominated(rows: list[Row]) -> dict[str, list[str]]:
    """Per auto row: the simple plans that dominate it (fit its share, hold no more memory, measurably
    faster), and those that tie (fit, no more memory, faster median inside the spread), marked ``~``."""
    out = {}
    for auto in (r for r in rows if r.share is not None):
        found = []
        for simple in (r for r in rows if r.simple):
            fits = simple.block_peak <= auto.share and simple.peak <= auto.peak
            if fits and simple.times.faster_than(auto.times):
                found.append(simple.label)
            elif fits and simple.times.median < auto.times.median:
                found.append("~" + simple.label)
        out[auto.label] = found
    return out


def report(name: str, rows: list[Row], lines: list[str]) -> None:
    """Print the model's table and append its rows to ``lines`` (the summary table)."""
    ref = rows[0]
    doms = dominated(rows)
    print(f"   {'plan':<34} {'peak x':>6} {'FLOPs x':>7} {'time x [IQR]':>19} {'pred x':>6}  note")
    for row in rows:
        note = ""
        if row.share is not None:
            hard = [d for d in doms[row.label] if not d.startswith("~")]
            ties = [d[1:] for d in doms[row.label] if d.startswith("~")]
            note = f"pred {row.predicted / row.times.median - 1:+.0%}"
            note += (f"; DOMINATED by {', '.join(hard)}" if hard else "") + (
                f"; ties {', '.join(ties)}" if ties else ""
            )
        cells = (
            f"{row.peak / ref.peak:.2f}",
            f"{row.flops / ref.flops:.2f}",
            str(row.times),
            f"{row.predicted:.2f}",
        )
        print(f"   {row.label:<34} {cells[0]:>6} {cells[1]:>7} {cells[2]:>19} {cells[3]:>6}  {note}")
        lines.append(f"| {name} | {row.label} | {' | '.join(cells)} | {note} |")


def goals(results: dict[str, list[Row]]) -> None:
    """The issue's numbers, from the rows measured."""
    autos = [(name, r) for name, rows in results.items() for r in rows if r.share is not None]
    errors = [r.predicted / r.times.median - 1 for _, r in autos]
    fifty = [
        f"{name.split()[0]} {r.times}"
        for name, r in autos
        if "gpt" in name and r.label.startswith("auto 50%")
    ]
    dominated_count = sum(
        any(not d.startswith("~") for d in dominated(rows)[r.label])
        for rows in results.values()
        for r in rows
        if r.share is not None
    )
    print("\n## Goals (issue 23)\n")
    print(f"- auto 50% share on the GPT models (goal <= 1.12x): {'; '.join(fifty)}")
    print(f"- auto plans dominated by a simpler plan (goal 0): {dominated_count} of {len(autos)}")
    worst = max(errors, key=abs) if errors else 0.0
    within = sum(abs(e) <= 0.10 for e in errors)
    print(
        f"- predicted vs measured step time (goal within 10%): {within} of {len(errors)} within, worst {worst:+.1%}"
    )
    for label in ("selective every block", "pointwise every block"):
        beyond = []
        for name, rows in results.items():
            row = next(r for r in rows if r.label == label)
            beyond.append(f"{name.split()[0]} {row.times.median - row.flops / rows[0].flops:+.0%}")
        print(f"- {label}, time beyond its FLOPs (of a step): {'; '.join(beyond)}")
    chosen = sum(r.choices.count("selective") for _, r in autos)
    blocks = sum(len(r.choices) for _, r in autos)
    print(
        f"- blocks the auto plans run selective (goal: selective <= 5% beyond FLOPs, or not chosen): {chosen} of {blocks}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="three small models")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per configuration (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--clock", choices=["process", "wall"], default="process", help="on CPU")
    parser.add_argument(
        "--malloc",
        choices=["keep", "default"],
        default="keep",
        help="on CPU: keep: the C allocator keeps freed memory (as CUDA's caching allocator); default: as it is",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: models at GPU sizes, bf16-mixed, offload weighed too, timed with CUDA events",
    )
    args = parser.parse_args()
    if args.reps < 2:
        parser.error(f"--reps must be at least 2 for a spread, got {args.reps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False)")
    DEVICE.type = args.device
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        clock, where = step_clock("cuda"), f"{torch.cuda.get_device_name()}, CUDA events, bf16-mixed"
    else:
        torch.set_num_threads(args.threads)
        clock = ProcessClock() if args.clock == "process" else HostClock()
        kept = args.malloc == "keep" and keep_freed_memory()
        where = f"{args.threads} thread(s), {args.clock} clock, allocator {'keeps freed memory' if kept else 'as it is'}"
    print(
        f"torch {torch.__version__}, {where}, {args.reps} rounds; "
        "planner priced in seconds timed on the same clock"
    )
    lines = [
        "| model | plan | peak x | FLOPs x | time x [IQR] | pred x | note |",
        "|---|---|---|---|---|---|---|",
    ]
    results = {}
    for bench in benches(args.quick, args.device):
        results[bench.name] = rows = run_model(bench, clock, args.reps)
        report(bench.name, rows, lines)
    print("\n## Summary (markdown)\n")
    print("\n".join(lines))
    goals(results)


if __name__ == "__main__":
    main()
