"""AutoCheckpoint with DDP and ModelParallelStrategy (FSDP2): 2 real CPU gloo processes."""

import json

import pytest
import torch

from tests.distributed import run_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    run_ranks("tests.callbacks._dist_worker:main", out, timeout=150)
    return out


def _rank_1_failed_at_step(tmp_path, result: dict, rank: int, key: str, step: int) -> dict:
    """``result[key]`` of a scenario where rank 1 alone ran out of memory in optimizer step ``step``, down to
    one sample: that rank's failures, none on rank 0, and everything else the same on both ranks."""
    mine, other = result[key], torch.load(tmp_path / "ddp_params0.pt")[key]
    if rank == 1:
        assert mine["failed"][-1] == (step, 1) and {s for s, _ in mine["failed"]} == {step}
    else:
        assert mine["failed"] == []
    assert {k: v for k, v in mine.items() if k != "failed"} == {
        k: v for k, v in other.items() if k != "failed"
    }
    return mine


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
            # OOMBackoff, rank 1 out of memory in a checkpointed sharded block's backward: both ranks back
            # off to 1 sample and train exactly as size 1 from the start (the retry restores RNG: the
            # same dropout masks)
            rank_raised = [0, 2][rank]
            assert result["backoff"] == [1, 2, rank_raised]
            torch.testing.assert_close(result["backed_off"], result["size_one"], rtol=1e-6, atol=1e-7)
            assert result["seen_first"][0] == {
                "model.h.0": "selective",
                "model.h.1": "full",
                "model.h.2": "offload",
            }
            # Blocks fully_shard-ed in configure_model are profiled (parameters gathered, FSDP's hooks
            # bypassed) and planned under a budget; both ranks choose the same plan, which holds exactly
            # the predicted bytes and trains exactly as without checkpointing.
            # Recompute goes to the early blocks: their backward runs last, when the others are freed.
            assert result["budgeted_plan"] == {
                "model.h.0": "full",
                "model.h.1": "selective",
                "model.h.2": "keep",
            }
            assert result["seen_budgeted"][1] == result["budgeted_plan"]
            planned, predicted, measured = result["budgeted_bytes"]
            assert planned == predicted == measured == 70208
            torch.testing.assert_close(result["budgeted"], result["plain"], rtol=1e-6, atol=1e-7)
            assert result["seen_pointwise"][0] == dict.fromkeys(sorted(names), "pointwise")
            torch.testing.assert_close(result["pointwise"], result["plain"], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(result["pointwise_rerun"], result["plain_h8"], rtol=1e-6, atol=1e-7)
        if kind == "ddp":  # rank-dependent probe timings: one decision on both ranks, recompute (rank 1's)
            decided = result["decided"]
            assert decided == torch.load(tmp_path / "ddp_params0.pt")["decided"]
            assert set(decided["choices"].values()) != {"keep"} and decided["seen"] == decided["choices"]
            # 9 fit recomputed: a batch of 16 runs as 2 micro-batches of 8, the size the search stops at,
            # timed in its trial step, priced at rank 1's 100 + 8 x 1.3 s (the longest over ranks)
            assert decided["size"] == 8 and decided["seconds"] == pytest.approx(2 * (100 + 8 * 1.3))
            # rank-dependent probe timings: rank 0's alone would rule recompute out; agreed, neither rank
            # does, and both search it (its probes, the same on both), try it and decide alike
            probed = result["probe_decided"]
            assert probed == torch.load(tmp_path / "ddp_params0.pt")["probe_decided"]
            assert probed["size"] == 16  # recomputed, the batch of 16 fits whole (kept, 5 do)
            # the head in the decision: rank 1's launch cost makes the chunked head's fewer micro-batches the
            # faster step on both ranks (seconds the longest over ranks); neither rank keeps its own head
            head = result["head_decided"]
            assert head == torch.load(tmp_path / "ddp_params0.pt")["head_decided"]
            assert head["own_head"] is False and set(head["heads"]) == {"chunked"}
            # rank 1 alone out of memory at every size in the kept way's trial step, the step that runs the
            # one-time check, down to one sample: both ranks agree on each failure (before the check, not in
            # its collectives), end the trial before the retry and recompute from there, one plan, no hang
            oom = _rank_1_failed_at_step(tmp_path, result, rank, "oom_decided", step=1)
            assert set(oom["choices"].values()) != {"keep"} and oom["seen"][-1] == oom["choices"]
            # after plain micro-batches won, rank 1 alone out of memory at every size with every block kept
            # (step 7): at one sample both ranks recompute from then on, that step profiled on both
            fell = _rank_1_failed_at_step(tmp_path, result, rank, "fell_back", step=7)
            assert fell["treated"][6] == ["keep"] and fell["treated"][7] == ["full"]  # kept, then recomputed
            assert fell["per_shape"] and fell["plans"] >= 1
            assert fell["steps"] == 9
        # the first block's profile out of memory on rank 1 alone: no plan on either rank, every block full;
        # under FSDP2 rank 1 goes on gathering the later blocks with rank 0 (else: a hang)
        unprofiled = result["unprofiled"]
        assert unprofiled == torch.load(tmp_path / f"{kind}_params0.pt")["unprofiled"]
        assert set(unprofiled["choices"].values()) == {"full"} and not unprofiled["predicted"]
        assert unprofiled["seen"] == {f"model.{n}": "full" for n in ("h.0", "h.1", "h.2")}
        plan = json.loads((tmp_path / f"{kind}_plan{rank}.json").read_text())
        assert plan["choices"] == dict.fromkeys(names, "full")  # CPU, no budget: every block
        assert all(seen == plan["choices"] for seen in plan["seen"])
        assert plan["predicted"]  # profiled on the first batch, sharded blocks too
    p0, p1 = (torch.load(tmp_path / f"{kind}_params{r}.pt")["checkpointed"] for r in range(2))
    assert torch.equal(p0, p1)
