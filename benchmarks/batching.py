"""Micro-batch sizing against Lightning's BatchSizeFinder, and the engine's step-time overhead at k=1.

Run from the repository root (a few minutes on 2 CPU cores; never run by the test suite)::

    PYTHONPATH=. python benchmarks/batching.py
    PYTHONPATH=. python benchmarks/batching.py --sizing  # only find_micro_batch_size (a few seconds)

The simulated device. There is no GPU; memory is the live tensor bytes of one training step (forward,
backward, SGD step) of a small MLP, measured exactly by ``MemoryTracker``. A device of capacity C runs out
of memory exactly when that peak exceeds C. ``peak(n)`` grows with the batch n (and is convex: small
batches peak in the optimizer step, large ones in backward), so "peak(n) <= C" is "n <= true maximum",
and the out-of-memory errors are injected with ``OOMInjector(max_size=true maximum)`` in forward, which
is what BatchSizeFinder sees. The first cap is the issue's 300 samples (C = peak(300)); the others are
round byte sizes.

Rows:

- ``BatchSizeFinder power`` / ``binsearch``: Lightning's tuner (``Tuner.scale_batch_size``, default
  arguments: 3 steps per trial, start at 2, margin 0.05 in binsearch). Probe steps are training steps it
  ran, the ones that ran out of memory included.
- ``find_micro_batch_size``: this package's search called directly, ``probe(n) = peak(n)`` or None above
  C, ``headroom=0`` so that its target is the same true maximum, and with the default ``headroom=0.1``
  (its target is then the largest n with peak(n) <= 0.9 C, which is what the ratio is against).
- ``AutoAccumulation``: the real callback in a Lightning fit (batch 4096, ``max_memory=C``). It measures
  its probes itself (one forward and backward of a slice of the first batch, the whole batch alive), so
  its true maximum is computed with the same measurement (bisection over the engine's ``probe``). As the
  first batch (4096 samples, 557056 bytes) is alive in its measurement and not in the reference step's,
  its device is given C + 557056 bytes.

Random curves: ``find_micro_batch_size`` with ``max_probes=6`` on the seeded family of simulated memory
curves of ``tests/batching/curves.py`` (affine, convex, strongly convex with a quadratic part up to 5
times the per-sample part at the true maximum, kinked where the peak moves to a 1.5-6 times steeper phase,
kinked convex; true maximum 1 to ~5000; the batch at the true maximum or above it; headroom 0 or 0.1):
how many reach 97% of the true maximum, the worst ratio and the mean number of probes, per kind. Seed 0's
1,500 curves are the ones ``tests/batching/test_size_search.py`` asserts on.

Overhead: the time of a training step with the engine installed at k=1 (``AutoAccumulation`` with
``micro_batch_size`` = the batch size; ``OOMBackoff`` alone; ``AutoAccumulation`` with the engine's metric
logging really off) over the time without it, on the same model, fits interleaved in this process. The
machine is shared, so the minimum and 10th percentile of the pooled step times are printed next to the
median: they are the least disturbed by other processes.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import statistics
import time
import warnings

import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, Dataset

from lightning_memopt import AutoAccumulation, OOMBackoff
from lightning_memopt.batching import find_micro_batch_size
from lightning_memopt.memory import MemoryTracker, format_bytes
from lightning_memopt.testing import OOMInjector
from tests.batching.curves import KINDS, random_curves
from tests.batching.helpers import quiet_trainer

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
FEATURES, WIDTH, BATCH = 32, 128, 4096


class RandomData(Dataset):
    """Each sample its own small tensors, so a batch is a fresh storage (nothing big is shared)."""

    def __init__(self, length: int, features: int = FEATURES) -> None:
        self.length, self.features = length, features

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.features, generator=g), torch.randint(0, 2, (), generator=g)


class MLP(LightningModule):
    def __init__(self, batch_size: int = 2, width: int = WIDTH, features: int = FEATURES) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 2),
        )
        self.features = features

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(RandomData(16384, self.features), batch_size=self.batch_size)


def _trainer(callbacks=(), **kwargs) -> Trainer:
    return quiet_trainer(callbacks, **kwargs)


# ---------------------------------------------------------------------------------------- ground truth
_REFERENCE = MLP()
_REFERENCE_OPT = torch.optim.SGD(_REFERENCE.parameters(), lr=0.01)


@functools.cache
def peak(n: int) -> int:
    """Peak live bytes of one training step on n samples (the batch is on the device before it)."""
    x, y = torch.randn(n, FEATURES), torch.randint(0, 2, (n,))
    with MemoryTracker(_REFERENCE, _REFERENCE_OPT) as tracker:
        loss = _REFERENCE.training_step((x, y), 0)
        loss.backward()
        _REFERENCE_OPT.step()
        _REFERENCE_OPT.zero_grad(set_to_none=True)
        del loss
    return tracker.peak


def largest(fits, high: int) -> int:
    """The largest n in [1, high] with fits(n), for a monotone fits (bisection)."""
    lo, hi = 0, high + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ---------------------------------------------------------------------------------------- the searches
def batch_size_finder(mode: str, cap_samples: int) -> tuple[int, int]:
    model = MLP()
    trainer = _trainer(max_epochs=1)
    with OOMInjector(model.net, max_size=cap_samples) as injector:
        found = Tuner(trainer).scale_batch_size(model, mode=mode)
    return found, injector.calls


def ours_direct(capacity: int, headroom: float) -> tuple[int, int, int]:
    result = find_micro_batch_size(
        lambda n: peak(n) if peak(n) <= capacity else None,
        max_size=BATCH,
        capacity=capacity,
        headroom=headroom,
        max_probes=6,
    )
    truth = largest(lambda n: peak(n) <= result.usable, BATCH)
    return result.size, len(result.probes), truth


def random_family(n: int = 1500, seeds: tuple[int, ...] = (0, 1, 2)) -> list[tuple]:
    """Per kind and in total: (name, curves, reaching 97%, worst found/true, mean probes)."""
    rows: dict[str, list[tuple[float, int]]] = {kind: [] for kind in KINDS}
    for seed in seeds:
        for curve in random_curves(n, seed=seed):
            result = find_micro_batch_size(
                curve.probe,
                max_size=curve.max_size,
                capacity=curve.capacity,
                headroom=curve.headroom,
                max_probes=6,
            )
            rows[curve.kind].append((result.size / curve.true, len(result.probes)))
    rows["all"] = [row for kind in KINDS for row in rows[kind]]
    return [
        (
            name,
            len(found),
            sum(ratio >= 0.97 for ratio, _ in found),
            min(ratio for ratio, _ in found),
            statistics.mean(probes for _, probes in found),
        )
        for name, found in rows.items()
    ]


def print_random_family() -> None:
    print("find_micro_batch_size on random curves (tests/batching/curves.py, seeds 0-2), max_probes=6:")
    header = (
        f"{'kind':<16} | {'curves':>6} | {'>= 97%':>6} | {'share':>7} | {'worst':>6} | {'mean probes':>11}"
    )
    print(header)
    print("-" * len(header))
    for name, count, reached, worst, probes in random_family():
        print(
            f"{name:<16} | {count:>6} | {reached:>6} | {reached / count:>7.2%} | {worst:>6.4f} | {probes:>11.2f}"
        )


def print_sizing_only() -> None:
    """The find_micro_batch_size rows of the table, without the slow BatchSizeFinder and fit rows."""
    print(f"Simulated device: MLP {FEATURES}-{WIDTH}-{WIDTH}-2, SGD; find_micro_batch_size, max_probes=6")
    print(f"{'cap':>12} | {'capacity B':>10} | {'method':<34} | probes | found | true max | found/true")
    for label, capacity in [("300 samples", peak(300))] + [
        (format_bytes(c), c) for c in (2**19, 2**21, 2**23)
    ]:
        for headroom in (0.0, 0.1):
            size, probes, truth = ours_direct(capacity, headroom)
            print(
                f"{label:>12} | {capacity:>10} | find_micro_batch_size headroom={headroom} | {probes:>6} | "
                f"{size:>5} | {truth:>8} | {size / truth:>10.4f}"
            )


class _Truth(Callback):
    """After AutoAccumulation probed, bisect with the engine's own probe for the true maximum."""

    def __init__(self, callback: AutoAccumulation, usable: int) -> None:
        self.callback, self.usable, self.truth = callback, usable, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.truth is not None:
            return
        engine = self.callback.engine

        def fits(n):
            measured = engine.probes(batch).peak(n)
            return measured is not None and measured <= self.usable

        self.truth = largest(fits, BATCH)


