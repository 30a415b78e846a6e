"""``lightning-memopt plan``: will this config fit, and what is the cheapest change that makes it fit?

Examples::

    lightning-memopt plan --config my.yaml --device-memory 80GiB --devices 8 --json
    lightning-memopt plan --model my_pkg.lit:LitLlama --model.n_layer=32 --batch 1x4096 --device-memory H100
    python -m lightning_memopt.planning plan --config examples/gpt/baseline.yaml --model examples.gpt.gpt:CharGPT \\
        --data examples.gpt.gpt:StdlibText --device-memory 64MiB

The model is built on the meta device and turned into fake tensors, the batch is the DataModule's first
training batch (made for real and turned fake) or shapes given with ``--batch``; one training step runs
on fake tensors under a MemoryTracker (see :mod:`lightning_memopt.planning.predict`). Nothing of the
model is allocated: a 7B-parameter model plans on a laptop.

JSON output (``--json``), all sizes in bytes per rank:

=================  ===================================================================================
``peak_bytes``     the step's predicted peak as configured
``phases``         ``{forward|backward|optimizer: {peak, parameters, gradients, optimizer_state,
                   activations, other}}``: each phase's peak and its breakdown
``categories``     the breakdown at the step's peak
``head_bytes``     of the step's peak, the bytes the output head made (a part of ``activations`` and
                   ``other``); null where the model is no causal LM whose head the package can take
``fits``           whether ``peak_bytes`` <= ``usable_bytes`` (device memory less headroom)
``usable_bytes``   device memory * (1 - headroom)
``options``        one entry per single change: ``name``, ``config`` (with ``head``: ``own`` or
                   ``chunked``), ``peak_bytes``, ``head_bytes``, ``cost``, ``fits``, ``recompute_flops``
``cheapest``       the cheapest configuration that fits (or null): ``config``, ``peak_bytes``, ``cost``,
                   ``recompute_flops``, ``yaml`` (the ``trainer:`` block to paste)
``modeled``        what was modeled instead of counted (sharding, DDP buckets, offload)
=================  ===================================================================================
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from lightning_memopt.batching.split import batch_size
from lightning_memopt.memory import CATEGORIES, format_bytes, parse_bytes
from lightning_memopt.memory.limit import check_headroom, usable_bytes
from lightning_memopt.memory.report import PHASES
from lightning_memopt.planning.build import FakeBuildError, fake_mode, module_context
from lightning_memopt.planning.config import PlanInput, load_input
from lightning_memopt.planning.predict import PRECISIONS
from lightning_memopt.planning.search import Config, Evaluated, Planner
from lightning_memopt.planning.yaml_block import trainer_yaml

__all__ = ["GPUS", "main", "plan", "device_memory_bytes"]

# Device memory by GPU name, as the vendor states it (GiB for NVIDIA's "GB" figures of HBM/GDDR sizes).
GPUS = {
    "T4": 16 * 2**30,
    "V100-16GB": 16 * 2**30,
    "V100-32GB": 32 * 2**30,
    "A10G": 24 * 2**30,
    "L4": 24 * 2**30,
    "RTX3090": 24 * 2**30,
    "RTX4090": 24 * 2**30,
    "A100-40GB": 40 * 2**30,
    "A100": 80 * 2**30,
    "A100-80GB": 80 * 2**30,
    "L40S": 48 * 2**30,
    "H100": 80 * 2**30,
    "H100-80GB": 80 * 2**30,
    "H200": 141 * 10**9,
    "B200": 180 * 10**9,
}


def device_memory_bytes(value: str) -> int:
    """Bytes of ``value``: a GPU name of :data:`GPUS` (case-insensitive) or a size such as ``"80GiB"``.

    Raises:
        ValueError: Naming the value and the GPU names known.
    """
    names = {k.lower(): v for k, v in GPUS.items()}
    if value.lower() in names:
        return names[value.lower()]
    try:
        return parse_bytes(value, name="--device-memory")
    except ValueError as exc:
        raise ValueError(f"{exc}; or a GPU name: {', '.join(GPUS)}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-memopt", description="Memory planning for Lightning runs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plan",
        help="predict a training step's memory on fake tensors, and the cheapest change that makes it fit",
        description=(
            "Predict the memory of one training step (per phase, per category, per rank) without allocating the "
            "model, and the cheapest change that fits the device. Unknown options are LightningCLI overrides, "
            "e.g. --model.n_layer=32 --data.batch_size=8 --trainer.precision=bf16-mixed."
        ),
        epilog=(
            "examples:\n"
            "  lightning-memopt plan --config fit.yaml --device-memory H100 --devices 8\n"
            "  lightning-memopt plan --model my_pkg.lit:LitLlama --model.n_layer=32 --batch 1x4096 --json\n"
            "  lightning-memopt plan --config fit.yaml --batch input_ids=8x512 --plot options.png"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", action="append", default=[], help="a LightningCLI YAML config (repeatable)")
    p.add_argument(
        "--model", help="the LightningModule class, 'pkg.module:Class' (else the config's class_path)"
    )
    p.add_argument(
        "--data", help="the LightningDataModule class, 'pkg.module:Class' (else the config's, if any)"
    )
    p.add_argument(
        "--batch",
        action="append",
        default=[],
        metavar="SPEC",
        help="a batch tensor's shape instead of the DataModule's batch: '8x512' (int64), "
        "'input_ids=8x512:int64', 'x=8x3x224x224:float32'; repeat for several tensors",
    )
    p.add_argument(
        "--device-memory", default="80GiB", help=f"bytes per device ('80GiB') or a GPU: {', '.join(GPUS)}"
    )
    p.add_argument("--devices", type=int, help="devices (ranks); default: the config's trainer.devices or 1")
    p.add_argument(
        "--precision", choices=PRECISIONS, help="default: the config's trainer.precision or 32-true"
    )
    p.add_argument(
        "--strategy", choices=("ddp", "fsdp"), help="ddp, or fsdp (ModelParallelStrategy, sharded)"
    )
    p.add_argument(
        "--headroom", type=float, default=0.1, help="fraction of device memory kept free (default 0.1)"
    )
    p.add_argument(
        "--no-offload", action="store_true", help="do not propose offloading activations to the host"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of text; keys: peak_bytes, peak_phase, phases, categories, head_bytes, fits, "
        "usable_bytes, options, cheapest (with yaml), modeled; bytes per rank",
    )
    p.add_argument("--plot", metavar="PNG", help="write a stacked bar per option (needs matplotlib)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: ``lightning-memopt plan ...``. Returns the exit status (1 on a clear error)."""
    args, overrides = _parser().parse_known_args(argv)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # classes named on the command line may live in the project
    try:
        result = plan(
            configs=args.config,
            model=args.model,
            data=args.data,
            batch=args.batch,
            overrides=overrides,
            device_memory=args.device_memory,
            devices=args.devices,
            precision=args.precision,
            strategy=args.strategy,
            headroom=args.headroom,
            allow_offload=not args.no_offload,
        )
    except (ValueError, FakeBuildError, TypeError) as exc:
        print(f"lightning-memopt plan: error: {exc}", file=sys.stderr)
        return 1
    if args.plot:
        from lightning_memopt.planning.plot import plot_options

        plot_options(result, args.plot)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def plan(
    *,
    configs: Sequence[str] = (),
    model: str | None = None,
    data: str | None = None,
    batch: Sequence[str] = (),
    overrides: Sequence[str] = (),
    device_memory: str | int = "80GiB",
    devices: int | None = None,
    precision: str | None = None,
    strategy: str | None = None,
    headroom: float = 0.1,
    allow_offload: bool = True,
) -> dict[str, Any]:
    """Predict a run's memory and the cheapest change that fits; the dict ``--json`` prints.

    Args:
        configs: LightningCLI YAML files, as passed to ``fit --config``.
        model: ``"pkg.module:Class"`` of the LightningModule (else the config's ``model.class_path``).
        data: ``"pkg.module:Class"`` of the DataModule (else the config's, if any).
        batch: Shape specs used instead of the DataModule's batch (see ``--help``).
        overrides: LightningCLI overrides such as ``"--model.n_layer=32"``.
        device_memory: Bytes per device, a size string, or a GPU name of :data:`GPUS`.
        devices: Ranks (default: the config's ``trainer.devices``, else 1).
        precision: Default: the config's ``trainer.precision``, else ``32-true``.
        strategy: ``ddp`` or ``fsdp`` (default: from the config, else ddp).
        headroom: Fraction of device memory kept free, in [0, 1).
        allow_offload: Whether offloading activations to the host is an option.

    Raises:
        ValueError: For a bad option (naming it and the fix) or a config that cannot be read.
        FakeBuildError: If the model or its step cannot run on fake tensors (naming the module and a fix).

    Example::

        >>> result = plan(model="my_pkg:LitModel", batch=["8x512"], device_memory="24GiB")  # doctest: +SKIP
        >>> result["fits"], result["cheapest"]["yaml"]  # doctest: +SKIP
    """
    start = time.perf_counter()
    headroom = check_headroom(headroom, name="--headroom")
    capacity = device_memory if isinstance(device_memory, int) else device_memory_bytes(device_memory)
    usable = usable_bytes(capacity, headroom, capacity, name="--device-memory")
    mode = fake_mode()
    inp: PlanInput = load_input(
        mode, configs=configs, model=model, data=data, batch=batch, overrides=overrides
    )
    precision = precision or inp.precision
    strategy = strategy or inp.strategy
    devices = devices or inp.devices
    if devices < 1:
        raise ValueError(f"--devices must be >= 1, got {devices}")
    planner = Planner(
        inp.module,
        inp.batch,
        usable,
        precision=precision,
        strategy=strategy,
        world_size=devices,
        allow_offload=allow_offload,
        fresh=inp.rebuild,
    )
    with (
        mode,
        module_context(inp.module, f"the training step of {type(inp.module).__name__}"),
        warnings.catch_warnings(),
    ):
        # training_step's self.log warns when no Trainer is attached: expected, nothing to act on.
        warnings.filterwarnings("ignore", message=".*self.log.*")
        base = planner.evaluate(planner.grid()[0])
        options = _options(planner, base)
        best = planner.cheapest()
    run = dict(device_memory_bytes=capacity, usable_bytes=usable, headroom=headroom, devices=devices)
    run.update(precision=precision, strategy=strategy)
    return _result(inp, run, base, options, best, time.perf_counter() - start)


