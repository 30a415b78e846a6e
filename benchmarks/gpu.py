"""Every claim of the package measured on a real CUDA device, in one command.

Prints six tables and writes them, with the device's name, to ``benchmarks/RESULTS-gpu.md``:

1. **plans**: for the GPT example (its YAML's size) and a Llama-style model of about 1B parameters
   (dim 2048, 16 layers, SwiGLU 5632, vocabulary 32000, sequence 4096, batch 1; rotary embeddings left
   out), at bf16-mixed (autocast bf16, fp32 parameters, as Lightning's ``bf16-mixed``): keep, full,
   selective, pointwise, offload (every block), and the planner's plans under 50% and 25% of the blocks'
   activations, every treatment timed on this device while profiling (CUDA events), so that plans are
   priced in measured seconds. ``pred peak`` is the measured
   peak of ``keep`` minus the keep plan's predicted block peak plus this plan's (the rest of the step —
   parameters, gradients, embeddings, logits — does not depend on the plan); ``meas peak`` is
   ``torch.cuda.max_memory_allocated`` over one step; ``err`` their difference over the measured.
   ``pred time`` is the planner's predicted step time over keep's (keep's measured step plus the plan's
   timed seconds beyond keep), ``time`` the measured median step time over keep's.
2. **AutoAccumulation**: its micro-batch size in a real fit (batch 32, AdamW) with ``headroom=0`` and the
   default, against the largest micro-batch that fits, found by bisection with real out-of-memory errors
   (a step of two micro-batches of that size, the second holding the gradients as a split step's later
   micro-batches do, and the AdamW step, in a fresh process state after ``empty_cache``); and the
   out-of-memory errors after sizing (the fit has no OOMBackoff: one would end it).
3. **OOMBackoff**: a fit whose batch is made to overflow the card (4x the largest that fits); the OOMs it
   recovered and ``torch.cuda.memory_allocated`` at every batch start, which must equal the first one's.
4. **offload**: the 1B model's activation bytes on the device at the end of the forward (after the copies
   have landed), the step's peak, the share of the blocks' activations that left the device, and the step
   time, for keep, full recompute, offload without overlap (the plain synchronous copy), the overlapped
   offload, and full recompute with the inputs it keeps offloaded (``offloading``).
5. **MemoryMonitor**: median step time of a fit with it over one without, fits alternated.

Run on a machine with a CUDA device, from the repository root::

    PYTHONPATH=. python benchmarks/gpu.py                 # everything (~10-20 min on an H100)
    PYTHONPATH=. python benchmarks/gpu.py --only offload  # one table: plans, sizing, backoff, offload, monitor
    PYTHONPATH=. python benchmarks/gpu.py --quick         # small models: a smoke run (~1 min)

Without a CUDA device it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt import AutoAccumulation, MemoryMonitor, OOMBackoff
from lightning_memopt.checkpointing import (
    NoPlanFitsError,
    apply_checkpointing,
    capture_block_inputs,
    evaluate_plan,
    find_blocks,
    plan_checkpointing,
    profile_blocks,
    remove_checkpointing,
)
from lightning_memopt.checkpointing import offload as offload_module
from lightning_memopt.checkpointing import planner as planner_module
from lightning_memopt.data.clock import step_clock
from lightning_memopt.memory import format_bytes

TREATMENTS = ("keep", "full", "selective", "pointwise", "offload")  # K F S P O in the plans' choices
SECTIONS = ("plans", "sizing", "backoff", "offload", "monitor")
RESULTS = Path(__file__).with_name("RESULTS-gpu.md")
NO_CUDA = "benchmarks/gpu.py measures on a CUDA device and none is available here (torch.cuda.is_available() is False)."


# --------------------------------------------------------------------------------------------- models
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, head_dim)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.gate, self.up = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))  # SwiGLU


class Llama(nn.Module):
    def __init__(self, *, dim: int, layers: int, heads: int, ffn: int, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))  # (B, T, vocab)


LLAMA_1B = dict(dim=2048, layers=16, heads=16, ffn=5632, vocab=32000)
LLAMA_SMALL = dict(dim=512, layers=4, heads=8, ffn=1408, vocab=32000)


def gpt_example() -> tuple[nn.Module, int]:
    """The GPT of examples/gpt at its YAML's size, and the vocabulary."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
    from gpt import GPT, VOCAB_SIZE

    return GPT(block_size=128, n_layer=4, n_head=4, n_embd=128, dropout=0.0), VOCAB_SIZE


