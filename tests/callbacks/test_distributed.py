"""Two real CPU processes (gloo): an OOM on rank 1 only makes both ranks back off, with no hang.

DDP and ModelParallelStrategy (FSDP2), with the OOM in forward, in backward or in the optimizer step;
and the number of small collectives (``any_rank`` and sync points) each step costs."""

import json
from pathlib import Path

import pytest
import torch

from tests.batching.helpers import Net, fit
from tests.distributed import run_ranks

ROOT = Path(__file__).resolve().parents[2]


RUNS = (
    "ddp:forward",
    "ddp:backward",
    "ddp:step",
    "fsdp2:forward",
    "fsdp2:backward",
    "fsdp2:step",
    "fsdp2root:backward",
    "fsdp2:stepclip",
    "ddp:validation",
    "fsdp2:validation",
    "ddp:probe",
    "ddp:overlap",
    "fsdp2:overlap",
)


def run_two_ranks(runs, tmp_path: Path) -> dict[str, list[dict]]:
    """Launch 2 ranks that run ``runs`` (``strategy:phase``) in turn; their results, by run."""
    run_ranks("tests.callbacks.distributed_worker:main", tmp_path, *runs, timeout=200)
    return {
        spec: [
            json.loads((tmp_path / f"{spec.replace(':', '-')}-rank{r}.json").read_text()) for r in range(2)
        ]
        for spec in runs
    }


