"""What the BatchNorm→GroupNorm swap changes, measured on CPU: prints one table.

    PYTHONPATH=$PWD python benchmarks/batchnorm_swap.py

Rows: how far micro-batching moves the gradient, how much a sample's output depends on its batch,
the output std of BatchNorm1d(4) on (N, C) inputs under our rule and under a group-per-channel rule,
bytes the conversion allocates and the state_dict bytes it removes (MemoryTracker, exact), and the
ratio of train-step times GroupNorm / BatchNorm (same process, median of repeats).
"""

import copy
import statistics
import time
import warnings

import torch
from torch import nn

from lightning_memopt.memory import MemoryTracker
from lightning_memopt.norm import convert_batchnorm


def cnn(width=32):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(2 * width * 8 * 8, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def grads(model, x, y, micro):
    model.zero_grad()
    for xs, ys in zip(x.split(micro), y.split(micro)):
        (nn.functional.cross_entropy(model(xs), ys) * len(ys) / len(y)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def step_time(model, x, y, repeats=15):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
    bn = cnn()
    gn = copy.deepcopy(bn)
    with MemoryTracker(gn) as tracker:
        before = tracker.current
        report = convert_batchnorm(gn, example_input=x[:2])
        allocated = tracker.peak - before
    unprobed = copy.deepcopy(bn)
    with MemoryTracker(unprobed) as tracker, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the BatchNorm1d-without-probe warning
        before_unprobed = tracker.current
        convert_batchnorm(unprobed)
        allocated_unprobed = tracker.peak - before_unprobed
    state_bytes = [sum(t.numel() * t.element_size() for t in m.state_dict().values()) for m in (bn, gn)]

    rows = [("layers converted", str(report).splitlines()[0])]
    for micro in (16, 4, 2, 1):
        cells = []
        for name, model in (("BatchNorm", bn), ("GroupNorm", gn)):
            try:
                cells.append(f"{name} {rel(grads(model, x, y, micro), grads(model, x, y, 32)):.2e}")
            except ValueError:  # BatchNorm1d refuses a batch of one in training
                cells.append(f"{name} fails")
        rows.append((f"grad rel. change, micro-batch {micro} vs 32", "   ".join(cells)))
    for name, model in (("BatchNorm", bn), ("GroupNorm", gn)):
        diff = (model(x[:2])[:1] - model(x)[:1]).abs().max().item()
        rows.append((f"{name}: max |out(x0 in batch of 2) - out(x0 in 32)|", f"{diff:.2e}"))
    feats = torch.randn(64, 4, generator=g) * 5 + 3
    ours = copy.deepcopy(nn.Sequential(nn.BatchNorm1d(4)))
    convert_batchnorm(ours, example_input=feats)
    rows.append(
        (
            "BatchNorm1d(4) on (64, 4): output std",
            f"GroupNorm(1, 4) (ours) {ours(feats).std().item():.3f}   "
            f"GroupNorm(4, 4) (group per channel) {nn.GroupNorm(4, 4)(feats).std().item():.1e}",
        )
    )
    rows.append(("peak bytes added by convert_batchnorm, no probe", f"{allocated_unprobed} B"))
    rows.append(("peak bytes added, with a probe forward of 2 samples", f"{allocated} B"))
    rows.append(("state_dict bytes BatchNorm -> GroupNorm", f"{state_bytes[0]} B -> {state_bytes[1]} B"))
    step_time(bn, x, y, 3), step_time(gn, x, y, 3)  # warm-up
    rows.append(
        ("train step time GroupNorm / BatchNorm (CPU)", f"{step_time(gn, x, y) / step_time(bn, x, y):.2f}")
    )

    width = max(len(r[0]) for r in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
