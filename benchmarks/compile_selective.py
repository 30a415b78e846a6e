"""Does torch.compile remove op-level selective checkpointing's dispatch cost? (CPU, the small GPT.)

Eager, torch's selective checkpointing calls a Python policy on every op of the forward and replays the
block's Python in backward; compiled, the policy is applied once while tracing and the step runs the
partitioned graph. This script times keep, op-level selective (torch's ``create_selective_checkpoint_contexts``
with a policy that saves the outputs of compute ops, as ``selective`` does) and full checkpointing on
every block of the benchmark's 6-layer GPT, eager and compiled, as ratios to keep in the same mode:
9 alternated rounds, one thread, the process's CPU time, median [q25-q75]. It also prints the largest
gradient difference of each compiled configuration from eager keep.

Run from the repository root (a few minutes: three compilations, inductor needs a C++ compiler)::

    PYTHONPATH=. python benchmarks/compile_selective.py
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from benchmarks.checkpointing import GPT
from lightning_memopt.checkpointing.apply import is_compute_op

MODES = ("keep", "selective", "full")


def policy(ctx, op, *args, **kwargs):
    """Save what ``selective`` caches (outputs of matmul, convolution, attention); recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if is_compute_op(op) else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module, mode: str) -> None:
        super().__init__()
        self.block, self.mode = block, mode

    def forward(self, x):
        if self.mode == "keep":
            return self.block(x)
        if self.mode == "full":
            return checkpoint(self.block, x, use_reentrant=False)
        contexts = functools.partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=contexts)


def build(mode: str, compiled: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(6, 128, 4, 256)
    model.h = torch.nn.ModuleList(Checkpointed(b, mode) for b in model.h)
    return torch.compile(model) if compiled else model


def step(model, batch) -> float:
    model.zero_grad(set_to_none=True)
    start = time.process_time()
    model(batch).backward()
    return time.process_time() - start


def main() -> None:
    torch.set_num_threads(1)
    batch = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(0))
    models = {}
    for compiled in (False, True):
        for mode in MODES:
            models[mode, compiled] = model = build(mode, compiled)
            step(model, batch), step(model, batch)  # compile, warm up
    reference = models["keep", False]
    step(reference, batch)
    for mode in MODES:
        model = models[mode, True]
        step(model, batch)
        diff = max(
            (a.grad - b.grad).abs().max().item() for a, b in zip(reference.parameters(), model.parameters())
        )
        print(f"compiled {mode}: largest gradient difference from eager keep {diff:.1e}")
    times = {key: [] for key in models}
    for _ in range(9):
        for key, model in models.items():
            times[key].append(step(model, batch))
    print("\n| mode | plan | time x [IQR] | ms per step |\n|---|---|---|---|")
    for compiled in (False, True):
        for mode in MODES:
            ratios = [a / b for a, b in zip(times[mode, compiled], times["keep", compiled])]
            q25, _, q75 = statistics.quantiles(ratios, n=4, method="inclusive")
            ms = statistics.median(times[mode, compiled]) * 1e3
            label = "compiled" if compiled else "eager"
            print(
                f"| {label} | {mode} every block | {statistics.median(ratios):.2f} [{q25:.2f}-{q75:.2f}] | {ms:.0f} |"
            )


if __name__ == "__main__":
    main()
