"""Activation checkpointing under a memory limit (plain torch; no Lightning import).

Find the repeated blocks (and the stem before them), profile each treatment (bytes held for backward,
recompute cost), choose the cheapest plan that fits a bound on the blocks' bytes (exactly; a training step's limit becomes
the blocks' share in ``policy.py``), apply it without changing the model's module tree. ``auto.py``
does all of it from one measured step: :func:`auto_checkpoint` for a plain training loop, and the
``AutoCheckpoint`` callback.
"""

from lightning_memopt.checkpointing.apply import (
    apply_checkpointing,
    checkpointed_blocks,
    framework_checkpointing,
    observe_saved,
    remove_checkpointing,
)
from lightning_memopt.checkpointing.auto import AutoCheckpointer, StepOutcome, auto_checkpoint
from lightning_memopt.checkpointing.blocks import blocks_run, candidate_classes, check_blocks, find_blocks
from lightning_memopt.checkpointing.capture import BlockInputs, capture_block_inputs
from lightning_memopt.checkpointing.costs import CHOICES, BlockProfile, Choice, OptionCost
from lightning_memopt.checkpointing.meter import ActivationMeter
from lightning_memopt.checkpointing.planner import (
    MODES,
    CostModel,
    NoPlanFitsError,
    Plan,
    check_mode,
    evaluate_plan,
    initial_choices,
    keep_where_no_gain,
    plan_checkpointing,
    prediction_gap,
    treatments,
)
from lightning_memopt.checkpointing.policy import PlanPolicy, plan_step, plan_within, state_bytes
from lightning_memopt.checkpointing.profile import profile_blocks, profile_blocks_run
from lightning_memopt.memory.limit import StepLimit

__all__ = [
    "ActivationMeter",
    "AutoCheckpointer",
    "CHOICES",
    "BlockInputs",
    "BlockProfile",
    "Choice",
    "CostModel",
    "NoPlanFitsError",
    "MODES",
    "OptionCost",
    "Plan",
    "PlanPolicy",
    "StepLimit",
    "StepOutcome",
    "apply_checkpointing",
    "auto_checkpoint",
    "blocks_run",
    "candidate_classes",
    "capture_block_inputs",
    "check_blocks",
    "check_mode",
    "checkpointed_blocks",
    "evaluate_plan",
    "find_blocks",
    "initial_choices",
    "framework_checkpointing",
    "keep_where_no_gain",
    "observe_saved",
    "plan_checkpointing",
    "plan_step",
    "plan_within",
    "prediction_gap",
    "profile_blocks",
    "profile_blocks_run",
    "remove_checkpointing",
    "state_bytes",
    "treatments",
]
