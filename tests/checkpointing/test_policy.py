"""A step's memory limit turned into the blocks' share, and the plan chosen after the first batch: plain
torch, no Trainer (checkpointing/policy.py, the mode policy in checkpointing/planner.py)."""

import pytest
import torch
from torch import nn

from lightning_memopt.checkpointing import (
    BlockProfile,
    NoPlanFitsError,
    OptionCost,
    PlanPolicy,
    StepLimit,
    check_mode,
    initial_choices,
    plan_step,
    prediction_gap,
    state_bytes,
)

KF = ["keep", "full"]  # the treatments the profiles below have


def _profiles() -> list[BlockProfile]:
    """Two chained blocks, 100-byte boundaries, 1000 bytes inside; ``full`` costs 100 FLOPs.

    Peaks (Plan.peak_bytes): keep+keep 2200; full+keep 1200 (block 1 holds 1100 after block 0's input);
    full+full 1200 (block 1 recomputes its 1100 while block 0 holds its 100 input); keep+full 2200. The
    least is 1200, and full+keep is the cheaper plan reaching it.
    """
    options = {"keep": OptionCost(1000, True, False), "full": OptionCost(0, True, False, recompute_flops=100)}
    return [BlockProfile(f"b{i}", 1000, 100, 100, i == 1, dict(options)) for i in range(2)]


def test_plan_step_gives_the_blocks_the_limit_minus_states_and_outside():
    # usable 2000 - states 500 - outside 300 = 1200 for the blocks: exactly the least peak.
    plan = plan_step(_profiles(), StepLimit.resolve(4000, 0.5, None), states=500, outside=300, allowed=KF)
    assert (list(plan.choices.values()), plan.max_bytes, plan.peak_bytes) == (["full", "keep"], 1200, 1200)
    assert plan.extra_flops == 100
    assert plan.metrics(measured=1300) == {  # logged by AutoCheckpoint under checkpoint/
        "activation_bytes_predicted": 1200.0,
        "activation_bytes_measured": 1300.0,
        "recompute_gflops": 100 / 1e9,
    }


def test_backwards_first_transient_sits_beside_the_activations_kept():
    # 100 bytes beside the activations when backward starts (the loss's gradient w.r.t. the logits):
    # full+keep would hold 1200 + 100 > 1200 then; full+full holds 200 + 100, and 1200 recomputing block 1.
    limit = StepLimit.resolve(4000, 0.5, None)
    plan = plan_step(_profiles(), limit, states=500, outside=300, transient=100, allowed=KF)
    assert (list(plan.choices.values()), plan.peak_bytes, plan.transient) == (["full", "full"], 1200, 100)
    # Beside 1100 bytes even full+full's end of forward (200 + 1100) is over: the step needs 1300 for them.
    with pytest.raises(NoPlanFitsError) as info:
        plan_step(_profiles(), limit, states=500, outside=300, transient=1100, allowed=KF)
    assert info.value.minimum == StepLimit(4000, 0.5, 2000).needed(500 + 300 + 1300)
    assert "the blocks' smallest peak with backward's first 1.07 KiB beside them (1.27 KiB)" in str(
        info.value
    )


def test_plan_step_errors_say_what_the_step_needs_in_the_users_terms():
    limit = StepLimit.resolve(4000, 0.5, None)
    # One byte short: the step needs 500 + 301 + 1200 = 2001 usable bytes, a limit of 2001 / 0.5 + 1.
    with pytest.raises(NoPlanFitsError) as info:
        plan_step(_profiles(), limit, states=500, outside=301, allowed=KF)
    assert info.value.minimum == 4003
    assert str(info.value) == (
        "max_memory=4000 (usable with headroom=0.5: 1.95 KiB) is too small for any plan; it must hold the "
        "parameters, gradients and optimizer state (500 B), the activations outside the blocks (301 B) and "
        "the blocks' smallest peak (1.17 KiB): 1.95 KiB in all. Pass max_memory >= 3.91 KiB, use a smaller "
        "micro-batch (AutoAccumulation) or shard the model (FSDP)."
    )
    with pytest.raises(NoPlanFitsError, match=r"^max_memory=4000 \(.*\) does not even hold the param"):
        plan_step(_profiles(), StepLimit(4000, 0.5, 2000), states=1900, outside=200, allowed=KF)
    with pytest.raises(
        ValueError, match="the capacity leaves no known usable bytes; pass max_memory in bytes"
    ):
        plan_step(_profiles(), StepLimit.resolve(None, 0.1, None), states=0, outside=0, allowed=KF)