# ---------------------------------------------------------------------------------------- measuring
def bf16():
    return torch.autocast("cuda", dtype=torch.bfloat16)


def loss_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with bf16():
        logits = model(idx)
    return F.cross_entropy(logits.float().flatten(0, 1), idx.flatten())


def step_stats(model: nn.Module, idx: torch.Tensor, reps: int) -> tuple[int, float]:
    """(peak bytes of one forward+backward, median seconds of ``reps`` of them after a warm-up)."""
    model.zero_grad(set_to_none=True)
    loss_of(model, idx).backward()  # warm-up: kernel choice, pinned pool, gradient buffers
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss_of(model, idx).backward()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return torch.cuda.max_memory_allocated(), statistics.median(times)


def held_after_forward(model: nn.Module, idx: torch.Tensor) -> int:
    """Bytes the forward leaves on the device for backward (after the offload copies have landed)."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = loss_of(model, idx)
    torch.cuda.synchronize()
    for offloader in offload_module._OFFLOADERS.values():
        offloader._retire(bound=-1)  # copies still in flight hold their tensors until they land
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    model.zero_grad(set_to_none=True)
    return held


def table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def fresh_memory() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


# ---------------------------------------------------------------------------------- 1 and 6: plans
def plans_table(name: str, model: nn.Module, idx: torch.Tensor, reps: int) -> list[tuple]:
    blocks = find_blocks(model)
    inputs = capture_block_inputs(model, blocks, idx, context=bf16)
    # every treatment timed on the device (CUDA events): the planner prices plans in these seconds
    profiles = profile_blocks(model, blocks, inputs=inputs, context=bf16, clock=step_clock(idx.device))
    cost_model = planner_module.measured_cost_model(idx.device)
    n = len(blocks)
    keep_plan = evaluate_plan(profiles, ["keep"] * n, cost_model)
    plans = {c: evaluate_plan(profiles, [c] * n, cost_model) for c in TREATMENTS}
    for share in (0.5, 0.25):
        try:
            plans[f"planned {share:.0%}"] = plan_checkpointing(
                profiles, int(share * keep_plan.peak_bytes), cost_model=cost_model
            )
        except NoPlanFitsError as e:  # below what any plan reaches: plan at that smallest peak
            plans[f"planned {share:.0%}: min"] = plan_checkpointing(
                profiles, e.minimum, cost_model=cost_model
            )
    rows = [("model", "plan", "choices", "pred peak", "meas peak", "err", "pred time", "time")]
    keep_peak = keep_time = None
    for label, plan in plans.items():
        apply_checkpointing(model, plan)
        fresh_memory()
        peak, seconds = step_stats(model, idx, reps)
        remove_checkpointing(model)
        if label == "keep":
            keep_peak, keep_time = peak, seconds
        predicted = keep_peak - keep_plan.peak_bytes + plan.peak_bytes
        counts = {c: list(plan.choices.values()).count(c) for c in TREATMENTS}
        rows.append(
            (
                name,
                label,
                " ".join(f"{c[0].upper()}{k}" for c, k in counts.items() if k),
                format_bytes(predicted),
                format_bytes(peak),
                f"{(predicted - peak) / peak:+.1%}",
                f"{1 + (plan.seconds or 0.0) / keep_time:.2f}x",
                f"{seconds / keep_time:.2f}x",
            )
        )
    return rows


def section_plans(args) -> str:
    rows = []
    gpt, vocab = gpt_example()
    idx = torch.randint(0, vocab, (16, 128), device="cuda")
    rows += plans_table("GPT example", gpt.cuda(), idx, args.reps)
    del gpt
    llama = Llama(**args.llama).cuda()
    idx = torch.randint(0, args.llama["vocab"], (1, args.seq), device="cuda")
    rows += plans_table(args.llama_name, llama, idx, args.reps)[1:]
    return table(rows)


# ------------------------------------------------------------------------- 2 and 3: sizing, backoff
def lightning_module(config: dict, seq: int):
    """A LightningModule class training a :class:`Llama` of ``config`` on random tokens of length ``seq``
    (set ``batch`` on the instance)."""

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Llama(**config)
            self.batch = 1

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.model(batch).float().flatten(0, 1), batch.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

        def train_dataloader(self):
            data = torch.randint(0, config["vocab"], (self.batch * 8, seq))
            return torch.utils.data.DataLoader(data, batch_size=self.batch)

    return LM


def fits(config: dict, seq: int, n: int) -> bool:
    """Whether an AdamW training step of two micro-batches of ``n`` samples fits, tried for real (after
    one step of 1 sample has created the optimizer state): a micro-batch of a split step, the second of
    which holds the gradients from its start."""
    fresh_memory()
    model = Llama(**config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    try:
        for sizes in ((1,), (n, n)):
            for size in sizes:
                idx = torch.randint(0, config["vocab"], (size, seq), device="cuda")
                loss_of(model, idx).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del model, opt
        fresh_memory()


def largest_fitting(config: dict, seq: int) -> int:
    low, high = 0, 1
    while fits(config, seq, high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(config, seq, mid) else (low, mid)
    return low


def fit(module, batch: int, callbacks: list, steps: int) -> None:
    module.batch = batch
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        precision="bf16-mixed",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module)


def section_sizing(args) -> tuple[str, int]:
    true_max = largest_fitting(args.llama, args.seq)
    rows = [("headroom", "AutoAccumulation size", "largest that fits", "ratio", "OOMs after sizing")]
    module_cls = lightning_module(args.llama, args.seq)
    for headroom in (0.0, 0.1):
        fresh_memory()
        callback = AutoAccumulation(headroom=headroom)
        sizes = Sample(callback, "micro_batch_size")
        error = "0"
        try:
            fit(module_cls(), 32, [callback, sizes], args.steps)
        except torch.OutOfMemoryError as e:
            error = f"1 ({str(e).splitlines()[0][:60]})"
        size = (sizes.values[-1] or 32) if sizes.values else None  # None: the whole batch of 32 ran unsplit
        ratio = f"{size / true_max:.2f}" if size and true_max else "-"
        rows.append((headroom, size, true_max, ratio, error))
    return table(rows), true_max


class Sample(L.Callback):
    """Records ``getattr(obj, attr)`` after every training batch, in ``values``."""

    def __init__(self, obj, attr: str) -> None:
        self.obj, self.attr, self.values = obj, attr, []

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.values.append(getattr(self.obj, self.attr))


def section_backoff(args, true_max: int) -> str:
    backoff = OOMBackoff()
    starts: list[int] = []
    retries: list[int] = []

    class Watch(L.Callback):
        def on_train_batch_start(self, *a, **k):
            torch.cuda.synchronize()
            starts.append(torch.cuda.memory_allocated())

        def on_train_batch_end(self, *a, **k):
            retries.append(backoff.engine.sizes.oom_retries if backoff.engine is not None else -1)

    fresh_memory()
    batch = 4 * max(true_max, 1)
    fit(lightning_module(args.llama, args.seq)(), batch, [backoff, Watch()], args.steps)
    rows = [("step", "allocated at start", "vs step 2", "OOMs recovered so far")]
    # step 1 starts before the optimizer state exists: every later start must equal step 2's
    base = starts[1] if len(starts) > 1 else starts[0]
    for i, (allocated, recovered) in enumerate(zip(starts, retries), start=1):
        rows.append((i, format_bytes(allocated), f"{allocated - base:+d} B", recovered))
    rows.append(("end", "", "", f"micro-batch {backoff.micro_batch_size}"))
    return f"batch {batch} (4x the largest that fits, {true_max})\n\n" + table(rows)


# ------------------------------------------------------------------------------------------ 4: offload
@contextlib.contextmanager
def without_overlap():
    """Make apply's ``offload`` take the plain synchronous copy (no side streams, per-tensor pinning)."""
    saved = offload_module.OFFLOAD_DEVICE_TYPES
    offload_module.OFFLOAD_DEVICE_TYPES = ()
    try:
        yield
    finally:
        offload_module.OFFLOAD_DEVICE_TYPES = saved


