"""``examples/fabric/train.py``: Fabric and ``auto_checkpoint``, a few steps of a tiny GPT on the CPU."""

from __future__ import annotations

import pytest

from lightning_memopt.memory import format_bytes
from tests.examples.test_examples import EXAMPLES, _load

TINY = ["--steps=3", "--n-layer=2", "--n-head=2", "--n-embd=32", "--block-size=32", "--batch-size=4"]
TINY += ["--max-bytes=100000", "--accelerator=cpu"]


@pytest.fixture(scope="module")
def fabric_train():
    return _load("fabric_train", EXAMPLES / "fabric" / "train.py")


def test_fabric_example_saves_memory_and_learns_the_same(fabric_train, capsys):
    plain = fabric_train.main([*TINY, "--no-auto-checkpoint"])
    assert plain["peak_after"] == plain["peak_before"] and "plan" not in plain
    capsys.readouterr()
    run = fabric_train.main(TINY)
    out = capsys.readouterr().out
    assert run["plan"] == {"blocks.0": "full", "blocks.1": "full"}  # CPU, no limit: full where it helps
    assert run["peak_before"] == plain["peak_before"]
    assert run["peak_after"] < run["peak_before"]
    saved = 1 - run["peak_after"] / run["peak_before"]
    line = (
        f"one step's peak: {format_bytes(run['peak_before'])} without, "
        f"{format_bytes(run['peak_after'])} with auto_checkpoint: {saved:.0%} saved"
    )
    assert line in out and "auto_checkpoint plan (no limit):" in out
    assert len(run["losses"]) == 3 and run["losses"] == plain["losses"]  # recompute changes no number


def test_fabric_example_under_a_limit(fabric_train, capsys):
    run = fabric_train.main([*TINY, "--max-memory=900KiB", "--headroom=0"])
    assert "auto_checkpoint plan (max_memory='900KiB'):" in capsys.readouterr().out
    assert run["peak_after"] < run["peak_before"] and set(run["plan"]) == {"blocks.0", "blocks.1"}
