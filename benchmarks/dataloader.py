"""DataLoaderMonitor on real training loops: is the loop data-bound, and does the named fix help?

Run: python benchmarks/dataloader.py

A dataset made in code whose ``__getitem__`` sleeps a known time (an I/O-bound loader: reading files or
a network; sleeping needs no CPU, so the numbers hold on a loaded machine) feeds a model whose
training step sleeps a known time, so the true wait fraction is known:
``items per batch x item time / (that + step time)``. Rows:

Every monitor is ``DataLoaderMonitor()`` with its defaults (windows of 20 steps, threshold 0.1).

1. ``num_workers=0``, slow items: flagged, measured wait fraction against the known one.
2. The same loop after the settings the warning named (applied from the diagnosis, not by hand).
3. A compute-bound loop (in-memory tensors, a real MLP): not flagged.
4. The monitor's own cost on that loop: the time spent inside its hooks and its transfer marks divided
   by the fit's step time (same run), and the fit time with the monitor over without (alternating runs).
5. A lambda in the dataset under ``spawn``: named before any worker process starts.

Then the measured tune (``DataLoaderMonitor(tune=True)``) on the slow loader prints its table.
"""

from __future__ import annotations

import multiprocessing
import pickle
import time
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_memopt import DataLoaderMonitor
from lightning_memopt.callbacks import dataloader_monitor
from lightning_memopt.data import StallMeter

ITEM_S, BATCH, STEP_S = 0.010, 4, 0.040  # 40 ms of loading per batch against 40 ms of compute
FAST_STEPS = 60  # the compute-bound loop
KNOWN = BATCH * ITEM_S / (BATCH * ITEM_S + STEP_S)  # 0.5
ITEMS, STEPS = 15 * BATCH, 45  # 15 batches per epoch, 3 epochs


class SleepyItems(Dataset):
    """``n`` items of 16 floats; each ``__getitem__`` sleeps ``cost`` seconds (module level: it pickles)."""

    def __init__(self, n: int, cost: float, transform=None) -> None:
        self.n, self.cost, self.transform = n, cost, transform

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.cost)
        item = torch.full((16,), float(index))
        return self.transform(item) if self.transform is not None else item


