"""The shape of a batch, and a micro-step's peak memory as a function of it (plain torch)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_memopt.batching.size_search import MemoryModel

__all__ = ["ShapeModel", "tokens_per_sample"]


def tokens_per_sample(batch: Any) -> int:
    """The longest dim-1 length among the 2-D+ integer and floating-point tensors of ``batch``; 1 if none.

    Example::

        >>> tokens_per_sample({"input_ids": torch.zeros(4, 37, dtype=torch.long), "y": torch.zeros(4)})
        37
    """
    if isinstance(batch, torch.Tensor):
        counted = batch.is_floating_point() or not (batch.is_complex() or batch.dtype == torch.bool)
        return batch.shape[1] if batch.dim() >= 2 and counted else 1
    if isinstance(batch, Mapping):
        items: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return 1
    return max((tokens_per_sample(item) for item in items), default=1)


@dataclass
class ShapeModel:
    """A training micro-step's peak bytes as a function of its shape, fitted to probes.

    ``peak(samples, width) = held + workspace + samples * per_sample(width)``: exact at a measured width,
    the chord between two measured widths, the nearest one scaled by ``linear * width + quadratic *
    width**2`` beyond them (``docs/micro_batching.md``, "Per-batch sizing").

    Example::

        >>> model = ShapeModel(usable=10_000, limit=11_000, workspace=0)
        >>> model.measured(width=10, samples=4, increment=4 * 110)  # 110 bytes per sample of 10 tokens
        >>> model.measured(width=40, samples=2, increment=2 * 1_040)
        >>> round(model.linear, 6), round(model.quadratic, 6)  # 110 = 10 a + 100 b, 1,040 = 40 a + 1,600 b
        (6.0, 0.5)
        >>> model.per_sample(20), model.samples_for(20)  # the chord: 110 + (1,040 - 110) / 3
        (420.0, 23)
        >>> round(model.per_sample(50), 6), model.knows(50), model.knows(70)  # 1,040 x (fitted 50 / 40)
        (1550.0, True, False)
    """

    usable: int
    """Bytes a step may peak at: the memory limit less the headroom."""
    limit: int
    """The memory limit itself: what a step that ran out of memory went over."""
    workspace: float
    """Bytes a micro-step allocates that do not grow with its samples."""
    held: int = 0
    """Bytes alive when a step's micro-batches start, besides what they allocate."""
    points: dict[int, float] = field(default_factory=dict)
    """Bytes per sample by width measured (raised by :meth:`missed`)."""
    linear: float = 0.0
    """Fitted bytes per token of a sample."""
    quadratic: float = 0.0
    """Fitted bytes per token squared of a sample."""
    revision: int = 0
    """Counts the changes of the predictions (measurements and misses)."""

    def per_sample(self, width: int) -> float:
        """Bytes one sample of ``width`` tokens adds to the peak."""
        if width in self.points:
            return self.points[width]
        below, above = self._neighbours(width)
        if below is not None and above is not None:  # the chord
            s_lo, s_hi = self.points[below], self.points[above]
            return s_lo + (s_hi - s_lo) * (width - below) / (above - below)
        nearest = below if above is None else above
        if nearest is None:
            return 0.0
        fitted = self._fitted(nearest)
        scale = self._fitted(width) / fitted if fitted > 0 else width / nearest
        return self.points[nearest] * scale

    def _fitted(self, width: int) -> float:
        return self.linear * width + self.quadratic * width * width

    def samples_for(self, width: int, *, held: int | None = None) -> int:
        """The most samples of ``width`` tokens whose micro-step fits the usable bytes (at least 1), with ``held``
        bytes alive besides (None: :attr:`held`)."""
        room = self.usable - (self.held if held is None else held) - self.workspace
        cost = self.per_sample(width)
        return max(1, int(room // cost)) if cost > 0 else 2**62

    def knows(self, width: int) -> bool:
        """Whether ``width`` is within a factor of sqrt(2) of a measured width, or between two measured
        widths at most a factor of 2 apart (else the next batch of it is probed first)."""
        if any(max(width / t, t / width) <= math.sqrt(2) for t in self.points):
            return True
        below, above = self._neighbours(width)
        return below is not None and above is not None and above <= 2 * below

    def _neighbours(self, width: int) -> tuple[int | None, int | None]:
        """The measured widths just below and just above ``width`` (None where there is none)."""
        below = max((t for t in self.points if t < width), default=None)
        return below, min((t for t in self.points if t > width), default=None)

    def measured(self, *, width: int, samples: int, increment: float) -> None:
        """A probe of ``samples`` samples of ``width`` tokens peaked ``increment`` bytes above its start."""
        self.add(width, max(increment - self.workspace, 1.0) / samples)

    def add(self, width: int, per_sample: float) -> None:
        """One sample of ``width`` tokens costs ``per_sample`` bytes (replacing what was measured there)."""
        self.points[width] = per_sample
        self._fit()
        self.revision += 1

    def missed(self, *, width: int, samples: int) -> None:
        """``samples`` samples of ``width`` tokens ran out of memory: each costs at least its share of the
        limit; from now on fewer are predicted to fit, at this width and by interpolation near it."""
        at_least = (self.limit - self.held - self.workspace) / samples
        if at_least > self.per_sample(width):
            self.add(width, at_least)

    def _fit(self) -> None:
        """Least squares of ``linear * T + quadratic * T**2`` to the measured costs, relative error, both
        coefficients at least 0."""
        rows = [(t / s, t * t / s) for t, s in self.points.items()]  # a * x + b * y = 1 at each point
        xx, xy, yy = (sum(x * x for x, _ in rows), sum(x * y for x, y in rows), sum(y * y for _, y in rows))
        sx, sy = sum(x for x, _ in rows), sum(y for _, y in rows)
        det = xx * yy - xy * xy
        a = b = -1.0
        if len(rows) > 1 and det > 1e-12 * xx * yy:
            a, b = (sx * yy - sy * xy) / det, (sy * xx - sx * xy) / det
        if b < 0 or a < 0:  # one width, or a curve that bends down: the better of linear and quadratic alone
            lin, quad = (sx / xx, 0.0), (0.0, sy / yy)
            error = lambda c: sum((c[0] * x + c[1] * y - 1) ** 2 for x, y in rows)  # noqa: E731
            a, b = min(lin, quad, key=error) if len(rows) > 1 else lin
        self.linear, self.quadratic = a, b

    def state(self) -> dict[str, Any]:
        """Plain values for a checkpoint."""
        return {
            "usable": self.usable,
            "limit": self.limit,
            "workspace": self.workspace,
            "points": [[t, s] for t, s in self.points.items()],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ShapeModel:
        """The model :meth:`state` saved."""
        model = cls(usable=state["usable"], limit=state["limit"], workspace=state["workspace"])
        for t, s in state["points"]:
            model.add(int(t), float(s))
        return model

    @classmethod
    def from_probes(
        cls, probes: list[tuple[int, int | None]], *, width: int, size: int, whole: bool, **limits: int
    ) -> ShapeModel:
        """The model of the first batch's search: ``probes`` (``(samples, peak or None)``, at ``width``) found
        ``size`` (``whole``: the whole batch); ``limits``: ``usable``, ``limit`` and ``held``. It predicts
        exactly ``size`` at ``width`` (more only for a whole batch whose probe says more would fit)."""
        usable, held = limits["usable"], limits["held"]
        s2, p2 = max((s, p) for s, p in probes if p is not None and p <= usable)
        line = MemoryModel.through_largest(probes, usable)  # what the search's result reports as its model
        intercept = held if line is None else line.fixed
        model = cls(usable=usable, limit=limits["limit"], workspace=intercept - held, held=held)
        room = usable - held - model.workspace
        cost = max(p2 - held - model.workspace, 1.0) / s2  # what the largest fitting probe measured
        if not whole:  # size + 1 is unverified (ruled out, or of no use to an even split): predict size
            cost = max(cost, room / (size + 1) * (1 + 1e-9))
        model.add(width, cost)
        return model