def _result(
    inp: PlanInput,
    run: dict[str, Any],
    base: Evaluated,
    options: list[tuple[str, Evaluated]],
    best: Evaluated | None,
    seconds: float,
) -> dict[str, Any]:
    """What :func:`plan` returns (``--json``): the run as given (``run``), its prediction, the options."""
    pred = base.prediction
    cheapest = None
    if best is not None:
        yaml = trainer_yaml(
            best, run["devices"], run["device_memory_bytes"], run["headroom"], batch_size(inp.batch)
        )
        cheapest = {**_option_dict("cheapest", best), "yaml": yaml}
    return {
        "model": type(inp.module).__name__,
        "batch_size": batch_size(inp.batch),
        "parameters": sum(p.numel() for p in dict.fromkeys(inp.module.parameters())),
        **run,
        "peak_bytes": pred.peak_bytes,
        "peak_phase": pred.peak_phase,
        "phases": pred.phases,
        "categories": pred.categories,
        "head_bytes": pred.head_bytes,
        "fits": base.fits,
        "options": [_option_dict(name, e) for name, e in options],
        "cheapest": cheapest,
        "modeled": sorted({m for _, e in options for m in (e.prediction.modeled if e.prediction else [])}),
        "seconds": round(seconds, 3),
    }


def _options(planner: Planner, base: Evaluated) -> list[tuple[str, Evaluated]]:
    """The configuration as given, then each single change of one knob (the micro-batch sizes down to the
    first that fits: each smaller one runs more micro-batches of the same step)."""
    c0 = base.config
    out = [("as configured", base)]
    for p in planner.precisions()[1:]:
        out.append((f"precision {p}", planner.evaluate(Config(p, c0.micro_batch_size, c0.strategy))))
    for m in planner.micro_batch_grid()[1:]:
        out.append((f"micro-batch {m}", planner.evaluate(Config(c0.precision, m, c0.strategy))))
        if out[-1][1].fits:
            break
    if "recompute" in {c.checkpoint for c in planner.grid()}:
        out.append(
            (
                "AutoCheckpoint",
                planner.evaluate(Config(c0.precision, c0.micro_batch_size, c0.strategy, "recompute")),
            )
        )
    if "offload" in {c.checkpoint for c in planner.grid()}:
        out.append(
            (
                "AutoCheckpoint + offload",
                planner.evaluate(Config(c0.precision, c0.micro_batch_size, c0.strategy, "offload")),
            )
        )
    if "chunked" in planner.heads():
        out.append(("chunked head", planner.evaluate(replace(c0, head="chunked"))))
    if "fsdp" in planner.strategies() and c0.strategy != "fsdp":
        out.append(
            (
                f"fsdp over {planner.world_size}",
                planner.evaluate(Config(c0.precision, c0.micro_batch_size, "fsdp")),
            )
        )
    return out


