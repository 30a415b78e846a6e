"""Where the defaults' first optimizer steps spend their time (issue 30's start-up), under cProfile.

Run from the repository root (never run by the test suite)::

    PYTHONPATH=. python benchmarks/startup_profile.py --only llama             # CPU: fastest_step's model, its L
    PYTHONPATH=. python benchmarks/startup_profile.py --device cuda --cap-gib 79.18   # the issue's Llama

One ``trainer.fit`` of ``fastest_step.py``'s ``defaults`` way (``AutoCheckpoint``, ``AutoAccumulation``,
``OOMBackoff`` under the same limit) for ``--steps`` optimizer steps, after ``fastest_step.warm_device``
(``--cold``: without), so that what the defaults pay is theirs and not the device's first kernels. It prints each optimizer step's seconds and, for the first step (``--profiled``: steps), the
functions with the most cumulative time (``--top``) and those with the most time of their own, and the seconds
each checkpointing treatment took in ``AutoCheckpoint``'s profiles (its tracked pass and its timed passes).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fastest_step as fs  # noqa: E402


class StepClock(pl.Callback):
    """Each optimizer step's seconds (the device synchronized), from the fit's start; the profiler runs over
    the first ``profiled`` steps."""

    def __init__(self, profiler: cProfile.Profile, profiled: int = 1) -> None:
        self.profiler, self.profiled, self.seconds, self.last = profiler, profiled, [], None

    def on_train_start(self, trainer, pl_module):
        fs.sync()
        self.last = time.perf_counter()
        self.profiler.enable()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > len(self.seconds):  # an optimizer step ended
            fs.sync()
            now = time.perf_counter()
            self.seconds.append(now - self.last)
            self.last = now
            if len(self.seconds) == self.profiled:
                self.profiler.disable()


class Treatments:
    """The seconds each treatment takes in ``AutoCheckpoint``'s profiles (the device synchronized): its
    tracked pass (``profile._run_choice``: memory, FLOPs, a first run) and its timed passes
    (``profile.time_treatments``), over every block profiled."""

    def __init__(self) -> None:
        self.tracked: dict[str, list[float]] = {}
        self.timed: dict[str, list[float]] = {}

    def install(self, patch) -> None:
        from lightning_memopt.checkpointing import profile

        run_choice, time_treatments = profile._run_choice, profile.time_treatments

        def tracked(fake_model, choice, *args, **kwargs):
            fs.sync()
            began = time.perf_counter()
            try:
                return run_choice(fake_model, choice, *args, **kwargs)
            finally:
                fs.sync()
                self.tracked.setdefault(choice, []).append(time.perf_counter() - began)

        def timed(prepare, choices, clock, *args, **kwargs):
            def prepared(choice):
                run = prepare(choice)

                def timed_run():
                    fs.sync()
                    began = time.perf_counter()
                    run()
                    fs.sync()
                    self.timed.setdefault(choice, []).append(time.perf_counter() - began)

                return timed_run

            return time_treatments(prepared, choices, clock, *args, **kwargs)

        patch.setattr(profile, "_run_choice", tracked)
        patch.setattr(profile, "time_treatments", timed)

    def text(self) -> str:
        if not self.tracked:
            return "AutoCheckpoint profiled no block"
        rows = [
            f"  {choice}: tracked {sum(self.tracked[choice]):.2f} s ({len(self.tracked[choice])} passes), "
            f"timed {sum(self.timed.get(choice, [])):.2f} s ({len(self.timed.get(choice, []))} passes)"
            for choice in self.tracked
        ]
        return "the profiles' seconds by treatment (device synchronized):\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--only", default="llama", help="one of fastest_step's models (CPU)")
    parser.add_argument("--precision", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=None, help="samples a step (CPU 48, cuda 32)")
    parser.add_argument("--cap-gib", type=float, default=None)
    parser.add_argument("--cold", action="store_true", help="no warm-up fit before the defaults")
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--profiled", type=int, default=1, help="the first steps profiled together")
    args = parser.parse_args()
    fs.DEVICE = args.device
    precision = args.precision or ("bf16-mixed" if fs.cuda() else "32-true")
    batch = args.batch or (32 if fs.cuda() else 48)
    if fs.cuda():
        bench = fs.gpu_benches(args.layers or 16, args.seq)["llama"]
        total = torch.cuda.get_device_properties(0).total_memory
        limit = total
        if args.cap_gib is not None:
            fs.CAP = limit = int(args.cap_gib * 2**30)
            torch.cuda.set_per_process_memory_fraction(min(1.0, fs.CAP / total))
    else:
        bench = fs.benches(False, args.layers)[args.only]
        quarter, eighth = batch // 4, batch // 8
        high, low = (fs.manual_peak("plain + accumulate", bench, d, precision)[0] for d in (quarter, eighth))
        limit = -(-(high + max(0, high - low) // 2) // 1024) * 1024
    warm = None if args.cold else fs.warm_device(bench, precision)  # the device's first kernels
    module, callbacks = fs.way_setup("defaults", bench, limit)
    profiler = cProfile.Profile()
    clock = StepClock(profiler, args.profiled)
    data = DataLoader(fs.Samples(bench.sample, args.steps * batch, batch), batch_size=batch)
    treatments = Treatments()
    with pytest.MonkeyPatch.context() as patch:
        treatments.install(patch)
        fs.trainer([clock, *callbacks], precision, max_steps=args.steps).fit(module, data)
    steady = min(clock.seconds[1:]) if len(clock.seconds) > 1 else None
    print(f"L = {limit / fs.MiB:.2f} MiB, {precision}, batch {batch}, torch {torch.__version__}")
    if warm is not None:
        print(f"the warm-up fit (the plain way, one sample, the model built): {warm:.1f} s")
    print("optimizer steps (s): " + ", ".join(f"{s:.3f}" for s in clock.seconds))
    if steady:
        print(f"first step: {clock.seconds[0] / steady:.1f} steady steps")
    print(treatments.text())
    for order in ("cumulative", "tottime"):
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).sort_stats(order)
        stats.print_stats(args.top)
        print(f"\n## the first {args.profiled} step(s), by {order}\n" + text.getvalue().strip())


if __name__ == "__main__":
    main()
