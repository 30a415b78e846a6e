"""Activation checkpointing benchmark: bytes, FLOPs and CPU step time of checkpointing plans.

For each model: no checkpointing, full checkpointing of every block, every 2nd block, op-level selective
on every block, and the planner at budgets of 25/40/45/50/75% of the blocks' activations without
checkpointing, next to the optimum found by brute force for the same budgets. Offload is left out of
the executed plans: on this CPU-only machine it copies to the same memory (the planner-only brute-force
check includes it).

Columns:
- ``acts pred/meas``: bytes the blocks hold for backward, predicted by the plan / measured with
  MemoryTracker (ActivationMeter) during the step, and their difference.
- ``peak``: MemoryTracker peak of live tensor bytes created during the step (forward + backward), and
  its ratio to no checkpointing.
- ``GFLOP``: forward + backward FLOPs of matmul-class ops (FlopCounterMode's formulas; CPU attention
  included), and the ratio.
- ``time``: best-of-N wall time of forward + backward (N rounds, each timing every configuration once),
  as a ratio to no checkpointing in the same process (ratios, never absolute times). Run it on an
  otherwise idle machine.
- ``blk pk``: the plan's predicted peak of the blocks' activations (end of forward, or while a
  checkpointed block recomputes in backward: what the budget bounds); ``peak`` minus it is the rest of
  the step (parameters, gradients, embeddings, logits), about constant across plans.
- ``gap``: the plan's cost minus the brute-force optimum's (0 means optimal), for 3 and 4 treatments.

Run from the repository root (a few minutes on 2 cores)::

    PYTHONPATH=. python benchmarks/checkpointing.py            # all models, incl. the issue's GPT-2 once
    PYTHONPATH=. python benchmarks/checkpointing.py --quick    # small models only
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt.checkpointing import (
    ActivationMeter,
    CostModel,
    InfeasibleBudgetError,
    apply_checkpointing,
    brute_force_plan,
    evaluate_plan,
    find_blocks,
    plan_checkpointing,
    profile_blocks,
)
from lightning_memopt.checkpointing.profile import _OpCounter

MB = 1e6


# ---------------------------------------------------------------------------------------------- models
class GPTBlock(nn.Module):
    """nanoGPT's block (its flash path: scaled_dot_product_attention)."""

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
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer: int, h: int, heads: int, seq: int, vocab: int = 256) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.h = nn.ModuleList(GPTBlock(h, heads) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class ViT(nn.Module):
    def __init__(
        self, depth: int = 6, dim: int = 192, heads: int = 3, image: int = 64, patch: int = 4
    ) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2, dim))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(depth)
        )
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos  # (B, N, dim)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


