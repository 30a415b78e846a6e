"""Peak memory of a training step, phase by phase: the plain-torch core of ``MemoryMonitor``.

A :class:`PhaseRecorder` measures one device for one run. The caller cuts the work into *windows*: each
:meth:`~PhaseRecorder.start` or :meth:`~PhaseRecorder.switch` opens a new peak window for a phase of a
record (see :mod:`lightning_memopt.memory.report`), and the window's peak, with the bytes by category at
that peak, is folded into the record when the next one opens or at :meth:`~PhaseRecorder.stop`. A phase
opened several times in one record keeps its largest peak (a validation run's batches; several
``backward`` calls in manual optimization).

Where the numbers come from is decided once, from the device and the ``breakdown`` mode:

- any device but CUDA: a :class:`~lightning_memopt.memory.MemoryTracker`, entered only while a window is
  open (exact live tensor bytes, with the breakdown; a Python call per tensor op);
- CUDA: the caching allocator's peak (free; ``reset_peak_memory_stats`` at each window, which other
  readers of that peak see too), and the breakdown only with ``"always"``, from a tracker run alongside.

:class:`StepPeaks` keeps a run's records, as training and validation steps open and close them, and
times each training step and the output heads in it where it is given heads
(:class:`~lightning_memopt.memory.head_time.HeadTimer`: the times are read into the records at each
:meth:`~StepPeaks.take_window`, every :data:`UNREAD` steps, and at :meth:`~StepPeaks.read_times`);
:func:`record_metrics` and :func:`merge_across_ranks` turn records into the
logged values. Nothing here imports Lightning.

Work that runs a phase where the loop's hooks cannot see it (micro-batching runs every micro-batch's
backward inside ``training_step``) says so with :func:`running`: every :class:`StepPeaks` measuring a
training step then files that work under its phase, and returns to the phase it was in after.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, get_args

import torch

from lightning_memopt._checks import check_positive_int
from lightning_memopt.memory.device import DeviceMemory, TrackedMemory, device_memory
from lightning_memopt.memory.head_time import HeadTimer
from lightning_memopt.memory.report import (
    HEAD,
    PHASES,
    TIMES,
    MemoryHistory,
    empty_record,
    fold_peak,
    merge_records,
    peak_phase,
)
from lightning_memopt.memory.tracker import CATEGORIES, MemoryTracker

__all__ = [
    "BREAKDOWN_MODES",
    "Breakdown",
    "PhaseRecorder",
    "StepPeaks",
    "check_breakdown",
    "merge_across_ranks",
    "record_metrics",
    "running",
]

UNREAD = 64
"""Steps whose times may wait in :class:`StepPeaks` to be read (on CUDA each read waits for the device)."""

Breakdown = Literal["auto", "always", "never"]
"""``"auto"``: bytes by category wherever the tracker runs anyway (not on CUDA); ``"always"``: on CUDA
too, by running the tracker there as well; ``"never"``: only peaks."""
BREAKDOWN_MODES: tuple[str, ...] = get_args(Breakdown)
_GIB = 2**30
# The StepPeaks between begin() and end(), which running() tells; weak: a run that never called end()
# (a failed fit) must not be kept alive by this registry.
_MEASURING: weakref.WeakSet[StepPeaks] = weakref.WeakSet()


@contextlib.contextmanager
def running(phase: str) -> Iterator[None]:
    """File the work inside the ``with`` under ``phase`` in every training step being measured, then go
    back to the phase each was in (also when the work raises).

    For work that the hooks cutting a step into phases cannot see: micro-batching runs each micro-batch's
    ``backward`` inside ``training_step``, which the hooks see as ``forward``. Outside a measured step
    this does nothing.

    Example::

        >>> model = torch.nn.Linear(4, 4)
        >>> peaks = StepPeaks()
        >>> peaks.begin("cpu", model, [])
        >>> peaks.step_start()
        >>> loss = model(torch.ones(2, 4)).sum()
        >>> with running("backward"):
        ...     loss.backward()
        >>> peaks.step_end(); peaks.end()
        True
        >>> record = peaks.train[-1]
        >>> record["forward"], record["backward"], record["backward_gradients"]
        (164, 200, 80)
    """
    entered = [(peaks, peaks.enter(phase)) for peaks in list(_MEASURING) if peaks.in_step]
    try:
        yield
    finally:
        for peaks, previous in entered:
            peaks.phase(previous)


def check_breakdown(breakdown: object) -> None:
    """Raise ``ValueError`` unless ``breakdown`` is one of :data:`BREAKDOWN_MODES`."""
    if breakdown not in BREAKDOWN_MODES:
        raise ValueError(f"breakdown must be one of {BREAKDOWN_MODES}, got {breakdown!r}")


class PhaseRecorder:
    """Fold the peak bytes of successive windows into the phases of records, on one device.

    Args:
        device: The device the work runs on.
        module: The model (its parameters and buffers are the ``parameters`` category).
        optimizers: Its optimizers (their state is ``optimizer_state``).
        breakdown: One of :data:`BREAKDOWN_MODES` (see :data:`Breakdown`).
        heads: The model's output heads (:class:`~lightning_memopt.memory.MemoryTracker`'s ``heads``);
            with a breakdown and at least one, records also carry the head's bytes at each phase's peak
            (``<phase>_head``).

    Raises:
        ValueError: If ``breakdown`` is not one of :data:`BREAKDOWN_MODES`.

    Example::

        >>> model = torch.nn.Linear(4, 4)
        >>> recorder = PhaseRecorder("cpu", model, [])
        >>> record = recorder.new_record(step=0)
        >>> recorder.start(record, "forward")
        >>> out = model(torch.ones(2, 4))
        >>> recorder.switch("backward")
        >>> recorder.stop()
        >>> record["forward_parameters"], record["backward"]
        (80, 144)
    """

    def __init__(
        self,
        device: torch.device | str,
        module: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        breakdown: Breakdown = "auto",
        heads: Sequence[torch.nn.Module] = (),
    ) -> None:
        check_breakdown(breakdown)
        cuda = torch.device(device).type == "cuda"
        self.with_breakdown = breakdown == "always" or (breakdown == "auto" and not cuda)
        """Whether records carry the bytes of each category at each phase's peak."""
        self.with_head = self.with_breakdown and bool(heads)
        """Whether records carry the output head's bytes at each phase's peak (``<phase>_head``)."""
        tracked = not cuda or self.with_breakdown
        self.tracker = MemoryTracker(module, list(optimizers), heads=list(heads)) if tracked else None
        """The tracker, where one runs (None on CUDA without a breakdown)."""
        self.memory: DeviceMemory = device_memory(device, tracker=self.tracker)
        """Where the peaks come from."""
        self._inside = False  # whether the tracker is entered
        self._open: tuple[dict[str, int], str] | None = None  # (record, phase) of the open window

    @property
    def phase(self) -> str | None:
        """The phase of the open window (None: none is open)."""
        return None if self._open is None else self._open[1]

    @property
    def source(self) -> str:
        """What the peaks are: ``"live tensor bytes"`` (a tracker) or ``"CUDA allocator"``."""
        return "live tensor bytes" if isinstance(self.memory, TrackedMemory) else "CUDA allocator"

    def new_record(self, step: int, phases: Sequence[str] = PHASES, *, timed: bool = False) -> dict[str, int]:
        """An empty record for ``step``, with a breakdown where this recorder measures one (and with
        ``timed``, :data:`~lightning_memopt.memory.report.TIMES`)."""
        return empty_record(step, phases, breakdown=self.with_breakdown, head=self.with_head, timed=timed)

    def start(self, record: dict[str, int], phase: str) -> None:
        """Open a window for ``record[phase]``; a window still open (its step never ended) is dropped."""
        self.discard()
        if self.tracker is not None:
            self.tracker.__enter__()
            self._inside = True
        self._reset_peak()
        self._open = (record, phase)

    def switch(self, phase: str) -> None:
        """Fold the open window into its phase and open one for ``phase`` of the same record.

        Raises:
            RuntimeError: If no window is open.
        """
        if self._open is None:
            raise RuntimeError(f"switch({phase!r}) needs an open window; call start(record, phase) first")
        record = self._fold()
        self._reset_peak()
        self._open = (record, phase)

    def stop(self) -> None:
        """Fold the open window, if any, into its phase and stop measuring."""
        if self._open is not None:
            self._fold()
        self.discard()

    def discard(self) -> None:
        """Stop measuring without folding (also at the end of a run, finished or failed: safe twice)."""
        self._open = None
        if self._inside:
            self._inside = False
            self.tracker.__exit__(None, None, None)

    def _reset_peak(self) -> None:
        self.memory.reset_peak()
        if self.tracker is not None and not isinstance(self.memory, TrackedMemory):
            self.tracker.reset_peak()  # the allocator gives the peaks; the tracker only the breakdown

    def _fold(self) -> dict[str, int]:
        record, phase = self._open
        breakdown = self.tracker.peak_figures if self.with_breakdown else None
        fold_peak(record, phase, self.memory.peak(), breakdown)
        return record


