"""AutoCheckpoint with DDP and ModelParallelStrategy (FSDP2): 2 real CPU gloo processes."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_dist_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path) -> None:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE="2",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            PYTHONPATH=str(ROOT),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        outputs = [p.communicate(timeout=100)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-3000:]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    _launch(out)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_two_process_training_matches_plain(results, kind):
    names = {"model.h.0", "model.h.1", "model.h.2"}
    tmp_path = results
    for rank in range(2):
        result = torch.load(tmp_path / f"{kind}_params{rank}.pt")
        # Same initialization, data and dropout masks: checkpointing changes no parameter (fp32, rel 1e-6).
        torch.testing.assert_close(result["checkpointed"], result["plain"], rtol=1e-6, atol=1e-7)
        if kind == "fsdp2":  # checkpointing applied before fully_shard (torchtitan's order) trains the same
            torch.testing.assert_close(result["checkpoint_first"], result["plain"], rtol=1e-6, atol=1e-7)
            assert result["seen_first"][0] == {
                "model.h.0": "selective",
                "model.h.1": "full",
                "model.h.2": "offload",
            }
        plan = json.loads((tmp_path / f"{kind}_plan{rank}.json").read_text())
        assert plan["choices"] == dict.fromkeys(names, "full")  # CPU, no budget: every block
        assert all(seen == plan["choices"] for seen in plan["seen"])
        # DDP blocks are profiled on the first batch; FSDP2-sharded blocks are not (see AutoCheckpoint).
        assert plan["predicted"] is (kind == "ddp")
    p0, p1 = (torch.load(tmp_path / f"{kind}_params{r}.pt")["checkpointed"] for r in range(2))
    assert torch.equal(p0, p1)
