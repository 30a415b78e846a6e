"""Plans per batch shape: a plan made for one shape is reused for every batch no larger than it.

A plan's bytes were profiled on one batch; a longer batch (padding to each batch's longest sequence)
makes every block hold more, so a plan made on a short first batch can break its bound later.
:class:`ShapePlans` keeps the plans made so far keyed by the shapes of the batch they were made on and
says, before a batch runs, whether one of them covers it or the blocks must be profiled again.

The assumption: the bytes a block holds for backward do not shrink when no dimension of any batch tensor
grows. It holds for models whose activations are sized by the batch (batch size, sequence length, image
side); it fails for a model whose activations do not follow its inputs' shapes (data-dependent routing,
for instance), which no shape-keyed plan can bound.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

from lightning_memopt.batching.split import tensors_of
from lightning_memopt.checkpointing.costs import BlockProfile
from lightning_memopt.checkpointing.planner import Plan, evaluate_plan
from lightning_memopt.memory.units import format_bytes

Signature = tuple[tuple[int, ...], ...]
"""The shapes of a batch's tensors, in the order :func:`~lightning_memopt.batching.split.tensors_of` walks the batch."""


def shape_signature(batch) -> Signature:
    """The shapes of the tensors in ``batch`` (any nesting of mappings, sequences, named tuples and
    dataclasses: a tokenizer's ``BatchEncoding`` too); other leaves are ignored.

    Example::

        >>> import torch
        >>> shape_signature({"input_ids": torch.zeros(4, 9), "labels": torch.zeros(4, 9), "n": 3})
        ((4, 9), (4, 9))
    """
    return tuple(tuple(t.shape) for _, t in tensors_of(batch, strict=False))


def step_signature(batch, micro_batch: int | None) -> Signature:
    """:func:`shape_signature` of ``batch``, and where the batch runs as micro-batches (``AutoAccumulation``,
    ``OOMBackoff``), ``(micro_batch,)`` after it, the largest micro-batch's samples: the blocks hold what
    one micro-batch makes them hold, so a plan profiled on one covers steps whose micro-batches are no
    larger, and serves those of other batches (:func:`serves`).

    Example::

        >>> import torch
        >>> step_signature({"input_ids": torch.zeros(8, 9)}, 3), step_signature(torch.zeros(8, 9), None)
        (((8, 9), (3,)), ((8, 9),))
    """
    shapes = shape_signature(batch)
    return shapes if micro_batch is None else (*shapes, (micro_batch,))


def covers(planned: Signature, batch: Signature) -> bool:
    """Whether a plan made for ``planned`` holds for ``batch``: the same tensors, none of them larger in
    any dimension.

    Example::

        >>> covers(((8, 64),), ((8, 32),)), covers(((8, 64),), ((16, 32),))
        (True, False)
    """
    return _same_ranks(planned, batch) and all(x >= y for p, b in zip(planned, batch) for x, y in zip(p, b))


def serves(planned: Signature, batch: Signature) -> bool:
    """Whether a plan made for ``planned`` runs a step of ``batch``: it :func:`covers` it, and it was not
    made for larger micro-batches of the same batch (:func:`step_signature`'s last entry): after a back-off
    the smaller micro-batches get a plan of their own, which recomputes no more than they need.

    Example::

        >>> serves(((8, 64), (8,)), ((8, 32), (8,))), serves(((8, 64), (8,)), ((8, 64), (4,)))
        (True, False)
    """
    smaller = (
        len(planned) == len(batch) > 1
        and planned[:-1] == batch[:-1]
        and len(planned[-1]) == len(batch[-1]) == 1
        and batch[-1][0] < planned[-1][0]
    )
    return covers(planned, batch) and not smaller


def _same_ranks(planned: Signature, batch: Signature) -> bool:
    """Whether two signatures have the same tensors of the same ranks (their dimensions compare)."""
    return len(planned) == len(batch) and all(len(p) == len(b) for p, b in zip(planned, batch))


def _elements(signature: Signature) -> int:
    total = 0
    for shape in signature:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def full_peak(profiles: Sequence[BlockProfile]) -> int:
    """The blocks' peak with every block fully checkpointed: the inputs of all, and one block's forward
    recomputed in backward (:func:`~lightning_memopt.checkpointing.evaluate_plan`)."""
    return evaluate_plan(profiles, ["full"] * len(profiles)).peak_bytes


