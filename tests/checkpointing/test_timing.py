"""Plans priced in seconds (checkpointing/timing.py, the planner's CostModel, AutoCheckpoint's policy):
fake clocks make the timing exact, so the tests assert what is chosen, never a wall-clock time."""

import pytest
import torch

from lightning_memopt.checkpointing import (
    BlockProfile,
    CostModel,
    OptionCost,
    PlanPolicy,
    StepLimit,
    evaluate_plan,
    find_blocks,
    plan_checkpointing,
    profile_blocks,
)
from lightning_memopt.checkpointing.planner import simple_plans
from lightning_memopt.checkpointing.ranks import largest_profiles
from lightning_memopt.checkpointing.timing import TIMING_REPEATS, Timing, time_treatments
from lightning_memopt.data.clock import CudaClock, HostClock
from tests.checkpointing.clocks import WorkClock
from tests.checkpointing.models import TinyGPT
from tests.data.helpers import FakeClock


def test_time_treatments_alternates_and_pairs_each_round_with_keep():
    clock, order = FakeClock(), []
    # keep takes 1s, full 2s, except in round 2, when the machine is busy and everything takes 10s more
    durations = {"keep": 1.0, "full": 2.0}

    def prepare(choice):
        order.append(choice)
        busy = 10.0 if len(order) in (3, 4) else 0.0
        return lambda: clock.advance(durations[choice] + busy)

    timings = time_treatments(prepare, ["keep", "full"], clock, repeats=3)
    # round-robin, never one treatment's repeats in a row; two rounds whose extras agree end it
    assert order == ["keep", "full"] * 2
    assert timings["full"] == Timing(median=7.0, extra=1.0, low=1.0, high=1.0)  # the busy round cancels
    assert timings["keep"] == Timing(median=6.0, extra=0.0, low=0.0, high=0.0)
    assert clock.settles == 4
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        time_treatments(prepare, ["keep"], clock, repeats=0)


def test_two_rounds_that_agree_end_the_timing_else_three_or_up_to_repeats():
    clock = FakeClock()

    def timed(extras, repeats=TIMING_REPEATS):  # full's extra over keep's 10 s pass, round by round
        order = []

        def prepare(choice):
            order.append(choice)
            rounds = (len(order) - 1) // 2  # the round this pass is in (0, 1, ...), two treatments a round
            return lambda: clock.advance(10.0 + (extras[rounds] if choice == "full" else 0.0))

        return time_treatments(prepare, ["keep", "full"], clock, repeats), len(order) // 2

    # A tenth of keep's pass is 1 s. Two rounds within it of each other confirm the median: two rounds.
    assert timed([1.0, 1.5]) == (
        {"keep": Timing(10.0, 0.0, 0.0, 0.0), "full": Timing(11.25, 1.25, 1.0, 1.5)},
        2,
    )
    # One round slowed by a busy moment (5 s) calls for a third, the last: the median of three is one of
    # the two that agree.
    assert timed([1.0, 5.0, 1.0]) == (
        {"keep": Timing(10.0, 0.0, 0.0, 0.0), "full": Timing(11.0, 1.0, 1.0, 5.0)},
        3,
    )
    # No two rounds within 1 s: three at most by default, the median taken
    timings, rounds = timed([1.0, 2.01, 3.02, 4.03, 5.04])
    assert rounds == TIMING_REPEATS == 3 and timings["full"].extra == pytest.approx(2.01)
    # With more repeats allowed, the rounds go on until another lies within 1 s of the median (of three; of
    # four, the two middle ones): here to five
    timings, rounds = timed([1.0, 2.01, 3.02, 4.03, 5.04], repeats=5)
    assert rounds == 5 and timings["full"].extra == pytest.approx(3.02)
    assert timed([1.0, 2.5, 2.0], repeats=5)[1] == 3  # the median, 2 s, has a round 0.5 s from it


