"""What the examples print at the end: the memory lightning_memopt saved, measured in the same run.

``BaselineStepCLI`` is a ``LightningCLI`` that, before ``fit``, runs two training steps of a copy of the
model on the first training batch WITHOUT any of the package's callbacks, under a ``MemoryTracker``, and
keeps the second step's peak memory per phase (forward, backward, optimizer) and category (parameters,
gradients, optimizer state, activations, other) — the same record ``MemoryMonitor`` keeps for every step
of the real run. The first step is not measured because it creates the optimizer state; for the same
reason the run's first step is left out of the comparison. After ``fit`` it prints both side by side
with the ratio, and where ``MemoryMonitor`` wrote its report and plot.

The copy is made before the callbacks touch the model, runs the same precision context on the same
device, and is deleted before training starts.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import move_data_to_device

from lightning_memopt import MemoryMonitor
from lightning_memopt.memory import CATEGORIES, MemoryTracker
from lightning_memopt.memory.device import is_out_of_memory
from lightning_memopt.memory.report import PHASES, empty_record, fold_peak, merge_records, peak_phase

_MIB = 2**20


def _first_optimizer(configured) -> torch.optim.Optimizer:
    """The optimizer out of anything ``configure_optimizers`` may return."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    raise TypeError(f"cannot find an optimizer in what configure_optimizers returned: {configured!r}")


def _loss(output) -> torch.Tensor:
    return output["loss"] if isinstance(output, dict) else output


def measure_baseline_step(module, batch, *, device=None, forward_context=None) -> dict[str, int]:
    """Peak bytes by phase and category of one training step of ``module`` without this package.

    Args:
        module: The LightningModule, before any callback transformed it. It is copied, not changed.
        batch: One training batch.
        device: Where to run (default: the module's device).
        forward_context: A callable returning the precision context (``trainer.precision_plugin
            .forward_context``); default: none.

    Returns:
        A record in :mod:`lightning_memopt.memory.report` format for the second of two steps.
    """
    model = copy.deepcopy(module).train()
    if device is not None:
        model = model.to(device)
    batch = move_data_to_device(batch, model.device)
    optimizer = _first_optimizer(model.configure_optimizers())
    record = empty_record(1, PHASES)
    tracker = MemoryTracker(model, optimizer)
    with warnings.catch_warnings():
        # training_step calls self.log, which warns once when no Trainer is attached: expected here.
        warnings.filterwarnings("ignore", message=".*self.log.*")
        for step in range(2):
            with tracker:
                tracker.reset_peak()
                with forward_context() if forward_context is not None else contextlib.nullcontext():
                    loss = _loss(model.training_step(batch, 0))
                # Lightning's order: zero_grad after training_step, so the last step's gradients are
                # alive during this forward (and the run's MemoryMonitor counts them there too).
                optimizer.zero_grad(set_to_none=True)
                fold_peak(record, "forward", tracker.peak, tracker.peak_breakdown)
                tracker.reset_peak()
                loss.backward()
                del loss
                fold_peak(record, "backward", tracker.peak, tracker.peak_breakdown)
                tracker.reset_peak()
                optimizer.step()
                fold_peak(record, "optimizer", tracker.peak, tracker.peak_breakdown)
            if step == 0:
                record = empty_record(1, PHASES)
    return record


def comparison_table(
    baseline: dict[str, int], run: dict[str, int] | None, *, run_name: str = "memopt"
) -> str:
    """A plain-text table: peak MiB per phase, by category, baseline and run side by side, and the ratios."""
    header = f"{'phase':<10} {'run':<9} {'peak':>9} " + " ".join(f"{c:>15}" for c in CATEGORIES)
    lines = [header, "-" * len(header)]
    rows = [("baseline", baseline)] + ([(run_name, run)] if run is not None else [])
    for phase in PHASES:
        for i, (name, record) in enumerate(rows):
            cells = " ".join(f"{record[f'{phase}_{c}'] / _MIB:>15.2f}" for c in CATEGORIES)
            lines.append(f"{phase if i == 0 else '':<10} {name:<9} {record[phase] / _MIB:>9.2f} {cells}")
    if run is not None:
        b_phase, r_phase = peak_phase(baseline), peak_phase(run)
        b_act, r_act = baseline[f"{b_phase}_activations"], run[f"{r_phase}_activations"]
        lines += [
            "",
            f"step peak:            baseline {baseline[b_phase] / _MIB:8.2f} MiB -> {run_name} "
            f"{run[r_phase] / _MIB:8.2f} MiB  ({run[r_phase] / baseline[b_phase]:.2f}x)",
            f"activations at peak:  baseline {b_act / _MIB:8.2f} MiB -> {run_name} "
            f"{r_act / _MIB:8.2f} MiB  ({r_act / b_act:.2f}x)"
            if b_act
            else "activations at peak: 0 in baseline",
        ]
    return "\n".join(lines)


def default_precision() -> str:
    """``"bf16-mixed"`` on a CUDA device that supports bf16, ``"32-true"`` otherwise."""
    return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"


class BaselineStepCLI(LightningCLI):
    """LightningCLI that measures a baseline step before ``fit`` and prints the comparison after it.

    Adds the option ``--baseline_step`` (default true) and defaults ``trainer.precision`` to
    :func:`default_precision`.
    """

    baseline: dict[str, int] | None = None
    """The baseline step's record, set before fit."""

    def add_arguments_to_parser(self, parser) -> None:
        # bf16-mixed where the hardware runs it fast, full precision on CPU (bf16 matmuls are slow there).
        parser.set_defaults({"trainer.precision": default_precision()})
        parser.add_argument(
            "--baseline_step",
            type=bool,
            default=True,
            help="Measure one step of the same model without lightning_memopt before fit, and compare.",
        )

    def before_fit(self) -> None:
        if not self.config_init[self.subcommand].get("baseline_step", True):
            return
        self.datamodule.setup("fit")
        batch = next(iter(self.datamodule.train_dataloader()))
        strategy = self.trainer.strategy
        try:
            self.baseline = measure_baseline_step(
                self.model,
                batch,
                device=strategy.root_device,
                forward_context=strategy.precision_plugin.forward_context,
            )
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            self.baseline = None
            print("baseline step (without lightning_memopt) ran out of memory: nothing to compare against")

    def after_fit(self) -> None:
        if self.baseline is None or not self.trainer.is_global_zero:
            return
        monitor = next((c for c in self.trainer.callbacks if isinstance(c, MemoryMonitor)), None)
        run = None
        if monitor is not None and len(monitor.history):
            records = [r for r in monitor.history if r["step"] >= 1] or list(monitor.history)
            run = merge_records(records)
        batch_size = getattr(self.datamodule.hparams, "batch_size", "?")
        print()
        print(
            f"Peak memory of one training step, MiB of live tensors (batch of {batch_size}; "
            f"baseline: same model and batch without lightning_memopt; "
            + (
                "memopt: largest over the run's steps after the first, by MemoryMonitor)"
                if run
                else "no MemoryMonitor in this run)"
            )
        )
        print(comparison_table(self.baseline, run))
        if monitor is not None and monitor.report_paths:
            print("memory report: " + ", ".join(str(p) for p in monitor.report_paths))