class StepPeaks:
    """A run's records of training steps and validation runs, and the one being measured.

    Each method stands for a moment of the loop (a ``MemoryMonitor`` hook); between :meth:`begin` and
    :meth:`end` the :class:`PhaseRecorder` measures, outside them every moment is ignored.

    Args:
        max_history: How many records to keep of each kind (see :class:`MemoryHistory`).
        breakdown: Passed to each run's :class:`PhaseRecorder` (see :data:`Breakdown`).

    Raises:
        ValueError: If ``max_history`` is not an int >= 2, or ``breakdown`` not one of
            :data:`BREAKDOWN_MODES`.

    Example::

        >>> model = torch.nn.Linear(4, 4)
        >>> peaks = StepPeaks()
        >>> peaks.begin("cpu", model, [])
        >>> peaks.step_start(); out = model(torch.ones(2, 4)); peaks.phase("backward")
        >>> peaks.step_end()
        True
        >>> peaks.end(); [(r["step"], r["forward"]) for r in peaks.train]
        [(0, 144)]
    """

    def __init__(self, max_history: int = 2048, *, breakdown: Breakdown = "auto") -> None:
        check_positive_int("max_history", max_history, minimum=2)
        check_breakdown(breakdown)
        self.breakdown = breakdown
        self.train = MemoryHistory(max_history)
        """One record per training step, phases :data:`~lightning_memopt.memory.report.PHASES`."""
        self.validation = MemoryHistory(max_history)
        """One record per validation run, phase ``validation``."""
        self.steps = 0
        """Training steps recorded, resumed runs' included (the ``step`` of the next record)."""
        self.recorder: PhaseRecorder | None = None
        self.timer: HeadTimer | None = None
        """Times each training step and the output heads in it, where :meth:`begin` was given heads."""
        self._record: dict[str, int] | None = None  # the training step being measured
        self._val_record: dict[str, int] | None = None  # the validation run being measured
        self._window: dict[str, int] | None = None  # the steps since the last take_window, merged
        self._untimed: list[dict[str, int]] = []  # records whose times the timer has not given yet

    def begin(
        self,
        device: torch.device | str,
        module: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        heads: Sequence[torch.nn.Module] = (),
    ) -> None:
        """Measure ``module`` and its ``optimizers`` (and output ``heads``) on ``device`` from now on (a
        :class:`PhaseRecorder`), and where there are ``heads``, time each step and its heads."""
        self.end()
        self.recorder = PhaseRecorder(device, module, optimizers, breakdown=self.breakdown, heads=heads)
        self.timer = HeadTimer(device, heads) if heads else None
        _MEASURING.add(self)

    def end(self) -> None:
        """Stop measuring and drop the recorder (the model); the records stay. Safe twice."""
        _MEASURING.discard(self)
        if self.recorder is not None:
            self.recorder.discard()
        if self.timer is not None:
            # A run that failed on the device (a device-side assert) cannot be waited for: its last
            # steps keep no time, and the failure that ended it is the one raised.
            with contextlib.suppress(RuntimeError):
                self.read_times()
            self.timer.stop()
        self._untimed = []
        self.recorder = self.timer = self._record = self._val_record = self._window = None

    def step_start(self) -> None:
        """A training step starts, in ``forward``; a step left open (it never ended) is dropped."""
        if self.recorder is not None:
            self._record = self.recorder.new_record(self.steps, timed=self.timer is not None)
            self.recorder.start(self._record, PHASES[0])
            if self.timer is not None:
                self.timer.step_start()

    @property
    def in_step(self) -> bool:
        """Whether a training step is being measured (between :meth:`step_start` and its end)."""
        return self._record is not None and self.recorder.phase is not None

    def phase(self, name: str) -> None:
        """The open training step enters phase ``name``."""
        if self._record is not None:
            self.recorder.switch(name)

    def enter(self, name: str) -> str:
        """The open training step enters phase ``name``; returns the phase it was in (see :func:`running`).

        Raises:
            RuntimeError: If no training step is being measured.
        """
        if not self.in_step:
            raise RuntimeError(f"enter({name!r}) needs a training step being measured; call step_start first")
        previous = self.recorder.phase
        self.recorder.switch(name)
        return previous

    def step_end(self) -> bool:
        """Close the open training step into :attr:`train`; False if none was open."""
        if self._record is None:
            return False
        self.recorder.stop()
        record, self._record = self._record, None
        self._window = dict(record) if self._window is None else merge_records([self._window, record])
        if self.timer is not None:
            self.timer.step_end()
            self._untimed.append(record)
            if len(self._untimed) >= UNREAD or len(self.train) >= self.train.max_records:
                self.read_times()  # before the history merges records: a merged one is another dict
        self.train.append(record)
        self.steps += 1
        return True

    def read_times(self) -> None:
        """Read the times of the steps ended since the last read into their records (:data:`TIMES`; on CUDA
        one wait for the device). Nothing where steps are not timed."""
        if self.timer is None or not self._untimed:
            return
        for record, times in zip(self._untimed, self.timer.read(), strict=True):
            for key, seconds in zip(TIMES, times):
                record[key] = round(seconds * 1e6)
                self._window[key] += record[key]  # every unread step has joined the open window
        self._untimed = []

    def drop_step(self) -> None:
        """Forget an open training step (one skipped before its end)."""
        if self.recorder is not None:
            self.recorder.discard()
        if self.timer is not None:
            self.timer.drop()
        self._record = None

    def take_window(self) -> dict[str, int]:
        """The steps since the last call, merged (their largest peaks), and start a new window.

        Raises:
            RuntimeError: If no step ended since the last call.
        """
        if self._window is None:
            raise RuntimeError("take_window needs a step ended since the last call; call step_end first")
        self.read_times()
        window, self._window = self._window, None
        return window

    def validation_start(self) -> None:
        """A validation run starts: its batches' peaks fold into one record."""
        if self.recorder is not None:
            self._val_record = self.recorder.new_record(self.steps, ("validation",))

    def validation_batch_start(self) -> None:
        if self._val_record is not None:
            self.recorder.start(self._val_record, "validation")

    def validation_batch_end(self) -> None:
        if self._val_record is not None:
            self.recorder.stop()

    def validation_end(self) -> dict[str, int] | None:
        """Close the validation run into :attr:`validation` and return its record (None if none ran)."""
        if self._val_record is None:
            return None
        self.recorder.discard()
        record, self._val_record = self._val_record, None
        self.validation.append(record)
        return record

    def state_dict(self) -> dict:
        """Plain ints and lists: a resumed run continues the step count and the records."""
        self.read_times()
        return {"batches": self.steps, "history": list(self.train), "val_history": list(self.validation)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps = int(state_dict["batches"])
        self.train.records = [dict(r) for r in state_dict["history"]]
        self.validation.records = [dict(r) for r in state_dict["val_history"]]


def record_metrics(record: dict[str, int]) -> dict[str, float]:
    """The ``memory/*`` keys of a record, in GiB (``bytes / 2**30``).

    A validation record gives ``memory/val_peak_gib``. A training record (or several merged) gives the
    peak of each phase, ``memory/peak_gib`` (the largest phase) and, with a breakdown, the bytes of each
    category at that peak, ``memory/peak_<category>_gib`` (they sum to ``memory/peak_gib``), and where
    the record has them, the output head's bytes at that peak, ``memory/peak_head_gib`` (a part of
    ``activations`` and ``other``); a timed record, the seconds of a step and of the output heads in it,
    ``memory/step_seconds`` and ``memory/head_seconds`` (means over the steps it covers).
    """
    if "validation" in record:
        return {"memory/val_peak_gib": record["validation"] / _GIB}
    metrics = {f"memory/{phase}_peak_gib": record[phase] / _GIB for phase in PHASES}
    top = peak_phase(record)
    metrics["memory/peak_gib"] = record[top] / _GIB
    if f"{top}_{CATEGORIES[0]}" in record:
        for category in CATEGORIES:
            metrics[f"memory/peak_{category}_gib"] = record[f"{top}_{category}"] / _GIB
    if f"{top}_{HEAD}" in record:
        metrics[f"memory/peak_{HEAD}_gib"] = record[f"{top}_{HEAD}"] / _GIB
    if TIMES[0] in record:
        metrics["memory/step_seconds"] = record["step_us"] / record["steps"] / 1e6
        metrics["memory/head_seconds"] = record["head_us"] / record["steps"] / 1e6
    return metrics


def merge_across_ranks(
    records: Sequence[dict[str, int]],
    all_gather: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device | str,
) -> list[dict[str, int]]:
    """Each record merged with the same record of every other rank, in one ``all_gather``.

    Args:
        records: This rank's records, all with the same keys (the same on every rank).
        all_gather: Takes this rank's ``(len(records), len(keys))`` int64 tensor, returns the
            ``(world_size, len(records), len(keys))`` stack of every rank's (e.g. a Lightning strategy's).
        device: Where the tensor is built (the collective's device).

    Raises:
        ValueError: If ``records`` is empty.
    """
    if not records:
        raise ValueError("merge_across_ranks needs at least one record, got none")
    keys = list(records[0])
    rows = torch.tensor([[r[k] for k in keys] for r in records], dtype=torch.int64, device=device)
    gathered = all_gather(rows).tolist()  # (world, len(records), len(keys))
    return [
        merge_records([dict(zip(keys, rank[i])) for rank in gathered], same_step=True)
        for i in range(len(records))
    ]
