"""How the blocks are planned under a training step's memory limit (plain torch; no Lightning).

A step holds the parameters, their gradients and the optimizer state (:func:`state_bytes`), the
activations outside the blocks (embeddings, head, loss: measured around a real step) with the batch
beside them (what of it autograd does not hold: ``ForwardProbe.batch_bytes``) and the blocks'
activations. The blocks get what the limit leaves::

    blocks' share = max_memory * (1 - headroom) - states - outside

``max_memory * (1 - headroom)`` is resolved by :func:`lightning_memopt.memory.limit.usable_bytes`, the
one place where a limit becomes bytes. :func:`plan_step` plans under that share and, when no plan fits,
says so in the user's terms: the option as passed, what the step must hold, and the limit that would do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_memopt.checkpointing.costs import BlockProfile
from lightning_memopt.checkpointing.planner import (
    CostModel,
    NoPlanFitsError,
    Plan,
    evaluate_plan,
    keep_where_no_gain,
    measured_cost_model,
    plan_checkpointing,
    treatments,
)
from lightning_memopt.data.clock import Clock, step_clock
from lightning_memopt.memory import format_bytes
from lightning_memopt.memory.limit import StepLimit
from lightning_memopt.memory.tracker import state_bytes

__all__ = ["PlanPolicy", "plan_step", "plan_within", "state_bytes"]


def plan_within(
    profiles: Sequence[BlockProfile],
    usable: int,
    *,
    states: int,
    outside: int,
    transient: int = 0,
    allowed: Sequence[str] | None = None,
    cost_model: CostModel | None = None,
) -> Plan:
    """:func:`~lightning_memopt.checkpointing.plan_checkpointing` for a whole training step: the blocks get
    ``usable`` minus ``states`` (parameters, gradients, optimizer state: :func:`state_bytes`) minus the
    ``outside`` activations, and hold ``transient`` beside theirs when backward starts
    (:attr:`~lightning_memopt.checkpointing.Plan.transient`).

    Raises:
        NoPlanFitsError: If no plan fits. Its message names each part and the total the step needs;
            its ``minimum`` is that total (bytes).
    """
    try:  # with nothing left for the blocks, plan for 1 byte: the error says what the blocks need
        return plan_checkpointing(
            profiles,
            max(usable - states - outside, 1),
            allowed=allowed,
            cost_model=cost_model,
            transient=transient,
        )
    except NoPlanFitsError as err:
        need = states + outside + err.minimum
        what = (
            "does not even hold" if usable < states + outside else "is too small for any plan; it must hold"
        )
        raise NoPlanFitsError(
            f"{what} the parameters, gradients and optimizer state ({format_bytes(states)}), the activations "
            f"outside the blocks ({format_bytes(outside)}) and the blocks' smallest peak "
            + (f"with backward's first {format_bytes(transient)} beside them " if transient else "")
            + f"({format_bytes(err.minimum)}): {format_bytes(need)} in all",
            need,
        ) from err


def plan_step(
    profiles: Sequence[BlockProfile],
    limit: StepLimit,
    *,
    states: int,
    outside: int,
    transient: int = 0,
    allowed: Sequence[str] | None = None,
    cost_model: CostModel | None = None,
) -> Plan:
    """The plan of least recompute cost whose step fits in ``limit``: :func:`plan_within` its usable bytes.

    Args:
        profiles: One profile per block, in forward order.
        limit: The step's limit (:meth:`StepLimit.resolve`); it must be known (``usable`` not None).
        states: Bytes of parameters, gradients and optimizer state (:func:`state_bytes`).
        outside: Activations held outside the blocks at the end of the forward, in bytes.
        transient: Bytes backward's first ops hold beside the activations, outside the blocks.
        allowed: Treatments to choose from; ``keep`` among them, so that planning never raises the peak.
        cost_model: Prices of pointwise recompute and offload.

    Raises:
        ValueError: If ``limit.usable`` is None (nothing to plan under).
        NoPlanFitsError: If no plan fits. The message starts with the limit as the user passed it,
            names what the step must hold and the smallest ``max_memory`` that fits; ``minimum`` is that
            limit in bytes.

    Example::

        >>> plan = plan_step(profiles, StepLimit.resolve("6GiB", 0.1, None), states=2**30, outside=0)  # doctest: +SKIP
    """
    if limit.usable is None:
        raise ValueError(f"{limit.describe()} leaves no known usable bytes; pass max_memory in bytes")
    try:
        return plan_within(
            profiles,
            limit.usable,
            states=states,
            outside=outside,
            transient=transient,
            allowed=allowed,
            cost_model=cost_model,
        )
    except NoPlanFitsError as err:
        needed = limit.needed(err.minimum)
        raise NoPlanFitsError(
            f"{limit.describe()} (usable with headroom={limit.headroom}: {format_bytes(limit.usable)}) {err}. "
            f"Pass max_memory >= {format_bytes(needed)}, use a smaller micro-batch (AutoAccumulation) or "
            "shard the model (FSDP).",
            needed,
        ) from err


@dataclass(frozen=True)
class PlanPolicy:
    """How the blocks are planned once profiled: the mode, the step's limit, the treatments, the prices.
    Chosen once (:meth:`for_mode`, in ``setup``), so that no step re-derives them.

    Example::

        >>> policy = PlanPolicy.for_mode("auto", StepLimit.resolve("6GiB", 0.1, None), offload=False)
        >>> policy.treatments, policy.limit.usable
        (('keep', 'selective', 'full'), 5798205849)
    """

    mode: str
    """One of :data:`~lightning_memopt.checkpointing.MODES`."""
    limit: StepLimit
    """The step's limit; ``auto`` plans under it where ``limit.usable`` is known."""
    treatments: tuple[str, ...]
    """What profiling measures: ``keep`` and what the mode may choose (:func:`treatments`)."""
    cost_model: CostModel = CostModel()
    """How treatments are priced (measured seconds where timed, else FLOP-equivalents)."""
    clock: Clock | None = None
    """Where ``auto`` plans under a limit: the device's clock, on which profiling times every treatment
    (plans priced in seconds, :mod:`~lightning_memopt.checkpointing.timing`); None: nothing timed."""

    @classmethod
    def for_mode(
        cls,
        mode: str,
        limit: StepLimit,
        *,
        offload: bool,
        cost_model: CostModel | None = None,
        device: torch.device | str = "cpu",
    ) -> PlanPolicy:
        """The policy of ``mode`` under ``limit``; ``offload``: whether ``auto`` may offload to CPU.

        Without a ``cost_model``, offload is priced from a copy timed once on ``device`` where offload
        may be chosen (CUDA); elsewhere the :class:`CostModel` defaults hold. Where ``auto`` plans and
        the cost model prices in time (``use_time``), treatments are timed on ``step_clock(device)``.
        """
        chosen = treatments(mode, planned=limit.usable is not None, offload=offload)
        if cost_model is None and "offload" in chosen:
            cost_model = measured_cost_model(device)
        cost_model = cost_model or CostModel()
        planned = mode == "auto" and limit.usable is not None
        clock = step_clock(device) if planned and cost_model.use_time else None
        return cls(mode, limit, tuple(chosen), cost_model, clock)

    def choose(
        self,
        profiles: Sequence[BlockProfile],
        ran: Sequence[str] | Mapping[str, str],
        held: Callable[[], tuple[int, int, int]],
    ) -> Plan:
        """The plan to run once the blocks are profiled, ``ran`` being what the first batch ran (per
        profile, or by block name: blocks the forward did not run are not profiled).

        A forced mode keeps ``ran``. ``auto`` without a known limit keeps ``ran`` (every block ``full``)
        except where that lowers neither the bytes held nor the peak (:func:`keep_where_no_gain`); under
        a limit it is :func:`plan_step` with ``held()`` = (states, outside, transient), called only then.

        Raises:
            NoPlanFitsError: Under a limit, if no plan fits (:func:`plan_step`).
        """
        ran = [ran[p.name] for p in profiles] if isinstance(ran, Mapping) else list(ran)
        if self.mode != "auto" or self.limit.usable is None:
            chosen = list(ran) if self.mode != "auto" else keep_where_no_gain(profiles, ran)
            return evaluate_plan(profiles, chosen, self.cost_model)
        states, outside, transient = held()
        return plan_step(
            profiles,
            self.limit,
            states=states,
            outside=outside,
            transient=transient,
            allowed=self.treatments,
            cost_model=self.cost_model,
        )
