"""Choose a treatment per block: the least recompute cost whose activation bytes fit a bound (``max_bytes``).

The problem is a multiple-choice knapsack along a chain. Each block takes one treatment; its activation
bytes and its cost add up, except for one interaction: a block's input is the previous block's output
(the same tensor), so when both hold it, it is counted once. The dynamic program therefore carries one
bit of state, "the previous block holds its output", and keeps, per state, the Pareto frontier of
(bytes, cost) over the prefixes seen so far. Dominated prefixes can never be completed into a better
plan, so the result is the exact optimum (a test checks it against brute force on random instances).

Cost of a treatment: the seconds it was measured to add to the block's forward and backward
(``OptionCost.seconds``, where the profile timed every treatment: ``profile_blocks(clock=...)``), which is
what a user pays; else, in FLOP-equivalents::

    recompute_flops + pointwise_flops_per_byte * recompute_bytes + offload_flops_per_byte * 2 * transfer_bytes

Compute-heavy ops are counted in FLOPs; pointwise ops are memory-bound, so their recompute is charged by
the bytes they move, converted at the device's FLOPs-per-byte ratio; offloaded bytes cross the host link
twice (out in forward, back in backward). One unit per plan: seconds only where every profiled treatment
of every block was timed. FLOPs stay a reported figure (``Plan.extra_flops``) either way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from lightning_memopt._checks import check_positive_int
from lightning_memopt.checkpointing.costs import CHOICES, BlockProfile, OptionCost
from lightning_memopt.memory import format_bytes, parse_bytes
from lightning_memopt.memory.device import indexed, measure_matmul_rate, measure_transfer_rate

__all__ = [
    "Plan",
    "CostModel",
    "plan_checkpointing",
    "evaluate_plan",
    "NoPlanFitsError",
    "keep_where_no_gain",
    "MODES",
    "check_mode",
    "initial_choices",
    "measured_cost_model",
    "prediction_gap",
    "simple_plans",
    "treatments",
]


class NoPlanFitsError(ValueError):
    """``max_bytes`` is below the smallest peak activation bytes any plan can reach."""

    def __init__(self, message: str, minimum: int) -> None:
        super().__init__(message)
        self.minimum = minimum


@dataclass(frozen=True)
class CostModel:
    """How treatments are priced: in measured seconds where every profiled treatment was timed, else in
    FLOP-equivalents (the two rates below)."""

    pointwise_flops_per_byte: float = 50.0
    """FLOPs the device could do in the time it moves one byte (peak FLOP/s over memory bandwidth).
    Recomputed pointwise ops cost this per byte they read and write. ~150 on an A100, ~10-30 on CPUs."""
    offload_flops_per_byte: float = 5000.0
    """FLOPs the device could do in the time one byte crosses to the host (FLOP/s over host-link B/s).
    ~10,000 for an A100 on PCIe 4. Raise it to discourage offloading."""
    use_time: bool = True
    """Price by measured seconds (``OptionCost.seconds``) where the profiles carry them for every
    treatment. False: always in FLOP-equivalents (deterministic; the rates above)."""
    tie: float = 0.03
    """Priced in seconds, plans whose predicted times differ by less than this fraction of the blocks'
    measured time (every block kept) are ties, and among ties with the optimum the planner takes a plan a
    user writes by hand (:func:`simple_plans`): per-block timings add up to a step's time only to within a
    few percent, so a mixed plan is chosen only where it is measurably faster. 0: the optimum always."""

    def __post_init__(self) -> None:
        for name in ("pointwise_flops_per_byte", "offload_flops_per_byte", "tie"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")

    def with_transfer_rate(self, bytes_per_second: float, *, flops_per_second: float) -> CostModel:
        """This model with ``offload_flops_per_byte`` measured: the device's FLOP/s over the bytes per
        second of a pinned host round trip (:func:`measured_cost_model` times both).

        Raises:
            ValueError: a rate that is not positive.
        """
        for name, rate in (("bytes_per_second", bytes_per_second), ("flops_per_second", flops_per_second)):
            if not rate > 0:
                raise ValueError(f"{name} must be a positive measured rate, got {rate!r}")
        return replace(self, offload_flops_per_byte=flops_per_second / bytes_per_second)

    def cost(self, option: OptionCost) -> float:
        """``option``'s price: its measured seconds where timed and ``use_time``, else FLOP-equivalents."""
        if self.use_time and option.seconds is not None:
            return option.seconds
        return (
            option.recompute_flops
            + self.pointwise_flops_per_byte * option.recompute_bytes
            + self.offload_flops_per_byte * 2 * option.transfer_bytes
        )

    def for_profiles(self, profiles: Sequence[BlockProfile]) -> CostModel:
        """This model, priced in FLOP-equivalents unless every treatment of every profile was timed (one
        unit for every plan made from ``profiles``)."""
        timed = all(o.seconds is not None for p in profiles for o in p.options.values())
        return self if timed or not self.use_time else replace(self, use_time=False)


