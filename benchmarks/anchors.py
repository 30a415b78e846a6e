"""The anchors for activation checkpointing, measured side by side on one transformer block (CPU).

    PYTHONPATH=. python benchmarks/anchors.py              # torch.compile through the aot_eager partitioner
    PYTHONPATH=. python benchmarks/anchors.py --inductor   # ... through inductor (slow to compile on CPU)

One nanoGPT block (the one in examples/gpt/gpt.py; h=256, 4 heads, T=256, B=8, fp32), one forward and
backward per row:

- ``eager``: no checkpointing.
- ``torch apply_activation_checkpointing``: torch's full-block wrapper (non-reentrant), what Lightning's
  FSDPStrategy ``activation_checkpointing_policy`` and Hugging Face ``gradient_checkpointing_enable()``
  do: recompute the whole block in backward.
- ``lightning_memopt full / selective``: the package's treatments of the same block
  (``apply_checkpointing``). No planner row: with one block, every recomputing plan peaks at the whole
  block's activations while its backward runs, so the planner's choices show on the multi-block models of
  ``checkpointing.py``.
- ``torch.compile activation_memory_budget=b``: torch's compile-time knob (min-cut partitioner),
  ``torch._functorch.config.activation_memory_budget``; 1.0 keeps what the compiled graph would save,
  0.0 recomputes as much as it can.

Columns: ``held``: bytes autograd holds for backward when the forward ends (parameters excluded), and
the ratio to eager; ``GFLOP``: forward+backward FLOPs (FlopCounterMode; not measurable inside compiled
code, whose dispatch modes fall back to eager); ``time``: best-of-N forward+backward wall time (interleaved rounds,
after a warm-up) as a ratio to eager, in this process (the machine may be shared: ratios only).

How ``held`` is measured: eager and the package's rows with the package's ``ActivationMeter`` (a
MemoryTracker; it also sees tensors that selective checkpointing caches outside saved-tensor hooks);
torch's rows with a ``saved_tensors_hooks`` counter of unique storages (the tracker's dispatch mode would
make compiled code fall back to eager). Both give the same bytes on the eager row (printed).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch._functorch.config as functorch_config
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.utils.flop_counter import FlopCounterMode

from lightning_memopt.checkpointing import (
    ActivationMeter,
    apply_checkpointing,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "gpt"))
from gpt import Block  # noqa: E402

H, HEADS, T, B = 256, 4, 256, 8
MB = 1e6


class OneBlock(torch.nn.Module):
    """The block inside a container, as models hold them (what ``find_blocks`` discovers)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(H, HEADS, 0.0)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)  # (B, T, H)


def held_by_hooks(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the unique storages autograd saves during one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return sum(seen.values())


def held_by_meter(model: torch.nn.Module, x: torch.Tensor) -> int:
    with ActivationMeter(model, [("block", model.blocks[0])]) as meter:
        out = model(x)
    del out
    return meter.total


def gflop(model: torch.nn.Module, x: torch.Tensor) -> float:
    with FlopCounterMode(display=False) as counter:
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 1e9


def best_time(model: torch.nn.Module, x: torch.Tensor, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        model(x).square().mean().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--inductor", action="store_true", help="compile with inductor (needs a C++ compiler)"
    )
    parser.add_argument("--reps", type=int, default=5, help="timed repeats per row (best is kept)")
    args = parser.parse_args()
    backend = "inductor" if args.inductor else "aot_eager_decomp_partition"

    torch.manual_seed(0)
    base = OneBlock()
    x = torch.randn(B, T, H, requires_grad=True)

    rows = []  # (name, held bytes, GFLOP or None, model)

    eager = copy.deepcopy(base)
    eager_held = held_by_meter(eager, x)
    hooks_held = held_by_hooks(eager, x)
    rows.append(("eager (no checkpointing)", eager_held, gflop(eager, x), eager))

    wrapped = copy.deepcopy(base)
    apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block))
    rows.append(
        ("torch apply_activation_checkpointing", held_by_hooks(wrapped, x), gflop(wrapped, x), wrapped)
    )

    for choice in ("full", "selective"):
        model = copy.deepcopy(base)
        apply_checkpointing(model, {"blocks.0": choice})
        rows.append((f"lightning_memopt {choice}", held_by_meter(model, x), gflop(model, x), model))

    for budget in (1.0, 0.5, 0.1, 0.0):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        with functorch_config.patch(activation_memory_budget=budget):
            compiled = torch.compile(model, backend=backend)
            start = time.perf_counter()
            compiled(x).square().mean().backward()  # compiles forward and backward
            compile_s = time.perf_counter() - start
            compiled.zero_grad(set_to_none=True)
            held = held_by_hooks(compiled, x)
            rows.append(
                (f"torch.compile budget={budget} ({backend}, {compile_s:.0f}s compile)", held, None, compiled)
            )

    # Timing: interleaved rounds (every variant once per round, after a warm-up), best per variant.
    times = [float("inf")] * len(rows)
    for _ in range(args.reps):
        for i, (_, _, _, model) in enumerate(rows):
            times[i] = min(times[i], best_time(model, x, 1))
    eager_flops = rows[0][2]
    print(f"Anchors on one GPT block (h={H}, heads={HEADS}, T={T}, B={B}, fp32, CPU); activations the eager")
    print(
        f"block holds: {eager_held / MB:.2f} MB by MemoryTracker, {hooks_held / MB:.2f} MB by saved-tensor hooks"
    )
    print()
    print("| variant | held for backward (MB) | held ratio | fwd+bwd GFLOP | FLOP ratio | time ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for (name, held, flops, _), t in zip(rows, times):
        flop_cells = f"{flops:.3f} | {flops / eager_flops:.3f}" if flops is not None else "n/a | n/a"
        print(f"| {name} | {held / MB:.2f} | {held / eager_held:.3f} | {flop_cells} | {t / times[0]:.2f} |")


if __name__ == "__main__":
    main()
