"""OOMBackoff under DDP and FSDP2 (ModelParallelStrategy): an OOM on rank 1 only, in forward, backward or
the optimizer step, with 2 gloo CPU processes.

For each run: the size both ranks end at, their retries, the small collectives (``any_rank`` and sync
points) per training step, and the largest relative difference of each rank's parameters from the
single-process run of the same 2 steps (batch 20 = two ranks of 10; ``stepclip``: with the same
gradient clipping). The runs are the 2-process tests'
(tests/callbacks/distributed_worker.py). Run from the repository root: python benchmarks/distributed_oom.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = (
    "ddp:forward",
    "ddp:backward",
    "ddp:step",
    "ddp:overlap",
    "fsdp2:forward",
    "fsdp2:backward",
    "fsdp2:step",
    "fsdp2:stepclip",
    "fsdp2:overlap",
    "fsdp2root:backward",
    "ddp:validation",
    "fsdp2:validation",
)


def main() -> None:
    import torch

    from tests.batching.helpers import Net, fit
    from tests.callbacks.distributed_worker import CLIP
    from tests.distributed import run_ranks

    out = Path(tempfile.mkdtemp())
    start = time.perf_counter()
    run_ranks("tests.callbacks.distributed_worker:main", out, *RUNS, timeout=300)
    seconds = time.perf_counter() - start
    references = {}
    for clip in (None, CLIP):
        reference = Net()
        fit(reference, steps=2, batch=20, tmp_path=out, gradient_clip_val=clip)
        references[clip] = {name: p.detach() for name, p in reference.named_parameters()}
    print(f"2 ranks, {len(RUNS)} fits in one launch: {seconds:.1f} s\n")
    print(
        "| run | size (rank 0, 1) | retries | small collectives per step | max rel. param diff vs 1 process |"
    )
    print("|---|---|---|---|---|")
    for spec in RUNS:
        ranks = [json.loads((out / f"{spec.replace(':', '-')}-rank{r}.json").read_text()) for r in range(2)]
        expected = references[CLIP if spec.endswith("clip") else None]
        worst = 0.0
        for r in ranks:
            for name, value in expected.items():
                got = torch.tensor(r["params"][name])
                worst = max(worst, ((got - value).abs().max() / value.abs().max()).item())
        sizes = ", ".join(str(r["micro_batch_size"]) for r in ranks)
        retries = ", ".join(str(r["oom_retries"]) for r in ranks)
        collectives = " / ".join(str(r["collectives"]) for r in ranks)
        print(f"| {spec} | {sizes} | {retries} | {collectives} | {worst:.1e} |")


if __name__ == "__main__":
    main()
