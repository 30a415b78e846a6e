"""Test oracles: exhaustive searches that the package's own searches must agree with (not shipped)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from lightning_memopt.checkpointing import CostModel, Plan, evaluate_plan
from lightning_memopt.checkpointing.costs import BlockProfile


def brute_force_plan(
    profiles: Sequence[BlockProfile],
    budget: int,
    *,
    allowed: Sequence[str],
    cost_model: CostModel | None = None,
) -> Plan | None:
    """Try all ``len(allowed) ** len(profiles)`` plans: the cheapest whose peak fits ``budget`` (ties: fewer
    bytes held), or None. What ``plan_checkpointing`` must return."""
    cost_model = cost_model or CostModel()
    best = None
    for choices in itertools.product(allowed, repeat=len(profiles)):
        plan = evaluate_plan(profiles, choices, cost_model, budget)
        if plan.peak_bytes <= budget and (
            best is None or (plan.cost, plan.activation_bytes) < (best.cost, best.activation_bytes)
        ):
            best = plan
    return best


def brute_force_config(planner):
    """Evaluate every configuration of a ``planning.search.Planner``: the cheapest that fits (ties: grid
    order), or None. What ``Planner.cheapest`` must return."""
    fitting = [e for e in (planner.evaluate(c) for c in planner.grid()) if e.fits]
    return min(fitting, key=lambda e: e.cost, default=None)
