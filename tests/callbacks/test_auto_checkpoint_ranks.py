"""AutoCheckpoint under a limit when the ranks' batch shapes differ (variable-length data, each rank padded to
its own longest sequence): DDP and ModelParallelStrategy (FSDP2), 2 real CPU gloo processes, float64.

What must hold (issue 12): no rank hangs (``run_ranks`` kills both ranks after its timeout and fails); every
rank runs the same plan on every step, and calls the same collectives in the same order, because a
checkpointed block recomputes its forward in backward and the ranks must not disagree about which blocks do
(with blocks ``fully_shard``-ed whole, FSDP2's and OOMBackoff's hooks run around a checkpointed forward,
never inside it, so equal plans give equal collectives; DDP's reducer all-reduces buckets in a fixed
order); the blocks' bytes on every rank stay within the max_bytes of the plan it ran; parameters are equal on
both ranks and equal the training without AutoCheckpoint.
"""

from collections import Counter

import pytest
import torch

from tests.callbacks._dist_shapes_worker import LENGTHS
from tests.distributed import run_ranks

FULL = {"model.h.0": "full", "model.h.1": "full", "model.h.2": "full"}
KEEP = {"model.h.0": "keep", "model.h.1": "keep", "model.h.2": "keep"}
# made at step 1; pointwise, which drops the block's LayerNorm and functional GELU outputs, fits the max_bytes
# with less work than selective
PLAN_16 = {"model.h.0": "keep", "model.h.1": "pointwise", "model.h.2": "keep"}
PLAN_24 = {"model.h.0": "full", "model.h.1": "full", "model.h.2": "keep"}  # made at step 3


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    run_ranks("tests.callbacks._dist_shapes_worker:main", out, timeout=240)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_ranks_with_different_shapes_run_the_same_plans_within_budget(results, kind):
    ours, theirs = results[0][kind], results[1][kind]
    for rank, result in enumerate((ours, theirs)):
        assert [row["shape"] for row in result["auto_steps"]] == [[4, t] for t in LENGTHS[rank]]
    # Plans are made at step 0 (both 8 tokens), 1 (only rank 1 longer: 16) and 3 (rank 1: 24); at step 4
    # rank 0's 24 tokens run the plan made on rank 1's 24 (kept under both ranks' shapes), no new profile.
    assert [row["ran"] for row in ours["auto_steps"]] == [FULL, FULL, PLAN_16, FULL, PLAN_24, PLAN_24]
    for run in ("auto", "backoff"):
        assert [row["ran"] for row in ours[f"{run}_steps"]] == [row["ran"] for row in theirs[f"{run}_steps"]]
        assert [row["plans_made"] for row in ours[f"{run}_steps"]] == [1, 2, 2, 3, 3, 3]
        plans = ours[f"{run}_plans"]
        assert plans == theirs[f"{run}_plans"]  # the same plans, under the same shapes, on both ranks
        # With OOMBackoff the micro-batch a plan was profiled on is part of its key (checkpointing/shape_plans.py
        # step_signature): 4 samples, then 2 from rank 1's out-of-memory error at the 24-token step on.
        micro = {"auto": [[], [], []], "backoff": [[[4]], [[4]], [[2]]]}[run]
        assert [(p["shapes"], p["also"]) for p in plans] == [
            ([[4, 8], *micro[0]], []),
            ([[4, 8], *micro[1]], [[[4, 16], *micro[1]]]),
            ([[4, 8], *micro[2]], [[[4, 24], *micro[2]]]),
        ]
        # Equal plans, equal collectives: the same sequence on both ranks (a hang or a mismatch otherwise).
        assert ours[f"{run}_collectives"] == theirs[f"{run}_collectives"]
        for rank, result in enumerate((ours, theirs)):
            for step, row in enumerate(result[f"{run}_steps"]):
                assert row["held"] <= row["max_bytes"], f"{run}, rank {rank}, step {step}: {row}"
                if row["ran"] != FULL:  # a planned step: within the plan's own prediction too
                    assert row["held"] <= row["predicted"], f"{run}, rank {rank}, step {step}: {row}"
    # The plan's figures are the largest over ranks: exact on the rank whose batch was the largest.
    for run in ("auto", "backoff"):
        assert ours[f"{run}_steps"][2]["held"] == ours[f"{run}_steps"][2]["predicted"]  # 16 tokens, plan 16
        assert theirs[f"{run}_steps"][5]["held"] == theirs[f"{run}_steps"][5]["predicted"]  # 24, plan 24
    assert ours["auto_steps"][5]["held"] < ours["auto_steps"][5]["predicted"]  # 12 tokens under plan 24

    # AutoCheckpoint's own collectives: one all-reduce per step after the first (a flag per plan made: 1, 2,
    # 2, 3, 3 of them) and one all_gather_object per profile (3); FSDP2 also gathers each block's parameters
    # once per profile (3 x 3): all_gather_single on torch 2.13, all_gather_into_tensor before.
    added = Counter(ours["auto_collectives"]) - Counter(ours["plain_collectives"])
    expected = Counter({("all_reduce", 1): 1, ("all_reduce", 2): 2, ("all_reduce", 3): 2})
    expected[("all_gather_object", -1)] = 3
    if kind == "fsdp2":
        gathers = [c for c in added if c[0] in ("all_gather_single", "all_gather_into_tensor")]
        expected.update({c: added[c] for c in gathers})
        assert sum(added[c] for c in gathers) == 9
    assert added == expected and not Counter(ours["plain_collectives"]) - Counter(ours["auto_collectives"])

    # OOMBackoff: rank 1 ran out of memory in a checkpointed block's backward at step 3; both backed off to 2.
    assert ours["backoff_state"] == [2, 1, 0] and theirs["backoff_state"] == [2, 1, 1]
    for result in (ours, theirs):
        assert torch.equal(result["auto"], ours["auto"]) and torch.equal(result["backoff"], ours["backoff"])
        assert _rel(result["auto"], result["plain"]) <= 1e-10
        assert _rel(result["backoff"], result["plain"]) <= 1e-10


@pytest.mark.timeout(300)
def test_a_batch_too_long_on_one_rank_fails_every_rank_alike(results):
    """Rank 1 alone gets 64 tokens, too many for any plan: both ranks plan on the same figures and raise the
    same error (before, only rank 1 raised and rank 0 waited in its next collective)."""
    ours, theirs = (result.get("infeasible") for result in results)
    assert ours is not None and ours == theirs
    assert ours.startswith("AutoCheckpoint: max_memory=610000") and "Pass max_memory >=" in ours
