"""Train the character-level GPT with Lightning Fabric and ``auto_checkpoint``: no LightningModule.

Run (from the repository root)::

    python examples/fabric/train.py                         # CPU or GPU, whichever Fabric picks
    python examples/fabric/train.py --max-memory 40MiB      # plan the least recompute that fits 40 MiB
    python examples/fabric/train.py --no-auto-checkpoint    # the same job without it

The model and the data are the GPT example's (``examples/gpt/gpt.py``: nanoGPT's blocks, trained on the
standard library's source code). ``auto_checkpoint`` is applied once, on the first batch, after the model
is on its device and before ``fabric.setup`` wraps it. One forward and backward of that batch is measured
with ``MemoryTracker`` before and after (live tensor bytes: the same on CPU and GPU), and the memory saved
is printed; then the loop trains ``--steps`` steps and prints the loss.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lightning_memopt.checkpointing as memopt
from lightning_memopt.memory import MemoryTracker, format_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))

from gpt import GPT, RandomWindows, stdlib_corpus  # noqa: E402


def parse_args(args: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128, help="context length in characters")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus size in bytes")
    parser.add_argument(
        "--max-memory", default=None, help="the step's limit, e.g. 40MiB (default: none on CPU)"
    )
    parser.add_argument("--headroom", type=float, default=0.1)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--no-auto-checkpoint", action="store_true", help="train without auto_checkpoint")
    return parser.parse_args(args)


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch  # (B, T), (B, T)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def step_peak(fabric: L.Fabric, model: torch.nn.Module, batch) -> int:
    """Peak live bytes of one forward and backward of ``batch`` (gradients dropped afterwards)."""
    with MemoryTracker(model) as tracker, fabric.autocast():
        loss_of(model, batch).backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak


def main(args: list[str] | None = None) -> dict:
    opts = parse_args(args)
    fabric = L.Fabric(accelerator=opts.accelerator, devices=1, precision=opts.precision)
    fabric.seed_everything(0)
    data = RandomWindows(stdlib_corpus(opts.max_bytes), opts.block_size, opts.steps * opts.batch_size, seed=0)
    loader = DataLoader(data, batch_size=opts.batch_size)
    size = dict(n_layer=opts.n_layer, n_head=opts.n_head, n_embd=opts.n_embd)
    model = GPT(block_size=opts.block_size, dropout=0.0, **size).to(fabric.device)
    first = fabric.to_device(next(iter(loader)))

    result: dict = {"peak_before": step_peak(fabric, model, first)}
    if not opts.no_auto_checkpoint:
        # After the model is on its device, before fabric.setup wraps it (DDP/FSDP wrap what they are given).
        handle = memopt.auto_checkpoint(
            model,
            lambda: loss_of(model, first),
            max_memory=opts.max_memory,
            headroom=opts.headroom,
            context=fabric.autocast,
        )
        fabric.print(f"auto_checkpoint plan ({handle.plan_limit()}):\n{handle.plan.table()}")
        result["plan"] = dict(handle.plan.choices)
    result["peak_after"] = step_peak(fabric, model, first)
    saved = 1 - result["peak_after"] / result["peak_before"]
    fabric.print(
        f"one step's peak: {format_bytes(result['peak_before'])} without, "
        f"{format_bytes(result['peak_after'])} with auto_checkpoint: {saved:.0%} saved"
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, optimizer = fabric.setup(model, optimizer)
    result["losses"] = []
    for step, batch in enumerate(fabric.setup_dataloaders(loader)):
        loss = loss_of(model, batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        result["losses"].append(loss.item())
        if step % 10 == 0 or step == opts.steps - 1:
            fabric.print(f"step {step}: loss {loss.item():.4f}")
    if not opts.no_auto_checkpoint:
        handle.remove()  # the model as it was: its blocks run their own forward again
    return result


if __name__ == "__main__":
    main()
