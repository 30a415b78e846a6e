"""A rank of the FSDP2 check: shard TinyLM over 2 gloo ranks, measure one step per rank (five times, each on
a freshly built and sharded model), write the records as JSON."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

RUNS = 5


def measure(out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_memopt.checkpointing import find_blocks
    from lightning_memopt.planning.predict import predict_step, shard_module
    from tests.planning.modules import TinyLM

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2,))
        records = []
        for _ in range(RUNS):
            torch.manual_seed(0)
            module = TinyLM(width=32, layers=3)
            shard_module(module, [b for _, b in find_blocks(module)], mesh)
            batch = torch.randint(0, 64, (4, 16))
            records.append(predict_step(module, batch).record)
            del module
        with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(records, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    measure(sys.argv[1])
