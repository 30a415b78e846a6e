"""Run a test function in 2 real CPU processes joined by gloo: the one launcher of the distributed tests.

``run_ranks("tests.x.y:worker", *args)`` starts ``world_size`` fresh Python processes, each with the
environment Lightning reads for processes launched outside it (MASTER_ADDR/PORT, WORLD_SIZE, RANK,
LOCAL_RANK, NODE_RANK), so ``Trainer(devices=2, strategy=...)`` joins them instead of relaunching; each
calls ``worker(*args)`` and learns its rank from ``os.environ["RANK"]``. Fresh processes, not fork:
forking pytest while earlier tests' threads are alive can deadlock the children. A rank that hangs or
fails fails the test with its output, and every rank is killed, so a hang never blocks the suite.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: str, *args: str, world_size: int = 2, timeout: float = 180) -> None:
    """Run ``target`` (``"module:function"``) as ``function(*args)`` on ``world_size`` ranks; wait for all."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            OMP_NUM_THREADS="1",
        )
        cmd = [sys.executable, "-m", "tests.distributed", target, *map(str, args)]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{target}: the ranks did not finish within {timeout}s (a hang)")
    finally:
        for p in procs:
            p.kill()
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} of {target} failed:\n{text[-4000:]}"


def full_params(model) -> dict[str, list]:
    """Every parameter of ``model`` as nested lists (a sharded DTensor gathered first), for a rank's JSON."""
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
        for name, p in model.named_parameters()
    }


def run_each(out_dir: str, runs: tuple[str, ...], run) -> None:
    """``run(strategy, mode, out)`` for each ``"strategy:mode"`` of ``runs``, writing
    OUT/<strategy>-<mode>-rank<r>.json: what a worker's ``main`` does."""
    rank = int(os.environ["RANK"])
    for spec in runs:
        strategy, mode = spec.split(":")
        run(strategy, mode, os.path.join(out_dir, f"{strategy}-{mode}-rank{rank}.json"))


def _main(target: str, *args: str) -> None:
    """Run the worker, then leave without running gloo's destructors: at interpreter exit they can abort
    a rank whose work is done ("terminate called without an active exception"), failing a passing test."""
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(*args)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main(*sys.argv[1:])