def section_offload(args) -> str:
    model = Llama(**args.llama).cuda()
    idx = torch.randint(0, args.llama["vocab"], (1, args.seq), device="cuda")
    blocks = find_blocks(model)
    profiles = profile_blocks(model, blocks, idx, context=bf16)
    block_bytes = evaluate_plan(profiles, ["keep"] * len(blocks)).activation_bytes
    configs = {
        "keep": ("keep", contextlib.nullcontext),
        "full": ("full", contextlib.nullcontext),
        "offload, no overlap": ("offload", without_overlap),
        "offload, overlapped": ("offload", contextlib.nullcontext),
        # full recompute, and the inputs it keeps offloaded (overlapped): the cheapest large saving
        "full + offload inputs": (
            "full",
            lambda: offload_module.offloading(
                [b for _, b in blocks], offload_module.offloader_for(idx.device)
            ),
        ),
    }
    rows = [("config", "acts on device", "blocks' acts off device", "step peak", "time")]
    held_keep = keep_time = None
    for label, (choice, context) in configs.items():
        apply_checkpointing(model, {name: choice for name, _ in blocks})
        with context():
            fresh_memory()
            held = held_after_forward(model, idx)
            peak, seconds = step_stats(model, idx, args.reps)
        remove_checkpointing(model)
        offload_module.release_offloaders()
        if label == "keep":
            held_keep, keep_time = held, seconds
        rows.append(
            (
                label,
                format_bytes(held),
                f"{(held_keep - held) / block_bytes:.0%}",
                format_bytes(peak),
                f"{seconds / keep_time:.2f}x",
            )
        )
    return f"blocks' activations (keep, predicted): {format_bytes(block_bytes)}\n\n" + table(rows)