class SleepyStep(pl.LightningModule):
    """A linear layer whose training step also sleeps ``step_s`` (a known compute time)."""

    def __init__(self, step_s: float = STEP_S) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)
        self.step_s = step_s
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        time.sleep(self.step_s)
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Batches(Dataset):
    """Ready-made batches of shape (256, 512): fetching one is a single index (for ``batch_size=None``)."""

    def __init__(self, n: int) -> None:
        self.data = torch.randn(n, 256, 512)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class MLP(pl.LightningModule):
    """A real compute-bound step: 3 layers of width 512 on a batch of 256."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 1),
        )

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()  # (B, 512) -> scalar

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


SELF_TIMES: list[float] = []  # seconds of each call into the monitor, of the current TimedMonitor fit


def timed(fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        SELF_TIMES.append(time.perf_counter() - start)
        return out

    return wrapper


class TimedMeter(StallMeter):
    """The monitor's meter, with its transfer marks timed (they run from the module's transfer hook)."""

    transfer_start = timed(StallMeter.transfer_start)
    transfer_end = timed(StallMeter.transfer_end)


class TimedMonitor(DataLoaderMonitor):
    """DataLoaderMonitor whose training hooks are timed."""

    on_train_epoch_start = timed(DataLoaderMonitor.on_train_epoch_start)
    on_train_batch_start = timed(DataLoaderMonitor.on_train_batch_start)
    on_train_batch_end = timed(DataLoaderMonitor.on_train_batch_end)
    on_train_end = timed(DataLoaderMonitor.on_train_end)


def trainer(callbacks, steps: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def fit(monitor, model, loader, steps=STEPS):
    """Fit; return (seconds, the monitor's warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        trainer([monitor] if monitor is not None else [], steps).fit(model, loader)
        seconds = time.perf_counter() - start
    return seconds, [str(w.message) for w in caught if str(w.message).startswith("DataLoaderMonitor")]


def apply(diagnosis, **loader_kwargs) -> dict:
    """DataLoader arguments with the diagnosis' fixes applied."""
    for fix in diagnosis.fixes:
        loader_kwargs[fix.setting] = fix.suggested
    return loader_kwargs


def row(name: str, monitor: DataLoaderMonitor, warned: list[str], extra: str = "") -> None:
    step = monitor.times.per_step()
    flagged = "yes" if warned else "no"
    print(
        f"| {name:<34} | {flagged:<7} | {monitor.times.wait_fraction:>13.3f} | {step.wait * 1e3:>7.1f} | "
        f"{step.compute * 1e3:>10.1f} | {extra}"
    )


def main() -> None:
    torch.set_num_threads(1)  # steadier timings on a shared machine
    print(
        f"items: {BATCH} x {ITEM_S * 1e3:.0f} ms per batch; step: {STEP_S * 1e3:.0f} ms; known wait fraction "
        f"{KNOWN:.3f}; {STEPS} steps, {ITEMS // BATCH} batches per epoch; {multiprocessing.cpu_count()} CPUs\n"
    )
    print("| loop                               | flagged | wait fraction | wait ms | compute ms | notes")
    print("|------------------------------------|---------|---------------|---------|------------|------")

    # 1. slow items in the main process
    slow = DataLoaderMonitor()
    _, warned = fit(slow, SleepyStep(), DataLoader(SleepyItems(ITEMS, ITEM_S), batch_size=BATCH))
    error = slow.times.wait_fraction - KNOWN
    row("num_workers=0, slow items", slow, warned, f"known {KNOWN:.3f}, error {error:+.3f} (bound: 0.05)")
    fixes = apply(slow.diagnosis)
    named = ", ".join(f"{k}={v!r}" for k, v in fixes.items())

    # 2. the recommended settings
    after = DataLoaderMonitor()
    loader = DataLoader(SleepyItems(ITEMS, ITEM_S), batch_size=BATCH, **fixes)
    _, warned_after = fit(after, SleepyStep(), loader)
    row("after the recommended settings", after, warned_after, f"DataLoader({named})")

    # 3 and 4. compute-bound: ready-made batches in memory, a real MLP; the monitor's own time, same run
    data = Batches(FAST_STEPS)
    fit(None, MLP(), DataLoader(data, batch_size=None), steps=10)  # warm-up (first-use costs)
    dataloader_monitor.StallMeter = TimedMeter
    ratios, shares, flagged = [], [], []
    for _ in range(3):  # alternate, so a burst of load on the machine hits both sides
        plain, _ = fit(None, MLP(), DataLoader(data, batch_size=None), steps=FAST_STEPS)
        SELF_TIMES.clear()
        monitor = TimedMonitor()
        seconds, warned_fast = fit(monitor, MLP(), DataLoader(data, batch_size=None), steps=FAST_STEPS)
        ratios.append(seconds / plain)
        step = monitor.times.per_step()
        # every call into the monitor (hooks and marks), over the same fit's time per step
        shares.append(sum(SELF_TIMES) / FAST_STEPS / (step.wait + step.transfer + step.compute))
        flagged.append(bool(warned_fast))
    dataloader_monitor.StallMeter = StallMeter
    ratios.sort()
    shares.sort()
    row("compute-bound (MLP, in-memory)", monitor, warned_fast, f"flagged in {sum(flagged)} of 3 runs")
    print(
        f"\nmonitor overhead on the compute-bound loop: time inside the monitor / step time, same run: median "
        f"{shares[1]:.3%} (min {shares[0]:.3%}, max {shares[2]:.3%}; 3 runs of {FAST_STEPS} steps; bound 1%)\n"
        f"fit time with / without the monitor: median {ratios[1]:.3f}x (min {ratios[0]:.3f}x, max {ratios[2]:.3f}x;"
        " alternating fits on a shared machine: this spread is the machine's noise)"
    )

    # 5. a lambda under spawn
    model = SleepyStep()
    bad = DataLoader(
        SleepyItems(ITEMS, ITEM_S, transform=lambda x: x * 2),
        batch_size=BATCH,
        num_workers=2,
        multiprocessing_context="spawn",
    )
    start = time.perf_counter()
    try:
        fit(DataLoaderMonitor(), model, bad)
        outcome = "NOT REPORTED"
    except pickle.PicklingError as err:
        outcome = str(err)
    seconds = time.perf_counter() - start
    children = len(multiprocessing.active_children())
    print(
        f"\nlambda in the dataset under spawn, with the monitor ({seconds:.2f} s, {model.steps} training steps, "
        f"{children} worker processes alive):\n  {outcome}"
    )
    bad = DataLoader(
        SleepyItems(ITEMS, ITEM_S, transform=lambda x: x * 2),
        batch_size=BATCH,
        num_workers=2,
        multiprocessing_context="spawn",
    )
    try:
        fit(None, SleepyStep(), bad)
    except Exception as err:  # what the user gets without the monitor
        cause = err.__context__
        print(
            f"without the monitor: {type(err).__name__}: {err}"
            + (f"\n  (raised while handling {type(cause).__name__}: {cause})" if cause is not None else "")
        )

    # the warnings, in full
    print(f"\nthe warning for row 1:\n  {warned[0] if warned else '(none)'}")
    print(f"the warning after the recommended settings:\n  {warned_after[0] if warned_after else '(none)'}")

    # the measured tune: DataLoaderMonitor(tune=True) on the slow num_workers=0 loader, then the fit
    tuned = DataLoaderMonitor(tune=True, tune_batches=8)
    _, warned_tuned = fit(tuned, SleepyStep(), DataLoader(SleepyItems(ITEMS, ITEM_S), batch_size=BATCH))
    (result,) = tuned.tune_results
    print(
        f"\nDataLoaderMonitor(tune=True, tune_batches=8) on the num_workers=0 slow loader:\n{result.table()}"
    )
    print("| loop                               | flagged | wait fraction | wait ms | compute ms | notes")
    row("after tune=True", tuned, warned_tuned, f"num_workers={result.best} (persistent_workers stays False)")


if __name__ == "__main__":
    main()