def test_plan_policy_per_mode_and_limit():
    profiles, calls = _profiles(), []

    def held():
        calls.append(1)
        return 500, 300, 0

    def policy(mode, max_memory):
        return PlanPolicy(mode, StepLimit.resolve(max_memory, 0.5, None), tuple(KF))

    # A forced mode runs what it ran; nothing is asked of the ranks.
    forced = policy("full", 4000).choose(profiles, ["full", "full"], held)
    assert list(forced.choices.values()) == ["full", "full"] and calls == []
    # Auto without a limit: full, except where keeping raises neither bytes nor peak; block 1 stays full
    # (kept, it would hold 1200 bytes at the end of the forward instead of 200).
    auto = policy("auto", None).choose(profiles, ["full", "full"], held)
    assert list(auto.choices.values()) == ["full", "full"] and calls == []
    # Auto under a limit: planned, with held() asked once.
    planned = policy("auto", 4000).choose(profiles, ["full", "full"], held)
    assert (list(planned.choices.values()), planned.max_bytes, calls) == (["full", "keep"], 1200, [1])
    # Chosen once: the treatments the mode can choose (offload only where allowed), given the limit.
    resolved = PlanPolicy.for_mode("auto", StepLimit.resolve("1KiB", 0.0, None), offload=True)
    assert resolved.treatments == ("keep", "selective", "full", "pointwise", "offload")
    unlimited = PlanPolicy.for_mode("auto", StepLimit.resolve(None, 0.1, None), offload=True)
    assert unlimited.treatments == ("keep", "full")  # no limit: full where it lowers the bytes, else keep
    assert PlanPolicy.for_mode("selective", StepLimit(None, 0.1, 10**6), offload=True).treatments == (
        "keep",
        "selective",
    )


def test_state_bytes_counts_gradients_before_they_exist_and_optimizer_state():
    model = nn.Linear(4, 4)  # 20 float32 parameters: 80 bytes
    optimizer = torch.optim.Adam(model.parameters())
    assert state_bytes(model, [optimizer]) == 80 + 80  # no gradient yet, no Adam state before a step
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()  # Adam's two moments per parameter (and a step count per tensor)
    assert state_bytes(model, [optimizer]) == 80 + 80 + 2 * 80 + sum(
        s["step"].numel() * s["step"].element_size() for s in optimizer.state.values()
    )


def test_mode_policy():
    assert initial_choices(["a", "b", "c"], "auto") == {"a": "full", "b": "full", "c": "full"}
    assert initial_choices(["a", "b", "c"], "selective") == dict.fromkeys("abc", "selective")
    assert initial_choices(["a", "b", "c", "d"], "every_n", 3) == {
        "a": "full",
        "b": "keep",
        "c": "keep",
        "d": "full",
    }
    assert prediction_gap(1000, 1100) is None
    assert prediction_gap(1000, 1101) == (
        "the blocks held 1.08 KiB for backward, the plan predicted 1000 B (more than 10% apart). The blocks' "
        "inputs or behaviour may change between batches (variable sequence length?); leave more headroom."
    )
    with pytest.raises(
        ValueError,
        match=r"mode must be one of \('auto', 'full', 'selective', 'offload', 'every_n', 'pointwise'\)",
    ):
        check_mode("fast", 2)
    with pytest.raises(ValueError, match=r"cost_model must be a CostModel, got 3; e.g. CostModel\("):
        check_mode("auto", 2, 3)
    with pytest.raises(ValueError, match="every_n must be a positive int, got 0"):
        check_mode("every_n", 0)
    from lightning_memopt.checkpointing import AutoCheckpointer

    with pytest.raises(ValueError, match=r"max_memory='1GB' is only used by mode='auto', got mode='full'"):
        AutoCheckpointer(max_memory="1GB", mode="full")


def test_plan_policy_prices_offload_by_a_copy_timed_on_the_device(monkeypatch):
    from lightning_memopt.checkpointing import CostModel, policy

    timed = CostModel(offload_flops_per_byte=123.0)
    calls = []
    monkeypatch.setattr(policy, "measured_cost_model", lambda device: calls.append(device) or timed)
    limit = StepLimit(None, 0.1, 10**6)
    # auto may offload (a CUDA device): the price comes from the timed copy
    assert PlanPolicy.for_mode("auto", limit, offload=True, device="cuda:0").cost_model is timed
    assert calls == ["cuda:0"]
    # offload not allowed: nothing is timed, the defaults hold
    assert PlanPolicy.for_mode("auto", limit, offload=False, device="cuda:0").cost_model == CostModel()
    # the user's own prices win
    mine = CostModel(offload_flops_per_byte=7.0)
    assert (
        PlanPolicy.for_mode("auto", limit, offload=True, cost_model=mine, device="cuda:0").cost_model is mine
    )
    assert calls == ["cuda:0"]
