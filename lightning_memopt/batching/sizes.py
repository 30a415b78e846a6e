"""How many samples a training micro-batch holds: the one place that decides it (plain torch).

With activation checkpointing offered (:class:`Recompute`: ``AutoCheckpoint`` beside ``AutoAccumulation``),
the first batch's search also decides whether to recompute at all, by time: micro-batching is exact, so
recomputation is worth only the faster step of the larger micro-batches it allows (:meth:`MicroBatchSizes.
decide`). The ways are timed in the fit's own first optimizer steps, taking turns (the *trial*): any way
gives a step the same gradient, so the timing costs no extra step.

Sizes are kept in padded tokens (samples x the batch's tokens per sample, its *width*) and converted to
samples of the batch of the moment in one method, :meth:`MicroBatchSizes.samples`. How the sizes are
probed, backed off, grown and agreed on: ``docs/micro_batching.md`` ("Sizing", "Per-batch sizing").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lightning_memopt._text import counted
from lightning_memopt.batching.distributed import (
    any_rank,
    is_distributed,
    max_over_ranks,
    max_over_ranks_each,
    min_over_ranks,
)
from lightning_memopt.batching.errors import BATCHNORM_ADVICE, MicroBatchOOMError, checklist
from lightning_memopt.batching.shape_model import ShapeModel
from lightning_memopt.batching.size_search import MemoryModel, NoSizeFits, find_micro_batch_size
from lightning_memopt.batching.split import largest_micro_batch
from lightning_memopt.memory.limit import usable_bytes
from lightning_memopt.memory.units import format_bytes

__all__ = ["MicroBatchSizes", "Probes", "Recompute"]

_FAILED = 2**62  # what a probe that ran out of memory reports to the other ranks
_ROUNDS = 3  # probe rounds at most for one new width
_TRIAL_ROUNDS = 2  # the steps each way runs in the trial, taking turns (the fastest of them counts)
_MORE_ROUNDS = 2  # rounds the trial may add where its steps' spread leaves the decision open
_SPREAD = 0.15  # of a step: a spread counted at most (beyond it: a first step's one-time cost, not noise)
_GAIN = 0.02  # of a step: the least a later way must save (else it is neither searched, tried, nor run)


class Probes(Protocol):
    """What :class:`MicroBatchSizes` needs from the engine to measure a batch
    (:class:`~lightning_memopt.batching.probe.BatchProbes`)."""

    device: torch.device
    """Where the ranks' agreements run."""
    floor: int
    """The fewest samples a training micro-batch can hold (2 with BatchNorm in training mode)."""
    evaluates: bool
    """Also search the evaluation size (the module has a ``validation_step``)."""
    seconds: float | None
    """The last :meth:`peak`'s micro-step in seconds on the device's clock (None if it ran out of memory or
    was not timed)."""

    def peak(self, samples: int, evaluation: bool) -> int | None:
        """Peak bytes of one training (or evaluation) micro-step of that many samples of the batch, None
        if it ran out of memory; nothing else changes."""

    def held(self) -> int:
        """Bytes alive when a micro-step of the batch starts, besides what it allocates."""


class Recompute(Protocol):
    """What activation checkpointing offers the first batch's search (``AutoCheckpoint`` in ``auto`` mode):
    its blocks kept or all recomputed while sizes are probed, then the decision; and, where it installed a
    chunked output head, the model's own head instead."""

    own_head: bool
    """Whether ``"own head"`` is a way: every block kept and the model's own output head."""

    def use(self, way: str) -> None:
        """Run the way ``"keep"`` (every block kept) or ``"full"`` (every block recomputed) from now on, or
        ``"own head"`` (kept, the model's own head)."""

    def try_plan(self, kept_peak: Callable[[int], float] | None = None) -> None:
        """Run, at a step of the trial, the least recompute that fits the micro-batch about to run: the
        first time, every block recomputed while the step is measured, for the plan made when it ends;
        later, that plan. ``kept_peak``: as for :meth:`decided`."""

    def decided(self, way: str, why: str, kept_peak: Callable[[int], float] | None = None) -> None:
        """The search chose ``way`` for the micro-batches to come, for the reason ``why`` (one line);
        ``kept_peak(samples)``: where recompute won over plain micro-batches that fit, a whole micro-step's
        peak bytes with every block kept, from the sizes the search measured."""

    def fall_back(self, why: str) -> bool:
        """After ``keep`` or ``own head``, a batch not one sample of fits: recompute from this step on, for
        the reason ``why``; whether anything changed (else the out-of-memory error stands)."""


