"""DDP with ``find_unused_parameters=True``: a branch used on some batches, a layer never used.

Two real gloo processes on CPU (:mod:`tests.patterns.ddp_worker`), float64, AdamW with weight decay.
Plain DDP leaves the gradient of a parameter no rank used in a step as None, so the optimizer skips it;
split (``AutoAccumulation(micro_batch_size=2)``) or retried after an OOM on rank 1 only
(``OOMBackoff``), each step must leave the same gradients None, end with the plain run's parameters and
log the plain run's ``sync_dist`` loss. One launch of the two processes runs the three (start-up
dominates the time).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_ranks
from tests.patterns.helpers import BAR, BATCH, MODES, K, update_difference

RANKS = range(2)
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("ddp_patterns")
    run_ranks("tests.patterns.ddp_worker:main", out, timeout=200)
    return {
        mode: [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in RANKS]
        for mode in ("plain", *MODES)
    }


def relative_update(result: dict, plain: dict) -> float:
    """The parameters' difference from plain DDP's, relative to its update (the runs start alike)."""
    assert result["start"] == plain["start"]

    def tensors(params: dict[str, list]) -> dict[str, torch.Tensor]:
        return {name: torch.tensor(value, dtype=torch.float64) for name, value in params.items()}

    return update_difference(tensors(result["params"]), tensors(plain["params"]), tensors(plain["start"]))


def test_plain_ddp_leaves_unused_gradients_none(results) -> None:
    """What the package must match: the never-used layer, and the branch on even batches, have no
    gradient; everything else has one."""
    for r in RANKS:
        steps = results["plain"][r]["grad_is_none"]
        assert [s["never.weight"] for s in steps] == [True, True, True]
        assert [s["branch.weight"] for s in steps] == [True, False, True]
        assert not any(s["net.weight"] or s["head.weight"] for s in steps)


@pytest.mark.parametrize("mode", MODES)
def test_the_runs_were_split(results, mode: str) -> None:
    """The runs compared below were split, or retried after the OOM injected on rank 1 only."""
    for r in RANKS:
        assert results["plain"][r]["sizes"] == [BATCH] * 3
        assert min(results[mode][r]["sizes"]) <= (K if mode == "split" else BATCH // 2)
    assert results["oom"][1]["oom_raised"] >= 1


@pytest.mark.parametrize("mode", ["split", "oom"])
def test_unused_parameters_keep_grad_none(results, mode: str) -> None:
    for r in RANKS:
        assert results[mode][r]["grad_is_none"] == results["plain"][r]["grad_is_none"], f"rank {r}"


@pytest.mark.parametrize(
    "mode",
    ["split", "oom"],
)
def test_parameters_match_plain_ddp(results, mode: str) -> None:
    for r in RANKS:
        rel = relative_update(results[mode][r], results["plain"][r])
        assert rel <= BAR, f"rank {r}: parameters differ from plain DDP by {rel:.3g} of the update"


@pytest.mark.parametrize(
    "mode",
    [
        "split",
        "oom",
    ],
)
def test_logged_sync_dist_loss_matches_plain_ddp(results, mode: str) -> None:
    for r in RANKS:
        got, expected = results[mode][r]["logged"], results["plain"][r]["logged"]
        assert got == pytest.approx(expected, rel=BAR, abs=0), f"rank {r}"
