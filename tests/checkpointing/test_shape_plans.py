import pytest
import torch

from lightning_memopt.checkpointing import Plan
from lightning_memopt.checkpointing.shape_plans import ShapePlans, covers, shape_signature


def _plan(cost: float, max_bytes: int = 1000) -> Plan:
    return Plan({"h.0": "keep"}, 100, 100, 0, 0, 0, cost, max_bytes=max_bytes)


def test_shape_signature_flattens_nested_batches_and_skips_non_tensors():
    batch = {
        "ids": torch.zeros(2, 5, dtype=torch.long),
        "meta": ["a", 3],
        "pair": (torch.zeros(3), torch.zeros(())),
    }
    assert shape_signature(batch) == ((2, 5), (3,), ())


def test_shape_signature_reads_a_tokenizer_s_batch_encoding():
    # What Hugging Face's collators return: a Mapping that is not a dict. Its shapes were () before, so
    # a longer batch ran the plan made for a shorter one.
    from transformers import BatchEncoding

    batch = BatchEncoding({"input_ids": torch.zeros(4, 9, dtype=torch.long), "labels": torch.zeros(4, 9)})
    assert shape_signature(batch) == ((4, 9), (4, 9))


def test_covers_needs_every_dimension_of_every_tensor_no_larger():
    assert covers(((4, 16), (4,)), ((4, 16), (4,)))
    assert covers(((4, 16),), ((2, 9),))
    assert not covers(((4, 16),), ((2, 17),))
    assert not covers(((4, 16),), ((4, 16), (4,)))  # another tensor
    assert not covers(((4, 16),), ((4, 4, 4),))  # another rank


def test_plan_for_takes_the_cheapest_covering_plan_and_counts_plans_made():
    plans = ShapePlans()
    cheap, dear = _plan(1.0), _plan(5.0)
    plans.add(((4, 8),), cheap, full_bytes=100)
    plans.add(((4, 16),), dear, full_bytes=200)
    assert plans.plan_for(((4, 8),)) is cheap and plans.plan_for(((4, 12),)) is dear
    assert plans.plan_for(((8, 8),)) is None and plans.made == 2


def test_next_plan_runs_every_block_full_where_a_batch_is_new_on_any_process():
    plans = ShapePlans()
    known = _plan(1.0)
    plans.add(((4, 16),), known, full_bytes=512)
    assert plans.next_plan(((4, 8),), known, lambda flags: flags) is known
    profile = plans.next_plan(((4, 8),), known, lambda flags: [1] * len(flags))  # new on another process
    assert not profile.predicted and profile.choices == {"h.0": "full"}
    # 512 bytes at (4, 16): at (4, 32) twice the elements, one dimension twice as long: up to 2,048 bytes,
    # over the max_bytes of 2,000, said before the batch runs; at (4, 31) 512 * 124/64 * 31/16 = 1,922 bytes.
    with pytest.warns(UserWarning, match=r"shapes \[\(4, 32\)\] arrives; .* peak may reach 2.00 KiB"):
        plans.next_plan(((4, 32),), _plan(1.0, max_bytes=2000), lambda flags: flags)
    assert (
        plans.overrun(((4, 31),), max_bytes=2000) is None
        and plans.overrun(((4, 31),), max_bytes=1921) is not None
    )


def test_state_round_trip():
    plans = ShapePlans()
    plans.add(((4, 8),), _plan(1.0), full_bytes=100)
    restored = ShapePlans()
    restored.load(plans.state())
    assert restored.plans == plans.plans and restored.made == 0


def test_a_plan_made_on_several_processes_batches_covers_each_and_is_exact_only_for_the_largest():
    plans = ShapePlans()
    small, both = _plan(1.0), _plan(5.0)
    plans.add(((4, 8),), small, full_bytes=100)
    plans.add(((4, 8),), both, full_bytes=300, also=[((4, 24),), ((4, 8),)])  # duplicates kept once
    assert plans.plans == {((4, 8),): both, ((4, 24),): both}
    assert plans.plan_for(((4, 8),)) is small and plans.plan_for(((1, 20),)) is both
    # This process's batch is covered by both plans, another's only by the second: the second runs here.
    assert plans.next_plan(((4, 8),), small, lambda flags: [1, 0]) is both
    assert plans.exact(((4, 24),), both) and not plans.exact(((4, 8),), both)  # (4, 24): the plan's figures
    assert plans.exact(((4, 8),), small) and not plans.exact(((4, 6),), small)
    mixed = ShapePlans()  # neither batch covers the other: the figures (largest of each) are no one batch's
    mixed.add(((4, 8),), both, full_bytes=300, also=[((2, 24),)])
    assert not mixed.exact(((4, 8),), both) and not mixed.exact(((2, 24),), both)
    restored = ShapePlans()
    restored.load(plans.state())
    assert restored.state() == plans.state() and restored.plan_for(((3, 24),)) == both
    assert plans.state()[1]["also"] == [[[4, 24]]]
    # The overrun estimate starts from the plan's largest batch, (4, 24) with 300 bytes fully checkpointed.
    assert (
        plans.overrun(((4, 24),), max_bytes=299) is not None
        and plans.overrun(((4, 24),), max_bytes=300) is None
    )
