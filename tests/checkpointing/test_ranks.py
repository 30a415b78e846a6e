import torch

from lightning_memopt.checkpointing import evaluate_plan
from lightning_memopt.checkpointing.costs import BlockProfile, OptionCost
from lightning_memopt.checkpointing.ranks import Measured, agree, gather_over_ranks, most_over_ranks


def _profile(scale: int, *, saves_output: bool, input_held: bool) -> BlockProfile:
    options = {
        "keep": OptionCost(100 * scale, True, saves_output, 0, 0, 0),
        "full": OptionCost(0, True, False, 7 * scale, 3 * scale, 0),
    }
    return BlockProfile("h.0", 10 * scale, 16 * scale, 16 * scale, False, options, input_held)


def test_agree_takes_every_figure_largest_over_processes_and_bounds_each_plan():
    a = [_profile(1, saves_output=True, input_held=True)]
    b = [_profile(3, saves_output=False, input_held=False)]
    agreed = agree([Measured(((4, 8),), a, 1000, 50), Measured(((2, 24),), b, 900, 70)])
    assert agreed.signatures == [((4, 8),), ((2, 24),)] and (agreed.states, agreed.outside) == (1000, 70)
    merged = agreed.profiles[0]
    assert (merged.forward_flops, merged.input_bytes, merged.output_bytes) == (30, 48, 48)
    keep, full = merged.options["keep"], merged.options["full"]
    assert (keep.internal_bytes, keep.saves_input, keep.saves_output) == (
        300,
        True,
        True,
    )  # saved if any saves
    assert (full.recompute_flops, full.recompute_bytes) == (21, 9)
    assert merged.input_held is False  # an input held elsewhere only where every process holds it
    for choice in ("keep", "full"):  # the plan on the merged figures holds no less than on either process
        planned = evaluate_plan(agreed.profiles, [choice])
        for own in (a, b):
            assert planned.activation_bytes >= evaluate_plan(own, [choice]).activation_bytes
            assert planned.peak_bytes >= evaluate_plan(own, [choice]).peak_bytes
    assert evaluate_plan(agreed.profiles, ["keep"]).activation_bytes == 300 + 48 + 48


def test_one_process_needs_no_collective():
    class Single:  # a strategy without world_size (SingleDeviceStrategy) counts as one process
        root_device = torch.device("cpu")

    assert gather_over_ranks(Single(), "x") == ["x"] and most_over_ranks(Single(), [True, 3]) == [1, 3]