def _option_dict(name: str, e: Evaluated) -> dict[str, Any]:
    return {
        "name": name,
        "config": {
            "precision": e.config.precision,
            "micro_batch_size": e.config.micro_batch_size,
            "strategy": e.config.strategy,
            "checkpoint": e.config.checkpoint,
            "head": e.config.head,
        },
        "peak_bytes": e.peak_bytes,
        "head_bytes": None if e.prediction is None else e.prediction.head_bytes,
        "categories": None if e.prediction is None else e.prediction.categories,
        "cost": None if e.cost == float("inf") else round(e.cost, 6),
        "fits": e.fits,
        "recompute_flops": e.recompute_flops,
        "note": e.note,
    }


def _accumulation_line(config: dict[str, Any], whole: int) -> list[str]:
    """One line where gradient accumulation without recompute is the way: plain with the model's own
    head, or with the chunked head where only that fits (the callbacks' search weighs the same ways)."""
    size = config["micro_batch_size"]
    if config["checkpoint"] != "none" or size >= whole:
        return []
    plain = config.get("head", "own") == "own"
    way = "plain accumulation" if plain else "accumulation with the chunked head"
    return [
        f"{way} is the fastest way that fits: {-(-whole // size)} micro-batches of {size} "
        "without recompute (AutoCheckpoint beside AutoAccumulation times recompute against it at the first "
        "batch and recomputes only where larger micro-batches make the step faster)"
    ]