# AutoAccumulation measures with the whole first batch on the device (inputs and labels): its device has
# that much more memory than the reference step's, for the same room left for the micro-step.
BATCH_BYTES = BATCH * (FEATURES * 4 + 8)


def ours_in_fit(capacity: int, headroom: float) -> tuple[int, int, int]:
    capacity += BATCH_BYTES
    callback = AutoAccumulation(max_memory=capacity, headroom=headroom, max_probes=6, log=False)
    truth = _Truth(callback, math.floor(capacity * (1 - headroom)))
    model = MLP(batch_size=BATCH)
    _trainer(max_steps=1, callbacks=[callback, truth]).fit(model)
    return callback.micro_batch_size, len(callback.probes), truth.truth


# ---------------------------------------------------------------------------------------- overhead
class _StepTimer(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._start)


class _MetricsOff(Callback):
    """Turn the engine's ``batching/*`` logging off for real: Lightning sets ``callback.log`` to the module's
    ``log`` method on every callback, which overwrites the callbacks' ``log=False`` flag."""

    def __init__(self, callback: AutoAccumulation) -> None:
        self.callback = callback

    def on_fit_start(self, trainer, pl_module) -> None:
        self.callback.engine.log_metrics = False


def _without_metrics(batch: int) -> list[Callback]:
    callback = AutoAccumulation(micro_batch_size=batch, log=False)
    return [callback, _MetricsOff(callback)]