def test_profile_times_each_treatment_with_a_bounded_number_of_passes():
    torch.manual_seed(0)
    model, idx = TinyGPT(3), torch.randint(0, 32, (2, 8))
    choices = ["keep", "selective", "full", "pointwise"]
    clock = WorkClock()
    profiles = profile_blocks(model, find_blocks(model), idx, choices=choices, clock=clock)
    # Three alike blocks are profiled, and timed, once: 2 passes per treatment, work being steady.
    assert clock.passes == 2 * len(choices) == 8
    again = profile_blocks(model, find_blocks(model), idx, choices=choices, clock=WorkClock())
    assert [p.options for p in again] == [p.options for p in profiles]  # work, not time: deterministic
    options = profiles[0].options
    assert options["keep"].seconds == 0.0 and profiles[0].seconds > 0
    # The work clock charges FLOPs plus 50 per byte moved: full recomputes matmuls, selective and pointwise
    # only pointwise ops; each extra is exactly the recomputation the profile counted, in nanoseconds.
    for choice in ("selective", "full", "pointwise"):
        o = options[choice]
        assert o.seconds == pytest.approx((o.recompute_flops + 50 * o.recompute_bytes) * 1e-9, rel=0.2)
    assert options["full"].seconds > options["selective"].seconds > 0
    untimed = profile_blocks(model, find_blocks(model), idx, choices=choices)
    assert untimed[0].seconds is None and all(o.seconds is None for o in untimed[0].options.values())