@dataclass(frozen=True)
class Plan:
    """A treatment per block and what it is predicted to hold and cost.

    ``activation_bytes`` are the bytes the blocks hold for backward at the end of the forward (each
    boundary tensor counted once, in the block that first holds it), ``baseline_bytes`` the same with
    every block kept. ``peak_bytes`` is the most the blocks hold at any time: at the end of the forward,
    or in backward while a checkpointed block runs its backward with everything it saved recomputed (or
    brought back), the blocks before it still holding theirs; at the end of the forward it counts
    ``transient`` beside the activations. ``max_bytes`` bounds ``peak_bytes``. Activations outside the
    blocks (embeddings, head, loss) are not included.
    """

    choices: dict[str, str]
    activation_bytes: int
    baseline_bytes: int
    extra_flops: int
    extra_pointwise_bytes: int
    transfer_bytes: int
    cost: float
    max_bytes: int | None = None
    block_bytes: dict[str, int] = field(default_factory=dict)
    predicted: bool = True
    """False for a plan whose blocks were not profiled: its byte and cost figures are unknown (zero)."""
    peak_bytes: int = 0
    seconds: float | None = None
    """Predicted seconds per step beyond keeping every block (each block's timed treatment beyond its
    timed keep); None where the profiles were not timed. A step that took ``t`` seconds with every block
    kept is predicted to take ``t + seconds`` under this plan."""
    transient: int = 0
    """Bytes outside the blocks that backward's first ops make beside every activation kept (the loss's
    gradient w.r.t. the logits): measured where the size search measured the micro-step
    (``AutoCheckpointer.decided``), else 0."""

    @classmethod
    def unprofiled(cls, choices: dict[str, str]) -> Plan:
        """A plan of explicit choices with no predictions (blocks that cannot be profiled)."""
        return cls(dict(choices), 0, 0, 0, 0, 0, 0.0, predicted=False)

    def table(self) -> str:
        """The plan as a fixed-width table, one row per block and a total."""
        rows = [
            ("block", "choice", "activations", "recompute GFLOP", "recompute pointwise", "offloaded", "time")
        ]
        if not self.predicted:
            rows = [("block", "choice")] + [(n, c) for n, c in self.choices.items()]
            widths = [max(len(r[i]) for r in rows) for i in range(2)]
            return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
        for name, choice in self.choices.items():
            rows.append((name, choice, format_bytes(self.block_bytes.get(name, 0)), "", "", "", ""))
        ratio = self.activation_bytes / self.baseline_bytes if self.baseline_bytes else 0.0
        rows.append(
            (
                "total",
                f"max_bytes {format_bytes(self.max_bytes)}" if self.max_bytes else "",
                f"{format_bytes(self.activation_bytes)} ({ratio:.2f}x)",
                f"{self.extra_flops / 1e9:.3f}",
                format_bytes(self.extra_pointwise_bytes),
                format_bytes(self.transfer_bytes),
                f"{self.seconds * 1e3:+.1f} ms" if self.seconds is not None else "",
            )
        )
        if self.peak_bytes > self.activation_bytes:
            rows.append(("peak", "in backward", format_bytes(self.peak_bytes), "", "", "", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def metrics(self, measured: int) -> dict[str, float]:
        """The plan's figures to log, with ``measured`` activation bytes: bytes, and GFLOP per step."""
        return {
            "activation_bytes_predicted": float(self.activation_bytes),
            "activation_bytes_measured": float(measured),
            "recompute_gflops": self.extra_flops / 1e9,
        }

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(**d)


def _step(profile: BlockProfile, option: OptionCost, prev_holds_output: bool) -> int:
    """Bytes ``option`` adds to the chain, given whether the previous block already holds our input."""
    add = option.internal_bytes + profile.output_bytes * option.saves_output
    if option.saves_input and not (profile.chained and prev_holds_output) and not profile.input_held:
        add += profile.input_bytes
    return add


def _backward_peak(profile: BlockProfile, choice: str, prev_holds_output: bool, before: int) -> int:
    """Bytes the blocks hold while this block's backward runs, ``before`` being what the blocks before it
    hold: a checkpointed block then holds all it would have kept (recomputed, cached or brought back)."""
    return before + _step(profile, profile.options["keep" if choice != "keep" else choice], prev_holds_output)


def evaluate_plan(
    profiles: Sequence[BlockProfile],
    choices: Sequence[str],
    cost_model: CostModel | None = None,
    max_bytes=None,
    transient: int = 0,
) -> Plan:
    """The :class:`Plan` of an explicit treatment per block (in the order of ``profiles``); ``transient``:
    :attr:`Plan.transient`.

    Example::

        >>> plan = evaluate_plan(profiles, ["full"] * len(profiles))  # doctest: +SKIP
    """
    cost_model = (cost_model or CostModel()).for_profiles(profiles)
    if len(choices) != len(profiles):
        raise ValueError(f"need one choice per block ({len(profiles)}), got {len(choices)}")
    total = flops = pw = transfer = baseline = peak = 0
    cost = seconds = 0.0
    block_bytes = {}
    prev = prev_keep = False
    for p, choice in zip(profiles, choices):
        choice = _usable(p, choice)
        if choice not in p.options:
            raise ValueError(
                f"block {p.name!r} has no profile for choice {choice!r}; profiled: {list(p.options)}"
            )
        o = p.options[choice]
        block_bytes[p.name] = _step(p, o, prev)
        peak = max(peak, _backward_peak(p, choice, prev, total))
        total += block_bytes[p.name]
        baseline += _step(p, p.options["keep"], prev_keep)
        flops += o.recompute_flops
        pw += o.recompute_bytes
        transfer += o.transfer_bytes
        cost += cost_model.cost(o)
        seconds += o.seconds or 0.0
        prev, prev_keep = o.saves_output, p.options["keep"].saves_output
    return Plan(
        {p.name: _usable(p, c) for p, c in zip(profiles, choices)},
        total,
        baseline,
        flops,
        pw,
        transfer,
        cost,
        max_bytes,
        block_bytes,
        peak_bytes=max(peak, total + transient),
        seconds=seconds if cost_model.use_time else None,
        transient=transient,
    )


def _usable(profile: BlockProfile, choice: str) -> str:
    """``choice``, or ``keep`` for a block that can only keep (``BlockProfile.note``: it writes state)."""
    return "keep" if profile.note is not None and choice not in profile.options else choice


def keep_where_no_gain(profiles: Sequence[BlockProfile], choices: Sequence[str]) -> list[str]:
    """``choices`` with every treatment that does not lower what the blocks hold switched back to ``keep``.

    Checkpointing a block keeps its input; where the block's own activations are no larger (a block whose
    input an op outside it holds anyway, a cheap projection after a large input), recomputing saves
    nothing and only costs time, and a wrongly chosen treatment can even raise the peak. A block keeps
    its activations when doing so raises neither the bytes held at the end of the forward nor the peak
    (:class:`Plan`), judged one block at a time in forward order.

    Example::

        >>> keep_where_no_gain(profiles, ["full"] * len(profiles))  # doctest: +SKIP
        ['full', 'full', 'keep']
    """
    chosen = list(choices)
    current = evaluate_plan(profiles, chosen)
    for i, choice in enumerate(chosen):
        if choice == "keep":
            continue
        candidate = evaluate_plan(profiles, [*chosen[:i], "keep", *chosen[i + 1 :]])
        if (
            candidate.activation_bytes <= current.activation_bytes
            and candidate.peak_bytes <= current.peak_bytes
        ):
            chosen[i], current = "keep", candidate
    return chosen


def _pareto(entries: list[tuple[int, float, tuple]]) -> list[tuple[int, float, tuple]]:
    entries.sort(key=lambda e: (e[0], e[1], e[2]))
    kept, best = [], float("inf")
    for e in entries:
        if e[1] < best:
            kept.append(e)
            best = e[1]
    return kept


def plan_checkpointing(
    profiles: Sequence[BlockProfile],
    max_bytes: int | str,
    *,
    allowed: Sequence[str] | None = None,
    cost_model: CostModel | None = None,
    transient: int = 0,
) -> Plan:
    """The plan of least recompute cost whose blocks' peak activation bytes fit in ``max_bytes``.

    Args:
        profiles: One :class:`BlockProfile` per block, in forward order (from ``profile_blocks``).
        max_bytes: Bytes the blocks may hold at most (``Plan.peak_bytes``: at the end of the forward, or
            while a checkpointed block recomputes in backward): an int or a string like ``"6GiB"``.
        allowed: Treatments to choose from (``keep``, ``selective``, ``full``, ``offload``,
            ``pointwise``); default: every treatment all profiles carry. Leave out ``offload`` where the
            device is the CPU (offloading to the CPU saves nothing there).
        cost_model: How treatments are priced (measured seconds where the profiles were timed);
            :class:`CostModel` defaults.
        transient: Bytes that backward's first ops hold beside every activation kept, outside the blocks
            (:attr:`Plan.transient`): the activations at the end of the forward fit ``max_bytes`` with them.

    Returns:
        The optimal :class:`Plan` (exact: a dynamic program over Pareto frontiers, not greedy).

    Raises:
        ValueError: If ``max_bytes`` is not a positive byte size or ``allowed`` names an unknown treatment.
        NoPlanFitsError: (a ``ValueError``) If no plan fits; the message gives the smallest
            achievable bytes and what else to try.

    Example::

        >>> plan = plan_checkpointing(profile_blocks(model, find_blocks(model), x), "200MB")  # doctest: +SKIP
        >>> print(plan.table())  # doctest: +SKIP
    """
    max_bytes = parse_bytes(max_bytes, name="max_bytes")
    allowed = list(dict.fromkeys(allowed if allowed is not None else _profiled(profiles)))
    for choice in allowed:
        if choice not in CHOICES:
            raise ValueError(f"allowed treatments must be among {CHOICES}, got {choice!r}")
    if not allowed:
        raise ValueError(f"allowed must name at least one treatment of {CHOICES}, got an empty list")
    missing = sorted({c for p in profiles for c in allowed if c not in p.options and p.note is None})
    if missing:
        raise ValueError(f"profiles lack the treatments {missing}; profile them or leave them out of allowed")
    cost_model = (cost_model or CostModel()).for_profiles(profiles)
    best = _search(profiles, allowed, cost_model, max_bytes, transient)
    if best is None:
        minimum = _smallest_feasible(profiles, allowed, cost_model, transient)
        hint = "allow 'offload', " if "offload" not in allowed else ""
        raise NoPlanFitsError(
            f"max_bytes {format_bytes(max_bytes)} ({max_bytes} bytes) is below the smallest peak activation bytes "
            f"reachable with {allowed}: {format_bytes(minimum)} ({minimum} bytes). Raise max_bytes, "
            f"{hint}or use a smaller micro-batch (e.g. AutoAccumulation).",
            minimum,
        )
    plan = evaluate_plan(profiles, best, cost_model, max_bytes, transient)
    return _simplest_tie(profiles, plan, allowed, cost_model)


def simple_plans(n: int, allowed: Sequence[str]) -> list[list[str]]:
    """The plans a user writes by hand for ``n`` blocks: one treatment of ``allowed`` on every block, and
    (where ``full`` and ``keep`` are allowed) full checkpointing of every k-th block (0, k, 2k, ...).

    Example::

        >>> simple_plans(3, ["keep", "full"])
        [['keep', 'keep', 'keep'], ['full', 'full', 'full'], ['full', 'keep', 'full']]
    """
    plans = [[c] * n for c in allowed]
    if "full" in allowed and "keep" in allowed:
        plans += [["full" if i % k == 0 else "keep" for i in range(n)] for k in range(2, n)]
    return plans


def _simplest_tie(profiles, plan: Plan, allowed, cost_model: CostModel) -> Plan:
    """``plan``, or the fastest hand-written plan that fits its ``max_bytes`` and ties with it (``CostModel.tie``)."""
    if not cost_model.use_time or plan.seconds is None:
        return plan
    margin = cost_model.tie * sum(p.seconds or 0.0 for p in profiles)
    candidates = (
        evaluate_plan(profiles, c, cost_model, plan.max_bytes, plan.transient)
        for c in simple_plans(len(profiles), allowed)
    )
    ties = [c for c in candidates if c.peak_bytes <= plan.max_bytes and c.cost <= plan.cost + margin]
    return min(ties, key=lambda c: (c.cost, c.activation_bytes), default=plan)


MODES: tuple[str, ...] = ("auto", "full", "selective", "offload", "every_n", "pointwise")
"""How blocks are treated: ``auto`` plans (under a limit where one is known), ``full``, ``selective``,
``offload`` and ``pointwise`` force that treatment on every block, ``every_n`` fully checkpoints every
n-th block."""


def check_mode(mode: str, every_n: int, cost_model=None) -> None:
    """Raise ``ValueError`` for an unknown ``mode``, ``every_n < 1``, or a ``cost_model`` that is not a
    :class:`CostModel` (None is)."""
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(
            f"cost_model must be a CostModel, got {cost_model!r}; e.g. CostModel(offload_flops_per_byte=1e4)"
        )
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_positive_int("every_n", every_n)


def initial_choices(names: Sequence[str], mode: str, every_n: int = 2) -> dict[str, str]:
    """What each block runs before any profile: ``every_n`` fully checkpoints blocks 0, n, 2n, ...; a
    forced mode its treatment everywhere; ``auto`` ``full`` everywhere (the least memory, for the first
    batch, which is measured and after which the blocks are planned).

    Example::

        >>> initial_choices(["a", "b", "c"], "every_n", 2)
        {'a': 'full', 'b': 'keep', 'c': 'full'}
    """
    if mode == "every_n":
        return {n: "full" if i % every_n == 0 else "keep" for i, n in enumerate(names)}
    return dict.fromkeys(names, "full" if mode == "auto" else mode)


def prediction_gap(predicted: int, measured: int, tolerance: float = 0.10) -> str | None:
    """Why ``measured`` activation bytes are more than ``tolerance`` away from ``predicted``, or None.

    Example::

        >>> prediction_gap(1000, 1050) is None, prediction_gap(1000, 2000)[:25]
        (True, 'the blocks held 1.95 KiB ')
    """
    if abs(measured - predicted) <= tolerance * max(predicted, 1):
        return None
    return (
        f"the blocks held {format_bytes(measured)} for backward, the plan predicted {format_bytes(predicted)} "
        f"(more than {tolerance:.0%} apart). The blocks' inputs or behaviour may change between batches "
        "(variable sequence length?); leave more headroom."
    )


def treatments(mode: str, *, planned: bool, offload: bool) -> list[str]:
    """What to profile for ``mode``: ``keep`` (recompute is measured against it) and what the mode can
    choose. A forced mode profiles its treatment only; ``auto`` all of them when it plans under a limit
    (``offload`` where allowed), else ``full`` (kept where it saves nothing: :func:`keep_where_no_gain`).

    Example::

        >>> treatments("auto", planned=True, offload=False), treatments("selective", planned=False, offload=True)
        (['keep', 'selective', 'full', 'pointwise'], ['keep', 'selective'])
    """
    if mode == "auto" and planned:
        return ["keep", "selective", "full", "pointwise"] + (["offload"] if offload else [])
    return ["keep", "full" if mode in ("auto", "every_n") else mode]


def _profiled(profiles: Sequence[BlockProfile]) -> list[str]:
    """The treatments every profile carries (a block that can only keep aside), in :data:`CHOICES` order."""
    return [c for c in CHOICES if all(c in p.options or p.note is not None for p in profiles)]


def _smallest_feasible(profiles, allowed, cost_model, transient: int = 0) -> int:
    """The smallest ``max_bytes`` any plan fits (peak bytes), by bisection over the search's feasibility."""
    lo, hi = 0, evaluate_plan(profiles, [allowed[0]] * len(profiles), transient=transient).peak_bytes
    while hi - lo > 1:  # the plan of allowed[0] everywhere fits hi
        mid = (lo + hi) // 2
        if _search(profiles, allowed, cost_model, mid, transient) is None:
            lo = mid
        else:
            hi = mid
    return hi


def _search(profiles, allowed, cost_model, max_bytes, transient: int = 0):
    states: dict[bool, list] = {False: [(0, 0.0, ())]}
    for p in profiles:
        new: dict[bool, list] = defaultdict(list)
        for prev, entries in states.items():
            for choice in dict.fromkeys(_usable(p, c) for c in allowed):
                o = p.options[choice]
                add, c = _step(p, o, prev), cost_model.cost(o)
                extra = _backward_peak(p, choice, prev, 0)  # what the block holds in its backward
                for b, cost, chosen in entries:
                    # Feasible if the chain still fits with this block (and the transient backward
                    # starts with), and so does its backward. Both grow with the prefix's bytes, so a
                    # dominated prefix stays dominated: still exact.
                    if max_bytes is None or max(b + add + transient, b + extra) <= max_bytes:
                        new[o.saves_output].append((b + add, cost + c, (*chosen, choice)))
        states = {k: _pareto(v) for k, v in new.items()}
    final = [e for v in states.values() for e in v]
    if not final:
        return None
    return list(min(final, key=lambda e: (e[1], e[0], e[2]))[2])


_MEASURED: dict[torch.device, tuple[float, float]] = {}  # each device timed once per process


def measured_cost_model(device: torch.device | str, base: CostModel | None = None) -> CostModel:
    """``base`` (default :class:`CostModel`) with the offload price measured
    on ``device``: a pinned round trip and a bf16 matmul, each timed once per device and process.

    Off CUDA, ``base`` unchanged: offload stays out of plans there, and its constant is never used.
    """
    base = base if base is not None else CostModel()
    if torch.device(device).type != "cuda":
        return base
    device = indexed(device)
    if device not in _MEASURED:
        _MEASURED[device] = (measure_transfer_rate(device), measure_matmul_rate(device))
    transfer, flops = _MEASURED[device]
    return base.with_transfer_rate(transfer, flops_per_second=flops)