def overhead(rounds: int = 20, steps: int = 30, width: int = 512, batch: int = 256) -> dict[str, tuple]:
    """Step times of each configuration pooled over rounds (one fit per configuration per round, in
    turn); returns (min, 10th percentile, median) in ms for the plain run and as ratios for the others."""
    configs = {
        "plain": lambda: [],
        "AutoAccumulation k=1": lambda: [AutoAccumulation(micro_batch_size=batch, log=False)],
        "OOMBackoff": lambda: [OOMBackoff(log=False)],
        "AutoAccumulation k=1, metrics off": lambda: _without_metrics(batch),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, make in configs.items():
            torch.manual_seed(0)
            timer = _StepTimer()
            model = MLP(batch_size=batch, width=width, features=256)
            _trainer(max_steps=steps, callbacks=[*make(), timer]).fit(model)
            times[name].extend(timer.times[3:])  # the first steps warm up

    def stats(values: list[float]) -> tuple[float, float, float]:
        return min(values), statistics.quantiles(values, n=10)[0], statistics.median(values)

    base = stats(times["plain"])
    out: dict[str, tuple] = {"plain step, ms": tuple(v * 1e3 for v in base)}
    for name in configs:
        if name != "plain":
            out[f"{name} / plain"] = tuple(v / b for v, b in zip(stats(times[name]), base))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizing", action="store_true", help="only find_micro_batch_size (a few seconds)")
    args = parser.parse_args()
    # One thread: with two on a shared 2-core machine, a step waits on the other thread (240 ms vs 9 ms).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.sizing:
        print_sizing_only()
        print()
        print_random_family()
        return
    caps = [("300 samples", peak(300))] + [(format_bytes(c), c) for c in (2**19, 2**21, 2**23)]
    print(
        f"Simulated device: MLP {FEATURES}-{WIDTH}-{WIDTH}-2, SGD; peak(1) = {peak(1)} B, peak(300) = {peak(300)} B"
    )
    print()
    header = f"{'cap':>12} | {'capacity B':>10} | {'method':<38} | {'probes':>6} | {'found':>5} | {'true max':>8} | {'found/true':>10}"
    print(header)
    print("-" * len(header))
    for label, capacity in caps:
        true_max = largest(lambda n, c=capacity: peak(n) <= c, 8192)
        rows = []
        for mode in ("power", "binsearch"):
            found, calls = batch_size_finder(mode, true_max)
            rows.append((f"BatchSizeFinder {mode}", calls, found, true_max))
        for headroom in (0.0, 0.1):
            size, probes, truth = ours_direct(capacity, headroom)
            rows.append((f"find_micro_batch_size headroom={headroom}", probes, size, truth))
        if true_max < BATCH:  # AutoAccumulation splits a batch of BATCH samples: the answer must be below
            for headroom in (0.0, 0.1):
                size, probes, truth = ours_in_fit(capacity, headroom)
                rows.append((f"AutoAccumulation fit headroom={headroom}", probes, size, truth))
        for method, probes, found, truth in rows:
            print(
                f"{label:>12} | {capacity:>10} | {method:<38} | {probes:>6} | {found:>5} | {truth:>8} | "
                f"{found / truth:>10.4f}"
            )
    print()
    print_random_family()
    print()
    print("Engine overhead at k=1: step time with / without, MLP 256-512-512-2, batch 256, one thread,")
    print("20 rounds of 30-step fits per configuration, steps pooled; min, 10th percentile, median:")
    for name, (low, p10, median) in overhead().items():
        print(f"  {name:<42} {low:.4f}  {p10:.4f}  {median:.4f}")


if __name__ == "__main__":
    main()