def render(result: dict[str, Any]) -> str:
    """The text report: the step by phase and category, the options, the cheapest fit as YAML."""
    lines = [
        f"{result['model']}: {result['parameters']:,} parameters, {result['precision']}, {result['strategy']} on "
        f"{result['devices']} device(s) of {format_bytes(result['device_memory_bytes'])} "
        f"(usable {format_bytes(result['usable_bytes'])} with headroom {result['headroom']})",
        "",
        f"{'phase':<10}{'peak':>12}" + "".join(f"{c:>17}" for c in CATEGORIES),
    ]
    for phase in PHASES:
        row = result["phases"][phase]
        lines.append(
            f"{phase:<10}{format_bytes(row['peak']):>12}"
            + "".join(f"{format_bytes(row[c]):>17}" for c in CATEGORIES)
        )
    if result["head_bytes"] is not None:  # a part of activations and other, not in the row's sum
        lines[2] += f"{'of which head':>17}"
        for i, phase in enumerate(PHASES):
            lines[3 + i] += f"{format_bytes(result['phases'][phase]['head']):>17}"
    verdict = "fits" if result["fits"] else "does NOT fit"
    lines += [
        "",
        f"peak {format_bytes(result['peak_bytes'])} per rank ({result['peak_phase']}): {verdict}",
        "",
    ]
    lines.append(f"{'option':<28}{'peak':>12}{'cost':>9}{'recompute GFLOP':>17}  fits")
    for o in result["options"]:
        peak = format_bytes(o["peak_bytes"]) if o["peak_bytes"] is not None else "-"
        cost = f"{o['cost']:.3f}" if o["cost"] is not None else "-"
        lines.append(
            f"{o['name']:<28}{peak:>12}{cost:>9}{o['recompute_flops'] / 1e9:>17.2f}  {'yes' if o['fits'] else 'no'}"
        )
        if o["peak_bytes"] is None and o["note"]:  # no step to predict: why
            lines.append(f"    {o['note']}")
    best = result["cheapest"]
    if best is None:
        lines += ["", "No combination of the options fits: more devices, a smaller batch or a larger device."]
    else:
        lines += [
            "",
            f"cheapest that fits: peak {format_bytes(best['peak_bytes'])}, cost {best['cost']:.3f}",
            *_accumulation_line(best["config"], result["batch_size"]),
            "",
            best["yaml"],
        ]
    for m in result["modeled"]:
        lines.append(f"# modeled: {m}")
    return "\n".join(lines)