# ------------------------------------------------------------------------------------------ 5: monitor
def section_monitor(args) -> str:
    times: dict[str, list[float]] = {"without": [], "with": []}

    class Timer(L.Callback):
        def __init__(self, key: str) -> None:
            self.key = key

        def on_train_batch_start(self, *a, **k):
            torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *a, **k):
            torch.cuda.synchronize()
            times[self.key].append(time.perf_counter() - self.start)

    module_cls = lightning_module(LLAMA_SMALL, 1024)
    for _ in range(args.rounds):
        for key in ("without", "with"):
            callbacks = [Timer(key)] + ([MemoryMonitor(log=False, report=False)] if key == "with" else [])
            fit(module_cls(), 8, callbacks, args.steps)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}  # the first step of a fit warms up
    rows = [("config", "median step", "ratio")]
    rows += [(k, f"{med[k] * 1000:.2f} ms", f"{med[k] / med['without']:.3f}") for k in ("without", "with")]
    return table(rows)


# --------------------------------------------------------------------------------------------- main
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", choices=SECTIONS, action="append", help="run only these tables (repeatable)"
    )
    parser.add_argument("--quick", action="store_true", help="small Llama and short runs: a smoke test")
    parser.add_argument(
        "--seq", type=int, default=None, help="sequence length (default 4096; 512 with --quick)"
    )
    parser.add_argument("--reps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--steps", type=int, default=6, help="training steps per Lightning fit")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternated fit pairs for the monitor's overhead"
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="the Markdown file to write")
    args = parser.parse_args(argv)
    args.llama = LLAMA_SMALL if args.quick else LLAMA_1B
    args.llama_name = "Llama small" if args.quick else "Llama 1B"
    args.seq = args.seq or (512 if args.quick else 4096)
    if args.quick:
        args.reps, args.steps, args.rounds = 3, 4, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    sections = args.only or list(SECTIONS)
    name = torch.cuda.get_device_name()
    out = [
        f"# GPU results: {name}",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by `benchmarks/gpu.py"
        f"{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`; torch {torch.__version__}, "
        f"{format_bytes(torch.cuda.get_device_properties(0).total_memory)}; bf16-mixed; "
        f"{args.llama_name} ({sum(p.numel() for p in Llama(**args.llama).parameters()) / 1e9:.2f}B parameters), "
        f"sequence {args.seq}.",
    ]
    true_max = None
    for section in sections:
        torch.manual_seed(0)
        if section == "plans":
            text = section_plans(args)
        elif section == "sizing":
            text, true_max = section_sizing(args)
        elif section == "backoff":
            text = section_backoff(
                args, true_max if true_max is not None else largest_fitting(args.llama, args.seq)
            )
        elif section == "offload":
            text = section_offload(args)
        else:
            text = section_monitor(args)
        print(f"\n## {section}\n\n{text}", flush=True)
        out += ["", f"## {section}", "", text]
    args.output.write_text("\n".join(out) + "\n")
    print(f"\nwritten to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
