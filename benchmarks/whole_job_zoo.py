"""The user's whole job on the zoo's third-party models: the three callbacks against the unsplit batch.

Run from the repository root (never run by the test suite; about a minute a model on 2 CPU cores)::

    PYTHONPATH=. python benchmarks/whole_job_zoo.py                          # 32-true, every model below
    PYTHONPATH=. python benchmarks/whole_job_zoo.py --precision bf16-mixed --only llama swin
    PYTHONPATH=. /path/to/torch-2.11/venv/bin/python benchmarks/whole_job_zoo.py --precision bf16-mixed

For each model of :data:`tests.zoo.models.ZOO` named (dropout off, SGD at 0.01), a limit ``L`` in live
tensor bytes is read from the model: a plain step's peak at 4 samples plus half its growth to 8 (the
second micro-batch of an accumulated step, its optimizer step included, under a MemoryTracker), so that a
batch of 16 does not fit whole. Then ``AutoCheckpoint(max_memory=L), AutoAccumulation(max_memory=L),
OOMBackoff()`` train ``--steps`` steps on batches of 16, and the same fit without the package on the
unsplit batches is the reference. A row prints the largest difference of any parameter from the
reference and the largest change of the reference's update (float32: rounding; under bf16-mixed, bf16's
rounding carried through the steps), what the callbacks decided and every warning the fit gave (the
exactness check's names its cause: BatchNorm layers in ResNet, MobileNetV2, EfficientNet), or the error
that stopped the fit.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_memopt import AutoAccumulation, AutoCheckpoint, OOMBackoff  # noqa: E402
from tests.batching.helpers import quiet_trainer  # noqa: E402
from tests.zoo.models import ZOO, ZooModule, loader, no_dropout, whole_job_limit  # noqa: E402

BATCH = 16
NOTES = ("AutoCheckpoint", "AutoAccumulation", "OOMBackoff")


def module(name: str) -> ZooModule:
    return no_dropout(ZooModule(name, lr=0.01))


def row(name: str, precision: str, steps: int) -> str:
    cap = whole_job_limit(name, BATCH, precision)
    reference = module(name)
    quiet_trainer(max_steps=steps, precision=precision).fit(reference, loader(name, BATCH, batches=steps))
    trained = module(name)
    callbacks = [AutoCheckpoint(max_memory=cap), AutoAccumulation(max_memory=cap), OOMBackoff()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            quiet_trainer(callbacks, max_steps=steps, precision=precision).fit(
                trained, loader(name, BATCH, batches=steps)
            )
        except Exception as error:  # noqa: BLE001 - the row says what stopped the fit
            print(traceback.format_exc(), file=sys.stderr)
            return f"| {name} | {cap:,} | stopped: {type(error).__name__}: {str(error)[:300]} | | |"
    start = module(name).parameters()
    update = max((p - s).abs().max().item() for p, s in zip(reference.parameters(), start))
    gap = max((p - r).abs().max().item() for p, r in zip(trained.parameters(), reference.parameters()))
    said = [str(w.message) for w in caught]
    decided = "; ".join(s for s in said if s.startswith(NOTES)) or "(undecided within the steps)"
    others = "; ".join(s[:200] for s in said if "unsplit batch's gradient" in s) or "none"
    return f"| {name} | {cap:,} | {gap:.2e} of an update of {update:.2e} | {decided[:240]} | {others} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", nargs="+", choices=sorted(ZOO), default=sorted(ZOO))
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    import torch

    print(f"torch {torch.__version__}, {args.precision}, batch {BATCH}, {args.steps} steps\n")
    print("| model | limit (bytes) | parameters vs the unsplit batch | decided | exactness warning |")
    print("|---|---:|---|---|---|")
    for name in args.only:
        print(row(name, args.precision, args.steps), flush=True)


if __name__ == "__main__":
    main()