class Bottleneck(nn.Module):
    def __init__(self, c: int, mid: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(x + self.bn3(self.conv3(y)))


class ResNet(nn.Module):
    def __init__(self, blocks: int = 6, c: int = 128, mid: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.layer1 = nn.Sequential(*[Bottleneck(c, mid) for _ in range(blocks)])
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(self.layer1(self.stem(x)).mean(dim=(2, 3)))


def models(quick: bool, gpt2: bool):
    g = torch.Generator().manual_seed(0)
    out = [
        (
            "gpt-small 6L h128 s256 b4",
            lambda: GPT(6, 128, 4, 256),
            torch.randint(0, 256, (4, 256), generator=g),
            5,
        ),
        ("vit 6L d192 64px b8", lambda: ViT(), torch.randn(8, 3, 64, 64, generator=g), 5),
        ("resnet 6x bottleneck 32px b8", lambda: ResNet(), torch.randn(8, 3, 32, 32, generator=g), 5),
    ]
    if not quick:
        out.append(
            (
                "gpt-larger 12L h256 s256 b4",
                lambda: GPT(12, 256, 4, 256),
                torch.randint(0, 256, (4, 256), generator=g),
                2,
            )
        )
    if gpt2:
        # The configuration: GPT-2 style, 8 layers, h=256, s=512, b=4, fp32. Three timed steps each.
        out.append(
            (
                "gpt2-issue 8L h256 s512 b4",
                lambda: GPT(8, 256, 4, 512),
                torch.randint(0, 256, (4, 512), generator=g),
                3,
            )
        )
    return out


# ---------------------------------------------------------------------------------------------- measuring
def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def calibrate() -> CostModel:
    """This CPU's FLOPs per byte moved: matmul FLOP/s over elementwise-add bytes/s."""
    a = torch.randn(1024, 1024)
    b = torch.randn(16 * 2**20)

    def best(fn, n=5):
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    flops_per_s = 2 * 1024**3 / best(lambda: a @ a)
    bytes_per_s = 3 * b.numel() * 4 / best(lambda: b + b)
    return CostModel(pointwise_flops_per_byte=flops_per_s / bytes_per_s)


def measure(model, x, blocks):
    """(block activation bytes, peak bytes of the step, fwd+bwd FLOPs) of one step."""
    model.zero_grad(set_to_none=True)
    with ActivationMeter(model, blocks) as meter:
        before = meter.tracker.current
        meter.tracker.reset_peak()
        loss_of(model(x)).backward()
        peak = meter.tracker.peak - before
    model.zero_grad(set_to_none=True)
    counter = _OpCounter()
    with counter:
        loss_of(model(x)).backward()
    return meter.total, peak, counter.flops


def step_time(model, x) -> float:
    """Wall-clock seconds of one step (forward + backward). Run on an otherwise idle machine: CPU time
    would charge the idle spinning of the second thread during small pointwise ops as work."""
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    loss_of(model(x)).backward()
    return time.perf_counter() - t


def summary(choices) -> str:
    counts = {c: list(choices).count(c) for c in ("keep", "selective", "full", "offload")}
    return " ".join(f"{c[0].upper()}{n}" for c, n in counts.items() if n)


def run_model(name, build, x, reps, cost_model, brute_limit):
    torch.manual_seed(0)
    model = build()
    blocks = find_blocks(model)
    names = [n for n, _ in blocks]
    n = len(blocks)
    t0 = time.perf_counter()
    profiles = profile_blocks(model, blocks, x)
    t_profile = time.perf_counter() - t0
    baseline = evaluate_plan(profiles, ["keep"] * n).activation_bytes
    executed = ["keep", "selective", "full"]
    configs = [
        ("none", ["keep"] * n, None),
        ("full every block", ["full"] * n, None),
        ("every 2nd (full)", ["full" if i % 2 == 0 else "keep" for i in range(n)], None),
        ("selective every block", ["selective"] * n, None),
    ]
    notes = []
    for frac in (0.25, 0.40, 0.45, 0.50, 0.75):
        budget = int(frac * baseline)
        try:
            plan = plan_checkpointing(profiles, budget, allowed=executed, cost_model=cost_model)
        except InfeasibleBudgetError as err:
            notes.append(
                f"auto {frac:.0%} budget ({budget / MB:.1f} MB): infeasible, smallest is {err.minimum / MB:.1f} MB"
            )
            continue
        gaps = []
        for allowed in (executed, ["keep", "selective", "full", "offload"]):
            if frac not in (0.25, 0.50, 0.75):
                gaps.append("-")  # the brute-force check runs at the three budgets only
                continue
            if len(allowed) ** n > brute_limit:
                gaps.append("n/a")
                continue
            ours = (
                plan
                if allowed is executed
                else plan_checkpointing(profiles, budget, allowed=allowed, cost_model=cost_model)
            )
            brute = brute_force_plan(profiles, budget, allowed=allowed, cost_model=cost_model)
            gaps.append(f"{ours.cost - brute.cost:.0f}")
        configs.append((f"auto {frac:.0%} budget", list(plan.choices.values()), "/".join(gaps)))

    print(f"\n## {name}: {n} blocks ({names[0]} .. {names[-1]}), profiled in {t_profile:.1f}s")
    print(
        f"   blocks' activations without checkpointing: {baseline / MB:.1f} MB; "
        f"parameters: {sum(p.numel() * 4 for p in model.parameters()) / MB:.1f} MB"
    )
    header = (
        f"   {'config':<22} {'plan':<12} {'acts pred/meas MB':>19} {'err':>6} {'blk pk':>7} {'peak MB':>9} {'x':>5} "
        f"{'GFLOP':>8} {'x':>5} {'time x':>7} {'gap 3/4':>8}"
    )
    print(header)
    print("   " + "-" * (len(header) - 3))
    results = []
    for _label, choices, _gap in configs:
        apply_checkpointing(model, dict(zip(names, choices)))
        results.append(measure(model, x, blocks))
    # Time in rounds, every configuration once per round, best of the rounds: on a shared machine this is
    # fairer than timing one configuration after another.
    times = [[] for _ in configs]
    for _ in range(reps):
        for i, (_, choices, _) in enumerate(configs):
            apply_checkpointing(model, dict(zip(names, choices)))
            times[i].append(step_time(model, x))
    ref_peak, ref_flops, ref_time = results[0][1], results[0][2], min(times[0])
    for (label, choices, gap), (acts, peak, flops), secs in zip(configs, results, times):
        predicted = evaluate_plan(profiles, choices, cost_model)
        err = (acts - predicted.activation_bytes) / max(predicted.activation_bytes, 1)
        print(
            f"   {label:<22} {summary(choices):<12} {predicted.activation_bytes / MB:>9.1f}/{acts / MB:<9.1f} "
            f"{err:>+6.1%} {predicted.peak_bytes / MB:>7.1f} {peak / MB:>9.1f} {peak / ref_peak:>5.2f} {flops / 1e9:>8.2f} {flops / ref_flops:>5.2f} "
            f"{min(secs) / ref_time:>7.2f} {gap or '':>8}"
        )
    for note in notes:
        print("   " + note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models only")
    parser.add_argument("--no-gpt2", action="store_true", help="skip the issue's GPT-2 configuration")
    parser.add_argument("--brute-limit", type=int, default=600_000, help="largest brute-force search")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    cost_model = calibrate()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; cost model: recomputed pointwise ops cost "
        f"{cost_model.pointwise_flops_per_byte:.1f} FLOP per byte moved (measured: matmul FLOP/s / add B/s)"
    )
    for name, build, x, reps in models(args.quick, gpt2=not (args.quick or args.no_gpt2)):
        run_model(name, build, x, reps, cost_model, args.brute_limit)


if __name__ == "__main__":
    main()
