"""The options that lower a step's memory, their price, and the cheapest combination that fits.

A *configuration* is one choice per knob: precision, micro-batch size (the effective batch unchanged:
``AutoAccumulation``), sharding (``fsdp`` over the devices instead of ``ddp``), activation
checkpointing (``AutoCheckpoint``'s plan, with or without CPU offload) and, for a Hugging Face causal LM
whose head :func:`~lightning_memopt.head.causal_lm.take_over_heads` takes, the output head (its own, or
the chunked loss ``AutoCheckpoint(head=...)`` installs). Its price is a fraction of the
step's time, from :class:`Prices` (each field says what it prices; the defaults are rough judgments: pass your own); checkpointing is priced
by the planner's recompute FLOP-equivalents over the step's FLOPs (taken as 3x the blocks' forward FLOPs).

The search is best-first: configurations are taken in order of price (a checkpointing configuration at
its lower bound, the price without recompute, until its plan is made), and the first one whose predicted
peak fits is the answer. Nothing cheaper can fit: every cheaper configuration was tried, or had a lower
bound above the answer (the tests check it against trying every configuration).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_memopt.batching.split import batch_size, distinct_micro_batches, micro_batch_sizes, split_batch
from lightning_memopt.checkpointing import (
    CostModel,
    NoPlanFitsError,
    evaluate_plan,
    find_blocks,
    plan_checkpointing,
    profile_blocks,
)
from lightning_memopt.head.causal_lm import causal_lms, decline_reason
from lightning_memopt.memory.units import format_bytes
from lightning_memopt.planning.predict import (
    StepPrediction,
    precision_applied,
    precision_plugin,
    predict_step,
)

__all__ = ["Prices", "Config", "Evaluated", "Planner", "CHECKPOINT_MODES"]

CHECKPOINT_MODES = ("none", "recompute", "offload")


@dataclass(frozen=True)
class Prices:
    """What each change costs, as a fraction of the step's time (0.1 = 10% slower)."""

    bf16_mixed: float = 0.01
    """Switching fp32 to bf16-mixed: usually faster on a GPU, but it changes the numerics; priced low so
    it is proposed before anything that costs compute."""
    bf16_true: float = 0.05
    """bf16-true: weights and optimizer state in bf16, a risk to the model's quality."""
    per_micro_batch: float = 0.05
    """Each micro-batch beyond the first: smaller kernels use the device less well."""
    sharding: float = 0.10
    """FSDP instead of DDP: parameters gathered twice and gradients reduce-scattered per step."""
    chunked_head: float = 0.0
    """A causal LM's loss computed chunk by chunk instead of from its whole logits: on a CPU with a float32
    weight the same three matmuls (logits, and the two gradient products), nothing recomputed (a Hugging
    Face model's loss is a mean or a sum: every gradient is made in forward; ``docs/head.md``), measured
    step time 0.977x the own head's (GPT-2 small, 2 x 1,024) and 0.69x on a small model; on CUDA in half
    precision, and with a half-precision weight, one matmul more (the weight's gradient by columns), the
    head alone 0.80x (GPT-2) to 1.35x (Llama 3 8B) the own head's on an H100: about 2-6% of those models'
    steps (the head's share of a step's matmuls times its excess). Priced free, hence tried first."""

    def precision(self, current: str, precision: str) -> float:
        if precision == current:
            return 0.0
        return {"bf16-mixed": self.bf16_mixed, "bf16-true": self.bf16_true, "16-true": self.bf16_true}.get(
            precision, 0.0
        )


@dataclass(frozen=True, order=True)
class Config:
    """One choice per knob."""

    precision: str
    micro_batch_size: int
    strategy: str
    checkpoint: str = "none"
    head: str = "own"
    """``"own"`` or ``"chunked"`` (:data:`~lightning_memopt.planning.predict.Head`)."""


@dataclass
class Evaluated:
    """A configuration with its prediction and price."""

    config: Config
    prediction: StepPrediction | None
    cost: float
    fits: bool
    plan: Any = None
    """The checkpointing :class:`~lightning_memopt.checkpointing.Plan`, when the configuration has one."""
    recompute_flops: int = 0
    note: str = ""

    @property
    def peak_bytes(self) -> int | None:
        return None if self.prediction is None else self.prediction.peak_bytes


