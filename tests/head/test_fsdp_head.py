"""The chunked head under FSDP2 (ModelParallelStrategy's sharding) on 2 real gloo processes: taken where
the head is part of the root's unit (FSDP2's hooks walk the output, whose logits are not computed), and
declined with a note where the head is sharded on its own (its weight is gathered only in its forward)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_ranks

pytest.importorskip("transformers")


@pytest.mark.parametrize("shard_head", ["0", "1"])
def test_fsdp2_takes_the_head_in_the_root_unit_and_declines_a_head_sharded_on_its_own(tmp_path, shard_head):
    run_ranks("tests.head.fsdp_worker:main", str(tmp_path), shard_head)
    for rank in range(2):
        runs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        own, auto = runs["keep"], runs["auto"]
        assert own["notes"] == [] and own["logits"]
        reference = {n: torch.tensor(g) for n, g in own["grads"].items()}
        largest = max(float(g.abs().max()) for g in reference.values())
        gap = max(float((torch.tensor(auto["grads"][n]) - g).abs().max()) for n, g in reference.items())
        if shard_head == "1":
            assert auto["notes"] == [
                "the chunked output head (lightning_memopt.head) is not used: FSDPLlamaForCausalLM's output "
                "head is sharded on its own (fully_shard on it)"
            ]
            assert auto["logits"] and auto["loss"] == own["loss"] and gap == 0.0
        else:
            # taken: the model's own loss upcasts its float64 logits to float32, the chunked one does not
            assert auto["notes"] == [] and not auto["logits"]
            assert abs(auto["loss"] - own["loss"]) <= 1e-6 * abs(own["loss"]) and gap <= 1e-6 * largest


def test_autocheckpoint_takes_the_head_under_ddp_and_fsdp2_in_lightning(tmp_path):
    """AutoCheckpoint() (head="auto") on a tiny float64 GPT-2 under DDP and ModelParallelStrategy (FSDP2)
    on 2 gloo ranks: every step's loss computed chunked (no logits), and after 2 SGD steps the parameters
    equal head="keep"'s to 1e-6 of the update (the model's own loss upcasts its logits to float32)."""
    run_ranks("tests.head.lightning_worker:main", str(tmp_path))
    for rank in range(2):
        runs = torch.load(tmp_path / f"rank{rank}.pt")
        for kind in ("ddp", "fsdp2"):
            own, auto = runs[f"{kind}-keep"], runs[f"{kind}-auto"]
            assert own["had_logits"] == [True, True] and auto["had_logits"] == [False, False]
            assert torch.equal(own["initial"], auto["initial"])
            update = (own["final"] - own["initial"]).abs().max()
            assert update > 1e-3  # the two steps trained
            assert (auto["final"] - own["final"]).abs().max() <= 1e-6 * update, kind