def assert_both_ranks_backed_off(results, tmp_path) -> None:
    """Only rank 1 ran out of memory (at 10, then 5 samples); both ranks backed off to 3 and end with the
    single-process parameters."""
    assert [r["raised"] for r in results] == [0, 2]
    assert [r["micro_batch_size"] for r in results] == [3, 3]
    assert [r["oom_retries"] for r in results] == [2, 2]
    expected = single_process_params(tmp_path)
    for r in results:
        for name, value in expected.items():
            torch.testing.assert_close(torch.tensor(r["params"][name]), value, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_two_ranks(RUNS, tmp_path_factory.mktemp("ranks"))


def single_process_params(tmp_path) -> dict:
    # DistributedSampler(shuffle=False) gives rank r the samples r, r+2, ...: two ranks of 10 per step
    # average to the mean over the first 20 samples, which is one process with batches of 20.
    model = Net()
    fit(model, steps=2, batch=20, tmp_path=tmp_path)
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("phase", ["forward", "backward", "step"])
def test_ddp_oom_on_rank_one_only(results, tmp_path, phase):
    """``step``: rank 1's optimizer step runs out of memory while rank 0's succeeds; both agree after the
    step, rank 0 undoes its update, and both retry at the same size."""
    results = results[f"ddp:{phase}"]
    assert_both_ranks_backed_off(results, tmp_path)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("run", ["fsdp2:forward", "fsdp2:backward", "fsdp2:step", "fsdp2root:backward"])
def test_fsdp2_oom_on_rank_one_only(results, tmp_path, run):
    """ModelParallelStrategy (FSDP2 ``fully_shard``): an OOM in rank 1's forward or backward, inside the
    last sharded layer (after its all-gather), reaches rank 0 at its next sync point, before its next
    all-gather or reduce-scatter; FSDP's iteration state is reset and both ranks retry at the same size.
    ``fsdp2root``: the whole net is one FSDP unit, so rank 0 finishes the other layers' backward (their
    gradients sit unreduced on FSDP's unsharded parameters) and learns it before the reduce-scatter."""
    assert_both_ranks_backed_off(results[run], tmp_path)


@pytest.mark.timeout(240)
def test_fsdp2_optimizer_step_oom_with_gradient_clipping(results, tmp_path):
    """Rank 1's optimizer step runs out of memory (in its pre-step hook) while rank 0 clips gradients
    and steps: both ranks back off and end equal to one process with the same clipping. (No sync point
    precedes the clipping; on CPU/gloo this run ends equal, but that order is not guaranteed: README.)"""
    from tests.callbacks.distributed_worker import CLIP

    results = results["fsdp2:stepclip"]
    assert [(r["raised"], r["micro_batch_size"], r["oom_retries"]) for r in results] == [(0, 3, 2), (2, 3, 2)]
    model = Net()
    fit(model, steps=2, batch=20, tmp_path=tmp_path, gradient_clip_val=CLIP)
    for r in results:
        for name, value in model.named_parameters():
            torch.testing.assert_close(torch.tensor(r["params"][name]), value.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_validation_oom_on_rank_one_only(results, tmp_path, strategy):
    """An OOM in rank 1's first layer, in training and in validation: both ranks back off in both, to the
    same sizes (under FSDP2 rank 0 learns it at the last layer's sync point, before its all-gather), and
    the logged validation loss is the trained model's loss on that batch."""
    results = results[f"{strategy}:validation"]
    assert [r["raised"] for r in results] == [0, 4]  # training 10 and 5, validation 10 and 5
    assert [(r["micro_batch_size"], r["oom_retries"]) for r in results] == [(3, 2), (3, 2)]
    assert [(r["eval_micro_batch_size"], r["eval_oom_retries"]) for r in results] == [(3, 2), (3, 2)]
    # Validation forwards that reached the first layer (rank 1 fails inside it at 10 and 5). DDP: rank 0
    # runs each attempt to its end, then agrees. FSDP2: rank 0 learns at the last layer's sync point of
    # the first micro-batch and stops there (without it, it ran the second 5 out of step with rank 1).
    first_attempts = {"ddp": [10, 5, 5], "fsdp2": [10, 5]}[strategy]
    assert [r["val_sizes"] for r in results] == [first_attempts + [2, 2, 3, 3], [2, 2, 3, 3]]
    for r in results:
        assert r["validation"]["logged"] == pytest.approx(r["validation"]["expected"], rel=1e-6)
    expected = single_process_params(tmp_path)
    for r in results:
        for name, value in expected.items():
            torch.testing.assert_close(torch.tensor(r["params"][name]), value, rtol=1e-6, atol=1e-7)


# Small collectives per training step (both ranks call each one). Step 0 runs out of memory on rank 1 at
# 10 and 5 samples and succeeds at 3 ([2, 2, 3, 3]); it is the first step at its size, so the ranks also
# agree after the optimizer step. Step 1 is stable at [2, 2, 3, 3].
# DDP: one agreement per attempt, plus one after the optimizer step while unsettled.
# FSDP2 (2 sharded Linear layers, a root without parameters of its own), per micro-batch: 2 before the
# layers' forward all-gathers + 1 on the loss before backward + 2 before the backward all-gathers + 1
# before the last layer's reduce-scatter + 1 before FSDP's final callback (first layer's reduce-scatter)
# = 7, plus the step's agreement.
COLLECTIVES = {
    # forward OOM: attempts 10 and 5 stop at the second layer's forward sync point on rank 0
    "ddp:forward": [3 + 1, 1],
    "fsdp2:forward": [(2 + 1) + (2 + 1) + (4 * 7 + 1) + 1, 4 * 7 + 1],
    # backward OOM in the last layer (the injector's node sits between FSDP's pre-backward hook and the
    # layer's own output hook): rank 0 learns it at that output hook, before the layer's reduce-scatter
    "fsdp2:backward": [(2 + 1 + 1) * 2 + (4 * 7 + 1) + 1, 4 * 7 + 1],
    # optimizer-step OOM: every attempt trains fully, agrees, steps, and agrees again
    "ddp:step": [(1 + 1) * 3, 1],
    # one FSDP unit (P = 1, R = 0: 4 per micro-batch); rank 0 learns it before FSDP's final callback
    "fsdp2root:backward": [4 * 2 + (4 * 4 + 1 + 1), 4 * 4 + 1],
    "fsdp2:step": [(7 + 1 + 1) + (2 * 7 + 1 + 1) + (4 * 7 + 1 + 1), 4 * 7 + 1],
    # overlap_after=1: step 1 agrees once, before its last micro-batch (DDP), or not at all (FSDP2)
    "ddp:overlap": [3 + 1, 1],
    "fsdp2:overlap": [(2 + 1) + (2 + 1) + (4 * 7 + 1) + 1, 0],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("run", sorted(COLLECTIVES))
def test_small_collectives_per_step(results, run):
    assert [r["collectives"] for r in results[run]] == [COLLECTIVES[run]] * 2


@pytest.mark.timeout(240)
def test_ddp_probing_agrees_on_the_smallest_device(results, tmp_path):
    """AutoAccumulation under DDP: rank 1 is given less memory; both ranks probe the same sizes (one
    agreed peak per probe) and train with the same micro-batch, equal to one process's result."""
    results = results["ddp:probe"]
    sizes = [r["micro_batch_size"] for r in results]
    assert sizes[0] == sizes[1] and 1 < sizes[0] < 10
    assert results[0]["probes"] == results[1]["probes"] and len(results[0]["probes"]) <= 6
    expected = single_process_params(tmp_path)
    for r in results:
        for name, value in expected.items():
            torch.testing.assert_close(torch.tensor(r["params"][name]), value, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_overlap_after_stable_steps(results, tmp_path, strategy):
    """OOMBackoff(overlap_after=1): the first step backs off (OOM on rank 1). DDP: the second runs its last
    micro-batch with DDP's own gradient sync inside backward, after agreeing on the first three. FSDP2:
    the second runs without sync points or agreement."""
    results = results[f"{strategy}:overlap"]
    assert [r["micro_batch_size"] for r in results] == [3, 3]
    assert [r["overlapped"] for r in results] == [True, True]
    expected = single_process_params(tmp_path)
    for r in results:
        for name, value in expected.items():
            torch.testing.assert_close(torch.tensor(r["params"][name]), value, rtol=1e-6, atol=1e-7)
