"""Activation checkpointing under a memory budget (plain torch; no Lightning import).

Find the repeated blocks, profile each treatment (bytes held for backward, recompute cost), choose the
cheapest plan that fits a budget (exactly), apply it without changing the model's module tree.
"""

from lightning_memopt.checkpointing.apply import (
    CHOICES,
    Choice,
    apply_checkpointing,
    checkpointed_blocks,
    framework_checkpointing,
    observe_saved,
    remove_checkpointing,
)
from lightning_memopt.checkpointing.blocks import candidate_classes, check_blocks, find_blocks
from lightning_memopt.checkpointing.planner import (
    CostModel,
    InfeasibleBudgetError,
    Plan,
    brute_force_plan,
    evaluate_plan,
    keep_where_no_gain,
    plan_checkpointing,
    plan_within,
    state_bytes,
    treatments,
)
from lightning_memopt.checkpointing.profile import (
    ActivationMeter,
    BlockInputs,
    BlockProfile,
    OptionCost,
    capture_block_inputs,
    profile_blocks,
)

__all__ = [
    "ActivationMeter",
    "CHOICES",
    "BlockInputs",
    "BlockProfile",
    "Choice",
    "CostModel",
    "InfeasibleBudgetError",
    "OptionCost",
    "Plan",
    "apply_checkpointing",
    "brute_force_plan",
    "candidate_classes",
    "capture_block_inputs",
    "check_blocks",
    "checkpointed_blocks",
    "evaluate_plan",
    "find_blocks",
    "framework_checkpointing",
    "keep_where_no_gain",
    "observe_saved",
    "plan_checkpointing",
    "plan_within",
    "profile_blocks",
    "remove_checkpointing",
    "state_bytes",
    "treatments",
]