class MicroBatchSizes:
    """The training micro-batch size and everything that moves it (see the module docstring).

    Args:
        micro_batch_size: Samples per micro-batch from the start (of the first batch); None: the whole batch.
        eval_micro_batch_size: Samples per validation/test/predict micro-batch; None: the whole batch.
        grow_after: Clean steps in a row after which a reduced size doubles; None: never grow.
        max_memory: Bytes a step may use (less ``headroom``): probe for the size before the first step. None:
            do not probe.
        headroom: Fraction of ``max_memory`` kept free.
        max_probes: Most probes of the first batch's search.

    Example::

        >>> sizes = MicroBatchSizes(grow_after=2)
        >>> sizes.see(1)  # a batch of 10 samples without a sequence dimension
        >>> sizes.failed(10, total=10, floor=1, failure="OOM")  # the whole batch ran out of memory
        >>> sizes.samples("tokens")
        5
        >>> sizes.succeeded(retried=True, total=10)  # the step that backed off
        >>> sizes.succeeded(retried=False, total=10); sizes.succeeded(retried=False, total=10)
        >>> sizes.samples("tokens")  # 10 failed: grows only up to 9
        9
    """

    def __init__(
        self,
        *,
        micro_batch_size: int | None = None,
        eval_micro_batch_size: int | None = None,
        grow_after: int | None = None,
        max_memory: int | None = None,
        headroom: float = 0.1,
        max_probes: int = 6,
    ) -> None:
        # Sizes in padded tokens; before the first batch is seen (width None) in samples of it.
        self.tokens: int | None = micro_batch_size
        """Tokens per micro-batch known to fit; None runs whole batches."""
        self.max_tokens: int | None = None
        """The cap when growing back: the size the fit started at, in tokens."""
        self.failed_tokens: int | None = None
        """The smallest micro-batch, in tokens, that ran out of memory (or thrashed)."""
        self.width: int | None = None
        """Tokens per sample of the batch of the moment; None before the first batch."""
        self.model: ShapeModel | None = None
        """Peak bytes by shape; when set, it sizes every batch."""
        self.eval_size = eval_micro_batch_size
        self.grow_after = grow_after
        self.max_memory, self.headroom, self.max_probes = max_memory, headroom, max_probes
        self.probed = max_memory is None  # nothing to probe without a limit
        self.oom_retries = self.eval_oom_retries = self.near_misses = 0
        self.clean_steps = 0
        """Steps in a row without a retry (towards ``grow_after``)."""
        self.stable_steps = 0
        """Steps in a row that succeeded at the current size (the engine's regimes read it)."""
        self.last_total: int | None = None
        self.ran: int | None = None  # samples per micro-batch of the last step that trained
        self.probes: list[tuple[int, int | None]] = []
        self._timed: list[tuple[int, float]] = []  # a way's training probes that ran: samples, seconds
        self.eval_probes: list[tuple[int, int | None]] = []
        self.shape_probes: list[tuple[int, int, int | None]] = []
        self.probed_width: int | None = None
        self._retry: int | None = None  # with a model: the halved size of the step being retried
        self.recompute: Recompute | None = None
        """Where activation checkpointing takes part in the first batch's search (:meth:`decide`)."""
        self.fallback: Recompute | None = None
        """Where activation checkpointing can still recompute once the search decided against it: a later
        batch whose micro-batch of the fewest samples runs out of memory then recomputes (:meth:`failed`)."""
        self.step_seconds: float | None = None
        """The optimizer step's seconds at the way and size chosen (its micro-steps' together), as its trial
        step measured them, or as the search's timed probes predict them where they ruled the later ways
        out (:func:`_fewer_cannot_pay`)."""
        self._trial: _Trial | None = None
        self._limits: tuple[int, int, int] | None = None  # the search's (limit, held, whole batch)
        self._leaving = False  # a trial way ran out of memory at the floor: the trial ends (_next_way)
        self.done: frozenset[str] = frozenset()
        """What the fit already does of the out-of-memory advice (:func:`~.errors.checklist`), left out of
        the errors' checklist (the engine tells at fit start)."""

    # ------------------------------------------------------------------ reading
    def see(self, width: int) -> None:
        """A batch of ``width`` tokens per sample is next (the first one turns sizes in samples into tokens)."""
        if self.width is None:
            for name in ("tokens", "max_tokens", "failed_tokens"):
                value = getattr(self, name)
                setattr(self, name, None if value is None else value * width)
        self.width = width

    def samples(self, name: str) -> int | None:
        """The size ``name`` (``tokens``, ``max_tokens``, ``failed_tokens``) in samples of the batch of the moment:
        the one conversion from the unit sizes are kept in."""
        tokens = getattr(self, name)
        return None if tokens is None else max(1, tokens // (self.width or 1))

    def _set(self, name: str, samples: int | None) -> None:
        setattr(self, name, None if samples is None else samples * (self.width or 1))

    def size(self, total: int, held: int | None = None) -> int:
        """Samples per micro-batch of a batch of ``total`` samples at the width seen last (no probe)."""
        if self.model is not None:
            predicted = min(self.model.samples_for(self.width or 1, held=held), total)
            return min(predicted, self._retry or predicted)
        return min(self.samples("tokens") or total, total)

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per micro-batch: :attr:`tokens` in samples (None: whole batches), or with a memory model the size the
        last batch trained at."""
        return self.ran if self.model is not None else self.samples("tokens")

    @property
    def max_micro_batch_size(self) -> int | None:
        """The cap when growing back, in samples of the last batch."""
        return self.samples("max_tokens")

    @property
    def smallest_failed_size(self) -> int | None:
        """The smallest size that ran out of memory, in samples of the last batch."""
        return self.samples("failed_tokens")

    # ------------------------------------------------------------------ before each step
    def plan(
        self, *, total: int, width: int, probes: Probes, flag: Callable[[int], bool] = lambda size: False
    ) -> tuple[int, int | None, bool | None]:
        """This batch's samples per micro-batch, the number of micro-batches every rank runs (None: not
        agreed), and ``flag(size)`` agreed over ranks (true if any rank's is; None where the ranks do not
        agree before a step: without a memory model under DDP/FSDP2). Probes first where needed: the first
        batch's search, a width the model does not know."""
        if not self.probed:
            self._search(total, width, probes)
        elif self._trial is not None:
            self._next_way(probes)
        if self.model is None:
            self.see(1 if is_distributed() else width)  # in samples under DDP/FSDP2 (no per-step agreement)
            size = self.size(total)
            return size, None, None if is_distributed() else flag(size)
        self.see(width)
        self.model.held = probes.held()
        size = self.size(total)
        new, count, flag = max_over_ranks_each(
            [not self.model.knows(width), -(-total // size), flag(size)], probes.device
        )
        if new:
            self._measure(width, total, probes)
            size = self.size(total)
            count = max_over_ranks(-(-total // size), probes.device)
        return size, count, bool(flag)

    def _measure(self, width: int, total: int, probes: Probes) -> None:
        """Probe this batch at the size the model predicts for ``width``; a probe that runs out of memory
        raises the prediction and every rank probes again (FSDP2's collectives inside the probes match);
        one of the fewest samples, after the search decided against recompute, recomputing
        (:meth:`_recompute_instead`)."""
        assert self.model is not None
        for _ in range(_ROUNDS):
            size = min(self.model.samples_for(width), total)
            peak = probes.peak(size, False)
            increment = None if peak is None else peak - probes.held()
            self.shape_probes.append((width, size, increment))
            if increment is None:
                self.model.missed(width=width, samples=size)
            else:
                self.model.measured(width=width, samples=size, increment=increment)
            if not any_rank(increment is None, probes.device):
                return
            if any_rank(size <= probes.floor, probes.device):  # the next round probes it recomputing
                self._recompute_instead(size, total)

    def _search(self, total: int, width: int, probes: Probes) -> None:
        """The first batch: find the largest size that fits, and the model of its peaks."""
        self.probed = True
        device = probes.device
        # The smallest device decides; every rank searches with the same usable bytes and, at the longest width
        # over ranks (the largest peaks), takes the same path: the same probes, the same collectives.
        limit = min_over_ranks(self.max_memory, device)
        self.probed_width = max_over_ranks(width, device)
        held = probes.held()
        whole = min_over_ranks(total, device)
        self._limits = (limit, held, whole)
        if self.recompute is not None:
            size = self.decide(probes, whole, limit)
        else:
            size = self._find(probes, whole, limit, probes.floor, evaluation=False)
        self._size_to(size)
        if self.eval_size is None and probes.evaluates:
            self.eval_size = self._find(probes, whole, limit, 1, evaluation=True)

    def _size_to(self, size: int) -> None:
        """Size from :attr:`probes` (the search's probes of the way that runs) at ``size`` samples: the shape
        model of their peaks, and the size to grow back to."""
        assert self._limits is not None and self.probed_width is not None
        limit, held, whole = self._limits
        self.model = ShapeModel.from_probes(
            self.probes,
            width=self.probed_width,
            size=size,
            whole=size == whole,
            usable=usable_bytes(limit, self.headroom, None),
            limit=limit,
            held=held,
        )
        if self.failed_tokens is None:  # unless a restored back-off is current
            self.tokens = self.max_tokens = size * self.probed_width if self.width is not None else size

    def decide(self, probes: Probes, whole: int, limit: int) -> int:
        """The size, and whether the blocks recompute (and which output head runs), of the fastest
        optimizer step that fits.

        The ways, cheapest per sample first: the model's own output head with every block kept (where a
        chunked head was installed: :attr:`Recompute.own_head`), every block kept (``keep``), every block
        recomputed (``full``). For each in turn the largest micro-batch that fits is found, starting where
        the one before ended (a later way holds less); where the whole batch fits, the later ways are not
        tried, nor where the first way that fits is measured to gain nothing from larger micro-batches: its
        probes are timed, and where a micro-step's seconds grow with its samples alone, one micro-batch
        instead of several would make the step at most :data:`_GAIN` faster, before any recompute's cost
        (:func:`_fewer_cannot_pay`; a large model on a GPU: no profile, no trial). A later way counts only
        where it runs the step in fewer micro-batches (``ceil(whole / size)``, split evenly) than every way
        before it: as many micro-steps, each costing more, cannot be faster. Where one way counts, it is
        taken untimed; else the ways that count run the fit's next optimizer steps, taking turns,
        :data:`_TRIAL_ROUNDS` steps each (the trial; :meth:`_next_way`; up to :data:`_MORE_ROUNDS` more where
        the spread of their steps leaves the decision open): the engine times each step's
        micro-steps as they train (evenly split: 4 of 12 where 15 fit a batch of 48), each way's fastest step counts (a first step pays first-time costs; taking turns, a machine
        that slows down meanwhile weighs on every way alike), and the fastest way runs from the step after
        the last, where it saves more than :data:`_GAIN` of the step of every way before it (a later way
        changes more: the chunked head for the model's own, recompute for none; within 2% a trial on a
        shared machine reads noise, 0.461 against 0.465 s where the same two ran 0.613 and 0.587 a step).
        Recompute runs as it would if it won: at its first turn, the fit's first step (slowed by
        the probes before it: it prices no way), every block recomputes while ``AutoCheckpoint`` measures
        the step and plans the least recompute that fits its micro-batch; its later turns (two, as every
        way's) run that plan, and they price it (every block
        recomputed priced the ResNet of ``benchmarks/fastest_step.py`` at 0.22 s a step where its plan
        ran 0.17). Any way gives a step the same gradient: the timing costs no extra step, only the slower
        ways' extra seconds and the plan's profile. Every rank takes the same path (sizes are the smallest
        over ranks, seconds the longest).
        """
        assert self.recompute is not None
        floor = probes.floor
        ways = (["own head"] if self.recompute.own_head else []) + ["keep", "full"]
        said = _said(chunked=ways[0] == "own head")
        named = {"keep": "the chunked head", "full": "recomputing"}

        def largest(way: str, start: int | None, fixed: float | None) -> tuple[int | None, list]:
            self.recompute.use(way)
            self.probes, self._timed = [], []
            try:
                size = self._find(probes, whole, limit, floor, evaluation=False, start=start, fixed=fixed)
            except MicroBatchOOMError:
                return None, self.probes
            return size, self.probes

        found: dict[str, tuple[int | None, list[tuple[int, int | None]]]] = {}
        counting: list[str] = []  # the ways that run the step in fewer micro-batches than those before
        # Each later way starts where the one before ended, its next probe predicted from the bytes that
        # the ways before measured not to grow with the size (parameters, gradients, optimizer state, the
        # batch; the last way's line that had two sizes fit): they are the same whatever the blocks keep,
        # which saves a probe a way.
        start, fixed, flat = None, None, None
        for way in ways:
            size, way_probes = found[way] = largest(way, start, fixed)
            if size is None:
                continue
            if not counting or _split(size, whole)[0] < _split(found[counting[-1]][0], whole)[0]:
                counting.append(way)
            start = size
            line = MemoryModel.through_largest(way_probes, usable_bytes(limit, self.headroom, None))
            fixed = line.fixed if line is not None else fixed
            if size == whole:  # no way runs fewer than one micro-batch
                break
            if counting == [way] and (flat := self._flat(probes, size, whole)) is not None:
                break  # its micro-steps' seconds grow with their samples alone: no later way can be faster
        if not counting:  # the blocks stay recomputed: the least memory
            self.recompute = None
            measured = [p for _, way_probes in found.values() for p in way_probes]
            raise MicroBatchOOMError(
                f"AutoAccumulation(max_memory={self.max_memory!r}, headroom={self.headroom}) found no training "
                f"micro-batch size that fits, with or without recomputing every block."
                f"{self._smallest_fit(measured, floor)}\n{checklist(self.done)}"
            )
        kept = found["keep"][1] if "keep" in found else []
        if len(counting) == 1:
            (way,) = counting
            size, way_probes = found[way]
            if size == whole and way == ways[0]:
                why = f"the whole batch of {whole} fits {said[way]}"
            else:
                before = [
                    f"not one sample fits {said[w]}{self._none_fits(found[w][1], limit)}"
                    for w in ways[: ways.index(way)]
                ]
                after = [named[w] for w in found if ways.index(w) > ways.index(way)]
                verb = "runs" if len(after) == 1 else "run"
                later = [f"{' and '.join(after)} {verb} the step in no fewer micro-batches"] if after else []
                if flat is not None:
                    count, runs = _split(size, whole)
                    later = [f"{count} micro-batches of {runs} {said[way]}: {flat[0]}"]
                why = "; ".join(before + later)
            seconds = flat[1] if flat is not None else None
            return self._decided(way, size, way_probes, why, seconds, kept=kept if way == "full" else ())
        # Several count: they take turns at the fit's next optimizer steps, each timed (the trial), then the
        # fastest runs (_next_way).
        self._trial = _Trial(counting, {w: found[w] for w in counting}, kept)
        return self._try(self._trial.turns[0])

    def _flat(self, probes: Probes, size: int, whole: int) -> tuple[str, float] | None:
        """:func:`_fewer_cannot_pay` over the way's timed probes but its search's first, which pays first-time
        costs, each of the two sizes the line is drawn through (:func:`_chord`) timed once more, now warm,
        and counted at its faster run: a busy moment of the device or a shape's first run that slows one
        of them moves the line's intercept, which decides whether the later ways are tried (on an H200
        the same 1-sample micro-step read 0.148 s in one fit and 0.159 in another: 1.9% against 5.7% to
        save, and a trial of two ways that both lost). Every rank runs them (the seconds: the longest)."""
        if not self._timed:
            return None
        (first, _), timed = self._timed[0], self._timed[1:]
        runs: dict[int, list[float]] = {}
        for samples, seconds in timed:
            runs.setdefault(samples, []).append(seconds)
        chord = _chord([first, *runs])
        if chord is None:
            return None
        for samples in chord:
            _, seconds = _agreed_probe(probes, samples, False)
            if seconds is not None:
                runs.setdefault(samples, []).append(seconds)
        return _fewer_cannot_pay([(n, min(s)) for n, s in runs.items()], size, whole)

    @property
    def planning(self) -> bool:
        """Whether the step about to run is the trial's planning turn: its first step, where recompute is a
        way, every block recomputed while ``AutoCheckpoint`` measures the step for its plan."""
        return self._trial is not None and self._trial.turn == self._trial.planning_turn

    @property
    def timing(self) -> bool:
        """Whether the step about to run is a trial step: the engine times its micro-steps and hands their
        seconds to :meth:`succeeded`."""
        return self._trial is not None

    def _try(self, way: str) -> int:
        """Run ``way`` for the next optimizer step of the trial; its size. Recompute runs as it will if it
        wins: the least recompute that fits its micro-batch (planned at its first turn)."""
        assert self._trial is not None and self.recompute is not None
        size, self.probes = self._trial.found[way]
        if way == "full":
            self.recompute.try_plan(_peak_at(self._trial.kept))
        else:
            self.recompute.use(way)
        return size

    def _next_way(self, probes: Probes) -> None:
        """Before a step of the trial: where the step before ran the turn (its seconds measured), the next
        turn's way runs now, or, every turn timed, the fastest way (each way's fastest step, each step the
        longest over ranks: every rank takes it; a later way only where it saves more than :data:`_GAIN`)
        from now on, unless the spread of the ways' steps leaves that open (:meth:`_fastest`): then the
        ways take their turns once more, up to :data:`_MORE_ROUNDS` times (where ways are that close, the
        slower one's extra steps cost little); else the turn goes on (its way applied again in a run
        resumed from a checkpoint)."""
        trial = self._trial
        assert trial is not None and self._limits is not None
        if any_rank(self._leaving, probes.device):
            # A way ran out of memory at the fewest samples on some rank (a batch longer than the first): it
            # cannot run the fit's batches. The trial ends; its last way, which holds the least (recompute),
            # runs from the retry on, on every rank.
            way, last = trial.turns[trial.turn], trial.ways[-1]
            said = _said(chunked=trial.ways[0] == "own head", planned=True)
            why = f"the trial's step {said[way]} ran out of memory at the fewest samples: {said[last]} from now on"
            self._trial, self._retry, self._leaving = None, None, False
            size, way_probes = trial.found[last]
            self._size_to(
                self._decided(last, size, way_probes, why, kept=trial.kept if last == "full" else ())
            )
            return
        resumed, trial.resumed = trial.resumed, False
        if trial.seconds[trial.turn] is None:
            if resumed:
                self._size_to(self._try(trial.turns[trial.turn]))
            return
        if trial.turn + 1 < len(trial.turns):
            trial.turn += 1
            self._size_to(self._try(trial.turns[trial.turn]))
            return
        # recompute's first turn planned (every block recomputed, measured): its later turns ran the plan.
        # Every turn's seconds, the longest over ranks: every rank decides alike, and adds rounds alike.
        timed = [(i, w) for i, w in enumerate(trial.turns) if i != trial.planning_turn]
        agreed = max_over_ranks_each([int(trial.seconds[i] * 1e9) for i, _ in timed], probes.device)
        steps = {way: sorted(ns / 1e9 for (_, w), ns in zip(timed, agreed) if w == way) for way in trial.ways}
        best, still_open = self._fastest(steps)
        if still_open and trial.rounds < _TRIAL_ROUNDS + _MORE_ROUNDS:
            trial.another_round()
            trial.turn += 1
            self._size_to(self._try(trial.turns[trial.turn]))
            return
        seconds = {way: steps[way][0] for way in trial.ways}
        said, parts = _said(chunked=trial.ways[0] == "own head", planned=True), []
        for i, way in enumerate(trial.ways):
            count, runs = _split(trial.found[way][0], self._limits[2])
            if i == 0:
                parts.append(f"{count} micro-batches of {runs} {said[way]}: {seconds[way]:.3g} s a step")
            else:
                parts.append(f"{count} of {runs} {said[way]}: {seconds[way]:.3g} s")
        size, way_probes = trial.found[best]
        self._trial = None
        kept = trial.kept if best == "full" else ()
        self._size_to(self._decided(best, size, way_probes, "; ".join(parts), seconds[best], kept=kept))

    @staticmethod
    def _fastest(steps: dict[str, list[float]]) -> tuple[str, bool]:
        """The way that runs (each way at its fastest step; a later way, which changes more, only where it
        saves more than :data:`_GAIN` of the step of the way chosen before it), and whether the steps'
        spread leaves that open: a way's spread is how much its second-fastest step took beyond its
        fastest (at most :data:`_SPREAD`: more is a first step's one-time cost, such as the chunked head's
        compile, not noise), and where a later way's saving lies within the larger spread of the two of the
        :data:`_GAIN` bar, the same steps again could have chosen the other (on a shared 2-core CPU the
        ViT of ``benchmarks/fastest_step.py`` read recompute 5% faster in its trial and ran 6% slower).

        Example::

            >>> MicroBatchSizes._fastest({"keep": [1.0, 1.01], "full": [0.9, 0.91]})  # 10% saved, spread 1%
            ('full', False)
            >>> MicroBatchSizes._fastest({"keep": [1.0, 1.08], "full": [0.95, 1.0]})  # 5%, spread 8%
            ('full', True)
        """
        spread = {
            w: min((s[1] - s[0]) / s[0], _SPREAD) if len(s) > 1 and s[0] > 0 else 0.0
            for w, s in steps.items()
        }
        ways = list(steps)
        best, still_open = ways[0], False
        for way in ways[1:]:
            saved = 1 - steps[way][0] / steps[best][0]
            still_open = still_open or abs(saved - _GAIN) <= max(spread[way], spread[best])
            if saved > _GAIN:
                best = way
        return best, still_open

    def _decided(self, way, size, probes, why: str, seconds: float | None = None, kept=()) -> int:
        """``kept``: where recompute won over plain micro-batches that fit, the plain search's probes."""
        recompute, self.recompute = self.recompute, None  # decided once: nothing stays attached
        assert recompute is not None
        self.probes, self.step_seconds = probes, seconds
        recompute.decided(way, why, _peak_at(kept))
        return size

    def _find(
        self,
        probes: Probes,
        whole: int,
        limit: int,
        floor: int,
        *,
        evaluation: bool,
        start: int | None = None,
        fixed: float | None = None,
    ) -> int:
        log = self.eval_probes if evaluation else self.probes

        def probe(samples: int) -> int | None:
            peak, seconds = _agreed_probe(probes, samples, evaluation)
            log.append((samples, peak))
            if not evaluation and seconds is not None:
                self._timed.append((samples, seconds))
            return peak

        try:
            result = find_micro_batch_size(
                probe,
                max_size=whole,
                capacity=limit,
                headroom=self.headroom,
                min_size=min(floor, whole),
                max_probes=self.max_probes,
                # evaluation keeps no activations: the whole batch first; training from start (None: 1)
                start=whole if evaluation else start,
                fixed=fixed,
                split=True,  # only the sizes that run the batch in fewer micro-batches
            )
        except NoSizeFits as error:
            advice = f"{BATCHNORM_ADVICE}\n" if floor > 1 else ""
            raise MicroBatchOOMError(
                f"AutoAccumulation(max_memory={self.max_memory!r}, headroom={self.headroom}) found no "
                f"{'evaluation' if evaluation else 'training'} micro-batch size that fits: {error}."
                f"{self._smallest_fit(log, min(floor, whole))}\n{advice}{checklist(self.done)}"
            ) from None
        return min_over_ranks(int(result.size), probes.device)

    def _none_fits(self, probes: list[tuple[int, int | None]], limit: int) -> str:
        """Why a way fitted no micro-batch, for the decision's line: what its smallest probe measured against
        the usable bytes, the headroom named (the step may fit ``max_memory`` itself)."""
        least = min(size for size, _ in probes)
        peak = _least_peak(probes, least)
        if peak is None:
            return f" ({counted(least, 'sample')} ran out of memory)"
        usable = format_bytes(usable_bytes(limit, self.headroom, None))
        if self.headroom:
            usable = f"the {usable} that max_memory less its {self.headroom:.0%} headroom leaves"
        return f" ({counted(least, 'sample')} peaked at {format_bytes(peak)}, over {usable})"

    def _smallest_fit(self, probes: list[tuple[int, int | None]], floor: int) -> str:
        """The smallest limit that fits, named from the least peak the probes measured at ``floor``
        samples (nothing where each of those ran out of memory: no peak was measured)."""
        peak = _least_peak(probes, floor)
        if peak is None:
            return ""
        needed = math.ceil(peak / (1 - self.headroom))
        while usable_bytes(needed, self.headroom, None) < peak:  # the float product's rounding
            needed += 1
        return (
            f" The least it measured, {counted(floor, 'sample')} a micro-batch, peaked at "
            f"{format_bytes(peak)}: max_memory={needed} ({format_bytes(needed)}) or more fits it."
        )

    def peek(self, *, total: int, width: int, held: int) -> int:
        """The samples per micro-batch :meth:`plan` would give this batch from what is known now: no probe,
        no collective, nothing changed (``AutoCheckpoint`` keys its plans by it)."""
        if self.model is not None:
            return min(self.model.samples_for(width, held=held), total)
        if self.tokens is None:
            return total
        per = 1 if (self.width is None or is_distributed()) else width  # the unit tokens is in
        return min(max(1, self.tokens // per), total)

    # ------------------------------------------------------------------ after each attempt
    def failed(self, size: int, *, total: int, floor: int, failure: str | None) -> None:
        """An attempt at ``size`` samples per micro-batch ran out of memory: the retry runs at half of it (at
        the floor during the trial, with the trial's way that holds the least: :meth:`_next_way`; at the
        floor after the search decided against recompute, at the same size recomputing, where
        :attr:`fallback` can).

        Raises:
            MicroBatchOOMError: If ``size`` is already the floor (1 sample; 2 with BatchNorm in training).
        """
        self.oom_retries += 1
        self.clean_steps = self.stable_steps = 0
        if (
            size <= floor
            and self._trial is not None
            and self._trial.turns[self._trial.turn] != self._trial.ways[-1]
        ):
            self._leaving = True  # the trial ends before the retry, on every rank alike (_next_way)
            return
        if size <= floor and self._recompute_instead(size, total):
            self._retry = size  # the same micro-batch again, recomputing (every rank took this path)
            return
        self._record_failure(size)
        if size <= 1:
            raise MicroBatchOOMError(
                "out of memory with one sample per micro-batch; splitting the batch further cannot help.\n"
                f"{failure}\n{checklist(self.done)}"
            )
        if size <= floor:
            raise MicroBatchOOMError(
                f"out of memory with {size} samples per micro-batch, the fewest a model with BatchNorm layers in "
                f"training mode can run. {BATCHNORM_ADVICE}\n{failure}\n{checklist(self.done)}"
            )
        self._halve(size, total, floor)

    def _recompute_instead(self, size: int, total: int) -> bool:
        """``size`` samples, the fewest a micro-batch holds, ran out of memory after the search decided
        against recompute: the blocks recompute from now on (:attr:`fallback`; every rank calls this
        alike); whether they do."""
        if self._trial is not None or self.fallback is None:
            return False
        tokens = f" ({self.width} tokens a sample)" if self.width and self.width > 1 else ""
        return self.fallback.fall_back(
            f"{counted(size, 'sample')} of a batch of {total} ran out of memory with every block kept{tokens}"
        )

    def near_miss(self, size: int, *, total: int, floor: int) -> bool:
        """A step at ``size`` trained while the allocator thrashed: lower the size as :meth:`failed` would,
        without counting a retry and without an error at the floor. False at the floor (size kept)."""
        self._record_failure(size)
        if size <= floor:
            return False
        self._halve(size, total, floor)
        self._retry = None  # nothing is retried: the next steps run at the model's lowered prediction
        self.clean_steps = self.stable_steps = 0
        return True

    def _record_failure(self, size: int) -> None:
        failed = size * (self.width or 1)  # in tokens: a shorter batch may run more samples
        self.failed_tokens = min(self.failed_tokens or failed, failed)

    def _halve(self, size: int, total: int, floor: int) -> None:
        half = max(math.ceil(size / 2), floor)
        if self.model is not None:  # this width's prediction drops below size; the retry runs at half
            self.model.missed(width=self.width or 1, samples=size)
            self._retry = half
            return
        if self.max_tokens is None:
            self._set("max_tokens", self.samples("tokens") or total)
        self._set("tokens", half)

    def succeeded(
        self, *, retried: bool, total: int, size: int | None = None, seconds: float | None = None
    ) -> None:
        """A step trained at ``size`` samples per micro-batch (``retried``: after backing off); grow when
        ``grow_after`` clean steps say so. ``seconds``: what a trial step measured (:attr:`timing`)."""
        if self._trial is not None and seconds is not None and self._limits is not None:
            # Priced as the search's batch: the first batch's samples and tokens a sample (batches of other
            # lengths or sizes cost in proportion to their tokens), so that the ways compare alike.
            tokens = total * (self.width or 1)
            self._trial.seconds[self._trial.turn] = (
                seconds * self._limits[2] * (self.probed_width or 1) / tokens
            )
        self.last_total, self.ran = total, size
        self.stable_steps += 1
        self._retry = None
        if retried or self.model is not None:
            return
        self.clean_steps += 1
        size = self.samples("tokens")
        if self.grow_after is None or self.clean_steps < self.grow_after or size is None:
            return
        cap = min(self.samples("max_tokens") or total, total)
        if self.failed_tokens is not None:  # smaller than the smallest failure, at this width
            cap = min(cap, (self.failed_tokens - 1) // (self.width or 1))
        if min(size * 2, cap) > size:
            self._set("tokens", min(size * 2, cap))
            self.stable_steps = 0  # a new size is unsettled again
        self.clean_steps = 0

    # ------------------------------------------------------------------ evaluation
    def halve_eval(self, size: int, *, hook: str, failure: str | None) -> None:
        """An evaluation step at ``size`` ran out of memory: the retry runs at half (no floor).

        Raises:
            MicroBatchOOMError: If ``size`` is one sample.
        """
        if size <= 1:
            raise MicroBatchOOMError(
                f"out of memory in {hook} with one sample per micro-batch.\n{failure or 'on another rank'}\n{checklist(self.done)}"
            )
        self.eval_oom_retries += 1
        self.eval_size = math.ceil(size / 2)

    # ------------------------------------------------------------------ checkpoints
    _SAVED = (
        "tokens",
        "max_tokens",
        "failed_tokens",
        "width",
        "eval_size",
        "probed",
        "probed_width",
        "oom_retries",
        "near_misses",
        "clean_steps",
        "stable_steps",
    )

    def state(self) -> dict[str, Any]:
        """Everything a resumed fit needs to size exactly as the uninterrupted one, as plain values."""
        state = {name: getattr(self, name) for name in self._SAVED}
        state["model"] = None if self.model is None else self.model.state()
        if self._trial is not None:  # a resumed run goes on with the trial where this one was
            state["trial"] = self._trial.state()
            state["limits"] = list(self._limits or ())
        return state

    def load(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` saved."""
        for name in self._SAVED:
            if name in state:
                setattr(self, name, state[name])
        if state.get("model") is not None:
            self.model = ShapeModel.from_state(state["model"])
        if state.get("trial") is not None:
            self._trial, self._limits = _Trial.from_state(state["trial"]), tuple(state["limits"])
            self._trial.resumed = True


@dataclass
class _Trial:
    """The first batch's ways that count, taking turns at the fit's optimizer steps, each step timed."""

    ways: list[str]
    """In the order they run (cheapest per sample first)."""
    found: dict[str, tuple[int, list[tuple[int, int | None]]]]
    """Each way's largest micro-batch that fits, and the search's probes of it."""
    kept: list[tuple[int, int | None]]
    """The probes with every block kept (AutoCheckpoint's plan holds their transient, where full wins)."""
    rounds: int = _TRIAL_ROUNDS
    """How many times the ways take their turns (:data:`_TRIAL_ROUNDS`, more where the spread of their
    steps leaves the decision open: :meth:`MicroBatchSizes._fastest`)."""
    turns: list[str] = field(init=False)
    """The way of each trial step: recompute first where it is a way (that turn makes its plan), then the
    ways in turn, :attr:`rounds` times."""
    seconds: list[float | None] = field(init=False)
    """Each turn's step seconds as measured on this rank (None until its step has trained)."""
    turn: int = 0
    """The turn whose step runs now (or next)."""
    resumed: bool = False
    """Restored from a checkpoint: the way is applied again at the next step."""

    def __post_init__(self) -> None:
        # Recompute's first turn makes its plan (one turn more, so that the plan runs as often as each way),
        # first: the fit's first step, slowed by the search's probes just before, prices no way, and each
        # way's turns come one after the plan's profile and one later.
        self.turns = [w for w in self.ways if w == "full"] + self.ways * self.rounds
        self.seconds = [None] * len(self.turns)

    def another_round(self) -> None:
        """The ways take their turns once more."""
        self.rounds += 1
        self.turns += self.ways
        self.seconds += [None] * len(self.ways)

    @property
    def planning_turn(self) -> int | None:
        """The turn that makes recompute's plan (the first), None where recompute is not a way."""
        return 0 if self.turns[0] == "full" else None

    def state(self) -> dict[str, Any]:
        """As plain values, for a checkpoint (:meth:`from_state`)."""
        found = {way: [size, [list(p) for p in probes]] for way, (size, probes) in self.found.items()}
        kept = [list(p) for p in self.kept]
        return {
            "ways": self.ways,
            "found": found,
            "kept": kept,
            "rounds": self.rounds,
            "seconds": self.seconds,
            "turn": self.turn,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> _Trial:
        found = {way: (size, [tuple(p) for p in probes]) for way, (size, probes) in state["found"].items()}
        trial = cls(list(state["ways"]), found, [tuple(p) for p in state["kept"]], rounds=state["rounds"])
        trial.seconds, trial.turn = list(state["seconds"]), state["turn"]
        return trial


def _said(*, chunked: bool, planned: bool = False) -> dict[str, str]:
    """How the decision's one line names each way (``planned``: recompute as the trial ran it, its plan)."""
    return {
        "own head": "with the model's own head",
        "keep": "with the chunked head, without recompute" if chunked else "without recompute",
        "full": "with the least recompute that fits them" if planned else "recomputing every block",
    }


def _agreed_probe(probes: Probes, samples: int, evaluation: bool) -> tuple[int | None, float | None]:
    """One probe on every rank: the largest peak over ranks (None if any ran out of memory), and the longest
    seconds (None unless every rank timed it: on a CPU probes run tracked, untimed)."""
    peak = probes.peak(samples, evaluation)
    seconds = probes.seconds if peak is not None else None
    agreed, untimed, nanoseconds = max_over_ranks_each(
        [_FAILED if peak is None else peak, int(seconds is None), round((seconds or 0.0) * 1e9)],
        probes.device,
    )
    return None if agreed == _FAILED else agreed, None if untimed else nanoseconds / 1e9


def _split(size: int, whole: int) -> tuple[int, int]:
    """The micro-batches a step of ``whole`` samples runs as at ``size``, and the largest of them (an even
    split: 4 of 12 where 15 fit a batch of 48)."""
    return -(-whole // size), largest_micro_batch(whole, size)


def _fewer_cannot_pay(timed: list[tuple[int, float]], size: int, whole: int) -> tuple[str, float] | None:
    """Where a way's timed probes show that its micro-steps' seconds grow with their samples alone, so that
    fewer, larger micro-batches (a later way's: the chunked head, recompute) could make the step at most
    :data:`_GAIN` faster: why, in words, and the step's seconds predicted (its micro-steps' together, as
    the trial prices a step); else None (they could, or too few probes to tell).

    ``timed``: the way's probes that ran (not out of memory), samples and seconds, but the first of its
    search, which pays first-time costs (:meth:`MicroBatchSizes._flat`). The line through the largest and
    the largest at most half its size: its intercept is what a micro-step costs whatever its samples, and a
    step of ``whole`` samples in ``count`` micro-batches of at most ``size`` costs ``count`` intercepts and
    ``whole`` slopes; the fewest micro-batches, one, save ``count - 1`` intercepts at most. Where a
    micro-step's seconds bend (a device that is not yet busy at small sizes), the chord's intercept is the
    larger: the later ways are tried.

    Example::

        >>> why, seconds = _fewer_cannot_pay([(2, 0.21), (4, 0.41), (8, 0.81)], 8, 32)  # 3 x 0.01 s of 3.24 s
        >>> why, round(seconds, 6)
        ('fewer, larger micro-batches would save at most 0.9% of the step (a micro-step: 0.41 s at 4 samples, 0.81 s at 8)', 3.24)
        >>> _fewer_cannot_pay([(2, 0.3), (4, 0.5), (8, 0.9)], 8, 32) is None  # 3 x 0.1 s of 3.6 s
        True
    """
    seconds = dict(timed)
    chord = _chord(seconds)
    if chord is None:
        return None
    low, high = chord
    slope = (seconds[high] - seconds[low]) / (high - low)
    intercept = seconds[low] - slope * low
    count = _split(size, whole)[0]
    step = count * intercept + slope * whole
    if slope <= 0 or step <= 0:
        return None
    saved = (count - 1) * max(intercept, 0.0) / step
    if saved > _GAIN:
        return None
    why = (
        f"fewer, larger micro-batches would save at most {saved:.1%} of the step (a micro-step: "
        f"{seconds[low]:.3g} s at {counted(low, 'sample')}, {seconds[high]:.3g} s at {high})"
    )
    return why, step


def _chord(sizes: Iterable[int]) -> tuple[int, int] | None:
    """The two sizes a micro-step's seconds are drawn through (:func:`_fewer_cannot_pay`): the largest at
    most half the largest, and the largest; None where no size is at most half the largest."""
    sizes = list(sizes)
    high = max(sizes, default=0)
    lows = [n for n in sizes if n <= high / 2]
    return (max(lows), high) if lows else None


def _peak_at(probes: list[tuple[int, int | None]]) -> Callable[[int], float] | None:
    """A micro-step's peak bytes at any size from the sizes probed: the measured peak where that size was
    probed, else the line through the two probed sizes nearest it (None with fewer than two peaks)."""
    measured = dict(sorted((s, p) for s, p in probes if p is not None))
    if len(measured) < 2:
        return None

    def peak(samples: int) -> float:
        if samples in measured:
            return measured[samples]
        a, b = sorted(measured, key=lambda s: (abs(s - samples), s))[:2]
        return MemoryModel.through((a, measured[a]), (b, measured[b])).predict(samples)

    return peak


def _least_peak(probes: list[tuple[int, int | None]], size: int) -> int | None:
    """The least peak the probes of ``size`` samples measured (None: each ran out of memory)."""
    peaks = [peak for samples, peak in probes if samples == size and peak is not None]
    return min(peaks) if peaks else None