class ShapePlans:
    """The plans made so far, each keyed by the shapes of the batches it was profiled on.

    :meth:`plan_for` returns, for a batch about to run, the cheapest plan made for shapes that cover it
    (:func:`serves`), or None when none does: the caller then runs that batch with every block fully
    checkpointed (the least memory), profiles it and :meth:`add` s the new plan. Plans for known shapes are
    reused; a new plan is made only for a batch larger than all planned ones in some dimension.

    With several processes, a plan is made on all their batches at once (each its own shapes; the blocks'
    figures are the largest over processes: :func:`~lightning_memopt.checkpointing.ranks.agree`), so it is
    keyed by every process's shapes, and every process keeps the same plans under the same keys.

    Example::

        >>> plans = ShapePlans()
        >>> plans.plan_for(((4, 8),)) is None
        True
        >>> plan = Plan.unprofiled({"h.0": "keep"})
        >>> plans.add(((4, 8),), plan, full_bytes=1024, also=[((2, 12),)])
        >>> plans.plan_for(((4, 6),)) is plan, plans.plan_for(((2, 10),)) is plan, plans.plan_for(((4, 16),))
        (True, True, None)
    """

    def __init__(self) -> None:
        self.made = 0
        """How many plans were made in this run (profiles after a fully checkpointed batch)."""
        # Each plan made, in order, with the shapes it covers (one per process that profiled it).
        self._entries: list[tuple[Plan, list[Signature]]] = []
        # The largest batch planned and the blocks' peak on it fully checkpointed.
        self._full: tuple[Signature, int] | None = None

    @property
    def plans(self) -> dict[Signature, Plan]:
        """Each shape planned for and the plan made on it."""
        return {signature: plan for plan, signatures in self._entries for signature in signatures}

    def _uncovered(self, signature: Signature) -> list[int]:
        """Per plan made, 1 where none of its shapes serves ``signature`` (:func:`serves`), 0 where one does."""
        return [int(not any(serves(k, signature) for k in keys)) for _, keys in self._entries]

    def _cheapest(self, uncovered: Sequence[int]) -> Plan | None:
        fitting = [plan for (plan, _), out in zip(self._entries, uncovered) if not out]
        return min(fitting, key=lambda plan: plan.cost, default=None)

    def plan_for(self, signature: Signature) -> Plan | None:
        """The cheapest known plan whose shapes cover ``signature``, or None if none does."""
        return self._cheapest(self._uncovered(signature))

    def add(
        self, signature: Signature, plan: Plan, *, full_bytes: int, also: Sequence[Signature] = ()
    ) -> None:
        """Keep ``plan`` for ``signature`` and the shapes ``also`` profiled with it (the other processes'
        batches); ``full_bytes``: the blocks' peak fully checkpointed on them (the least any plan reaches:
        :func:`full_peak`)."""
        keys = list(dict.fromkeys([signature, *also]))
        self._entries.append((plan, keys))
        self.made += 1
        largest = max(keys, key=_elements)
        if self._full is None or _elements(largest) >= _elements(self._full[0]):
            self._full = (largest, full_bytes)

    def exact(self, signature: Signature, plan: Plan) -> bool:
        """Whether ``plan``'s figures are those of a batch of ``signature``: no plan is kept by shape, or
        ``signature`` is the largest shape ``plan`` was made on (a batch it covers otherwise holds less)."""
        if not self._entries:
            return True
        keys = next((keys for made, keys in self._entries if made is plan), [])
        return signature in keys and all(covers(signature, k) for k in keys)

    def next_plan(
        self, signature: Signature, current: Plan, most: Callable[[list[int]], list[int]], sized: bool = False
    ) -> Plan:
        """The plan a batch of ``signature`` runs, ``current`` being the plan that ran last.

        ``most(flags)``: each flag's largest over processes (the flags themselves in one process). Per plan
        made, a flag says whether it does not cover this process's batch; the batch runs the cheapest plan
        that covers every process's batch, the same plan on every process. Where none does, every block
        runs ``full`` unprofiled, after a warning if that too is estimated over ``current``'s ``max_bytes``
        (:meth:`overrun`; not where ``sized``: a micro-batching engine measures the step's micro-batches to
        fit, and says so itself where one sample does not), and is profiled on every process.
        """
        uncovered = self._uncovered(signature)
        known = self._cheapest(most(uncovered) if uncovered else [])  # the same plans on every process
        if known is not None:
            return known
        overrun = None if sized else self.overrun(signature, current.max_bytes)
        if overrun is not None:
            warnings.warn(overrun, stacklevel=2)
        return Plan.unprofiled(dict.fromkeys(current.choices, "full"))

    def overrun(self, signature: Signature, max_bytes: int | None) -> str | None:
        """Why a batch of ``signature`` may not fit the blocks' ``max_bytes`` even fully checkpointed, or None.

        The estimate scales the blocks' peak on the largest fully checkpointed batch by the growth of the
        batch's element count times the largest growth of one dimension: a bound for activations up to
        quadratic in one dimension (attention's T x T scores), above the truth for linear ones (a CNN's maps).
        """
        if self._full is None or max_bytes is None or not _elements(self._full[0]):
            return None
        planned, held = self._full
        growth = [b / p for ps, bs in zip(planned, signature) for p, b in zip(ps, bs) if p]
        longest = max(growth, default=1.0) if _same_ranks(planned, signature) else 1.0
        estimate = int(held * _elements(signature) / _elements(planned) * max(longest, 1.0))
        if estimate <= max_bytes:
            return None
        return (
            f"AutoCheckpoint: a batch of shapes {list(signature)} arrives; fully checkpointed (the least any "
            f"plan reaches) its blocks' peak may reach {format_bytes(estimate)}, over the "
            f"blocks' share {format_bytes(max_bytes)} within the limit. Raise max_memory or lower headroom, or "
            "make batches smaller (shorter sequences, fewer samples, AutoAccumulation)."
        )

    def state(self) -> list[dict]:
        """The plans as plain values, for a checkpoint: per plan, its first shapes and the other
        processes' (``also``)."""
        as_lists = lambda keys: [[list(shape) for shape in key] for key in keys]  # noqa: E731
        return [
            {"shapes": as_lists(keys[:1])[0], "also": as_lists(keys[1:]), "plan": plan.to_dict()}
            for plan, keys in self._entries
        ]

    def load(self, entries: list[dict]) -> None:
        """Restore :meth:`state`."""
        signature = lambda shapes: tuple(tuple(s) for s in shapes)  # noqa: E731
        self._entries = [
            (
                Plan.from_dict(entry["plan"]),
                [signature(entry["shapes"]), *map(signature, entry.get("also", ()))],
            )
            for entry in entries
        ]