def test_a_treatment_that_holds_no_less_than_keep_is_not_timed():
    """A block of a matmul, a ReLU and a matmul: what the ReLU saves is its output, which the next matmul
    saves anyway, so ``pointwise`` drops nothing, and ``selective`` caches the first matmul's output, which
    the ReLU saves: both hold what ``keep`` holds and cannot be chosen. They are not timed (4 passes
    fewer), each is priced as a pass of the whole block, and the plan under a limit recomputes fully."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act, self.out = torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.out(self.act(self.fc(x)))

    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    x = torch.randn(4, 8, requires_grad=True)
    choices = ["keep", "selective", "full", "pointwise"]
    clock = WorkClock()
    profiles = profile_blocks(model, [("0", model[0]), ("1", model[1])], x, choices=choices, clock=clock)
    options = profiles[0].options
    held = {c: (o.internal_bytes, o.saves_input, o.saves_output) for c, o in options.items()}
    assert held["pointwise"] == held["selective"] == held["keep"] != held["full"]
    assert clock.passes == 2 * 2  # two rounds of keep and full
    assert options["pointwise"].seconds == options["selective"].seconds == profiles[0].seconds > 0
    assert options["full"].seconds > 0
    plan = plan_checkpointing(profiles, evaluate_plan(profiles, ["keep", "keep"]).peak_bytes - 1)
    assert "full" in plan.choices.values() and set(plan.choices.values()) <= {"keep", "full"}


def _profiles(n: int, seconds: dict[str, float | None], pointwise_bytes: int = 60) -> list[BlockProfile]:
    """``n`` chained blocks: keep holds 100 bytes, selective 40, full 10, pointwise ``pointwise_bytes``; by
    FLOPs selective is free and full dear, by ``seconds`` as given (each block takes 1s kept)."""
    flops = {"keep": 0, "selective": 0, "full": 1000, "pointwise": 0}
    held = {"keep": 100, "selective": 40, "full": 10, "pointwise": pointwise_bytes}
    return [
        BlockProfile(
            f"b{i}",
            1000,
            0,
            0,
            i > 0,
            {
                c: OptionCost(held[c], False, False, recompute_flops=flops[c], seconds=seconds[c])
                for c in held
            },
            seconds=1.0 if seconds["keep"] is not None else None,
        )
        for i in range(n)
    ]


def test_plans_are_priced_in_seconds_where_every_treatment_was_timed():
    # Measured, selective's dispatch makes it the dearest; by FLOPs it is free and holds the least.
    timed = _profiles(4, {"keep": 0.0, "selective": 0.5, "full": 0.2, "pointwise": 0.05})
    plan = plan_checkpointing(timed, 300, cost_model=CostModel(tie=0))
    # The kept block last: its backward comes first, while the others still hold theirs.
    assert list(plan.choices.values()) == ["pointwise", "pointwise", "pointwise", "keep"]
    assert plan.seconds == pytest.approx(0.15) and plan.cost == pytest.approx(0.15)
    assert "+150.0 ms" in plan.table()
    flops = plan_checkpointing(timed, 300, cost_model=CostModel(use_time=False))
    assert set(flops.choices.values()) == {"selective"} and flops.seconds is None and flops.cost == 0
    # One treatment untimed: the whole plan is priced in FLOP-equivalents, never in two units at once.
    mixed = _profiles(4, {"keep": 0.0, "selective": 0.5, "full": 0.2, "pointwise": None})
    assert plan_checkpointing(mixed, 300).choices == flops.choices
    assert evaluate_plan(mixed, ["full"] * 4).seconds is None


def test_a_hand_written_plan_is_chosen_where_the_optimum_is_not_measurably_faster():
    timed = _profiles(4, {"keep": 0.0, "selective": 0.9, "full": 0.19, "pointwise": 0.1}, pointwise_bytes=30)
    # Under 220 bytes the optimum recomputes the pointwise modules of three blocks (0.3s; the kept block
    # last, where its backward comes first); full on every 2nd block (0.38s) is within the tie, 3% of the
    # blocks' 4 seconds (0.12s): it is chosen, the cheapest hand-written plan that fits.
    optimum = plan_checkpointing(timed, 220, cost_model=CostModel(tie=0))
    assert list(optimum.choices.values()) == ["pointwise", "pointwise", "pointwise", "keep"]
    chosen = plan_checkpointing(timed, 220)
    assert list(chosen.choices.values()) == ["full", "keep", "full", "keep"] and chosen.peak_bytes <= 220
    assert chosen.seconds == pytest.approx(0.38) and optimum.seconds == pytest.approx(0.3)
    # A tie of 1% (0.04s): the optimum is measurably faster than every hand-written plan, and stays.
    assert plan_checkpointing(timed, 220, cost_model=CostModel(tie=0.01)).choices == optimum.choices
    with pytest.raises(ValueError, match="tie must be >= 0, got -0.1"):
        CostModel(tie=-0.1)
    assert simple_plans(4, ["keep", "full"])[-2:] == [
        ["full", "keep", "full", "keep"],
        ["full", "keep", "keep", "full"],
    ]


def test_ranks_plan_on_each_timings_largest():
    a = _profiles(1, {"keep": 0.0, "selective": 0.5, "full": 0.2, "pointwise": 0.05})
    b = _profiles(1, {"keep": 0.0, "selective": 0.3, "full": 0.4, "pointwise": 0.05})
    merged = largest_profiles([a, b])[0]
    assert [merged.options[c].seconds for c in ("selective", "full")] == [0.5, 0.4]


def test_plan_policy_times_only_where_auto_plans():
    limit = StepLimit.resolve("1MiB", 0.0, None)
    assert isinstance(PlanPolicy.for_mode("auto", limit, offload=False).clock, WorkClock)  # the tests' clock
    assert PlanPolicy.for_mode("auto", StepLimit.resolve(None, 0.1, None), offload=False).clock is None
    assert PlanPolicy.for_mode("selective", StepLimit.resolve(None, 0.1, None), offload=False).clock is None
    no_time = PlanPolicy.for_mode("auto", limit, offload=False, cost_model=CostModel(use_time=False))
    assert no_time.clock is None


def test_plan_policy_clock_is_the_devices(monkeypatch):
    from lightning_memopt.checkpointing import policy
    from lightning_memopt.data.clock import step_clock

    monkeypatch.setattr(policy, "step_clock", step_clock)  # undo the tests' work clock
    limit = StepLimit.resolve("1MiB", 0.0, None)
    assert isinstance(PlanPolicy.for_mode("auto", limit, offload=False).clock, HostClock)
    cuda = PlanPolicy.for_mode("auto", limit, offload=False, cost_model=CostModel(), device="cuda")
    assert isinstance(cuda.clock, CudaClock)  # CUDA events on the device's stream (data/clock.py)