@dataclass
class Planner:
    """Predicts configurations of one model and batch, caching each, and searches for the cheapest fit.

    Args:
        module: The (fake) LightningModule.
        batch: One full (fake) batch.
        usable: The bytes a rank may use (device memory less headroom).
        precision: The run's precision as configured.
        strategy: The run's strategy as configured (``ddp`` or ``fsdp``).
        world_size: Devices the run uses.
        prices: :class:`Prices`.
        allow_offload: Whether offloading to the host is an option (GPU targets).
        fresh: Builds a new copy of the module (fake), to be sharded; needed where ``fsdp`` is an option.
    """

    module: nn.Module
    batch: Any
    usable: int
    precision: str = "32-true"
    strategy: str = "ddp"
    world_size: int = 1
    prices: Prices = field(default_factory=Prices)
    allow_offload: bool = False
    cost_model: CostModel = field(default_factory=CostModel)
    fresh: Callable[[], nn.Module] | None = None
    _cache: dict = field(default_factory=dict)
    _blocks: list | None = None
    _heads: list[str] | None = None

    # ------------------------------------------------------------------ the grid
    def precisions(self) -> list[str]:
        order = ["32-true", "bf16-mixed", "bf16-true"]
        return order[order.index(self.precision) :] if self.precision in order else [self.precision]

    def micro_batch_grid(self) -> list[int]:
        """The micro-batch sizes that ``AutoAccumulation``'s search considers: each that runs the batch in
        fewer micro-batches than any smaller one (48: 48, 24, 16, 12, 10, 8, ...), largest first."""
        return distinct_micro_batches(batch_size(self.batch))

    def strategies(self) -> list[str]:
        return [self.strategy] if self.strategy == "fsdp" or self.world_size == 1 else [self.strategy, "fsdp"]

    def heads(self) -> list[str]:
        """``["own", "chunked"]`` where the module holds a causal LM whose head can be taken, else ``["own"]``."""
        if self._heads is None:
            lms = causal_lms(self.module)
            self._heads = ["own", "chunked"] if lms and not any(map(decline_reason, lms)) else ["own"]
        return self._heads

    def grid(self) -> list[Config]:
        modes = CHECKPOINT_MODES if self.allow_offload else CHECKPOINT_MODES[:2]
        if not self.blocks():
            modes = ("none",)
        knobs = (self.precisions(), self.micro_batch_grid(), self.strategies(), modes, self.heads())
        return [Config(*c) for c in itertools.product(*knobs)]

    def blocks(self) -> list[tuple[str, nn.Module]]:
        if self._blocks is None:
            self._blocks = find_blocks(self.module)
        return self._blocks

    def base_cost(self, c: Config) -> float:
        total = batch_size(self.batch)
        count = -(-total // c.micro_batch_size)
        return (
            self.prices.precision(self.precision, c.precision)
            + self.prices.per_micro_batch * (count - 1)
            + (self.prices.sharding if c.strategy == "fsdp" and self.strategy != "fsdp" else 0.0)
            + (self.prices.chunked_head if c.head == "chunked" else 0.0)
        )

    # ------------------------------------------------------------------ evaluation
    def predict(self, c: Config, checkpoint: dict[str, str] | None = None) -> StepPrediction:
        key = (c.precision, c.micro_batch_size, c.strategy, c.head, tuple(sorted((checkpoint or {}).items())))
        if key not in self._cache:
            total = batch_size(self.batch)
            self._cache[key] = predict_step(
                self.module,
                self.batch,
                precision=c.precision,
                micro_batch_size=None if c.micro_batch_size == total else c.micro_batch_size,
                checkpoint=checkpoint,
                world_size=self.world_size,
                strategy=c.strategy,
                blocks=self.blocks(),
                fresh=self.fresh,
                # A causal LM's head is counted on its own line, computed as the configuration says.
                head=c.head if len(self.heads()) > 1 else None,
            )
        return self._cache[key]

    def evaluate(self, c: Config) -> Evaluated:
        """Predict ``c`` (its checkpointing plan made under what is left for the blocks) and price it."""
        base = self.predict(replace(c, checkpoint="none"))
        cost = self.base_cost(c)
        if c.checkpoint == "none":
            return Evaluated(c, base, cost, base.peak_bytes <= self.usable)
        return self._evaluate_checkpointed(c, base, cost)

    def _profiles(self, c: Config):
        key = ("profiles", c.precision, c.micro_batch_size)
        if key not in self._cache:
            total = batch_size(self.batch)
            batch = split_batch(self.batch, micro_batch_sizes(total, c.micro_batch_size))[-1]
            choices = (
                ("keep", "selective", "full", "offload")
                if self.allow_offload
                else ("keep", "selective", "full")
            )
            plugin = precision_plugin(c.precision)
            with precision_applied(self.module, plugin):
                self._cache[key] = profile_blocks(
                    _Step(self.module), self.blocks(), batch, context=plugin.forward_context, choices=choices
                )
        return self._cache[key]

    def _evaluate_checkpointed(self, c: Config, base: StepPrediction, cost: float) -> Evaluated:
        if base.record["optimizer"] > self.usable:
            # The optimizer step holds no activations: no checkpointing plan can lower it (and no block
            # need be profiled to know it).
            return Evaluated(c, None, float("inf"), False, note="the optimizer step alone does not fit")
        profiles = self._profiles(c)
        keep = evaluate_plan(profiles, ["keep"] * len(profiles), self.cost_model)
        outside = base.peak_bytes - keep.peak_bytes  # what the step holds besides the blocks' activations
        allowed = ["keep", "selective", "full"] + (["offload"] if c.checkpoint == "offload" else [])
        step_flops = 3 * sum(p.forward_flops for p in profiles) or 1
        max_bytes = self.usable - outside
        for _ in range(3):  # the planner's model vs the fake run: shrink by the overshoot, at most twice
            if max_bytes <= 0:
                held = format_bytes(outside)
                note = (
                    f"what the step holds outside the blocks ({held}: parameters, gradients, optimizer state "
                    "and the activations outside them) does not fit"
                )
                return Evaluated(c, None, float("inf"), False, note=note)
            try:
                plan = plan_checkpointing(profiles, max_bytes, allowed=allowed, cost_model=self.cost_model)
            except NoPlanFitsError as exc:
                return Evaluated(
                    c, None, float("inf"), False, note=f"no plan fits: {exc.minimum} bytes at least"
                )
            offloaded = any(v == "offload" for v in plan.choices.values())
            if offloaded:
                # Offloaded bytes live in host memory; the fake run (on the CPU) cannot tell them apart,
                # so the planner's prediction is used: the base step less what the plan saves.
                prediction = _shifted(base, plan.peak_bytes - keep.peak_bytes)
            else:
                prediction = self.predict(c, plan.choices)
            over = prediction.peak_bytes - self.usable
            if over <= 0:
                break
            max_bytes -= over
        price = cost + plan.cost / step_flops
        return Evaluated(c, prediction, price, over <= 0, plan, plan.extra_flops)

    # ------------------------------------------------------------------ search
    def cheapest(self) -> Evaluated | None:
        """The cheapest configuration that fits (best-first, see the module docstring), or None."""
        heap = [(self.base_cost(c), i, c, False) for i, c in enumerate(self.grid())]
        heapq.heapify(heap)
        done: dict[Config, Evaluated] = {}
        while heap:
            bound, i, c, exact = heapq.heappop(heap)
            if not exact:
                e = done.setdefault(c, self.evaluate(c))
                if not e.fits:
                    continue
                if e.cost > bound:  # a plan's recompute raised the price: back in line at its real price
                    heapq.heappush(heap, (e.cost, i, c, True))  # same index: ties break in grid order
                    continue
            return done[c]
        return None


class _Step(nn.Module):
    """Runs ``training_step`` as forward, so block profiling sees what training runs."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.inner = [module]  # not a submodule: its parameters stay where they are

    def forward(self, batch):
        return self.inner[0].training_step(batch, 0)


def _shifted(p: StepPrediction, delta: int) -> StepPrediction:
    record = dict(p.record)
    for phase in ("forward", "backward"):
        record[phase] += delta
        record[f"{phase}_activations"] += delta
    return StepPrediction(record, [*p.modeled, "offload: planner's activation bytes"])
