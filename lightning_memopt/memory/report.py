"""Memory reports: per-step records of peak bytes by phase, and the markdown table and plot made from them.

Plain code over plain numbers: nothing here measures anything or imports Lightning. A *record* is a flat
``dict`` of ``int`` describing one training step (or several merged ones)::

    {"step": 12, "steps": 1,
     "forward": 9_437_184, "forward_parameters": ..., "forward_activations": ..., ...,
     "backward": ..., "backward_gradients": ..., ...,
     "optimizer": ..., "optimizer_optimizer_state": ..., ...}

``step`` is the index of the first training batch it covers (0-based), ``steps`` how many batches it
covers, ``<phase>`` the peak bytes in that phase and ``<phase>_<category>`` the bytes of each category of
:data:`~lightning_memopt.memory.CATEGORIES` at that peak (present only when a breakdown was measured).
``<phase>_head``, present only when an output head was tracked, is the part of that peak's
``activations`` and ``other`` that the model's output head created
(:attr:`~lightning_memopt.memory.MemoryTracker.peak_head`): not a category, it is not in the sum.
``step_us`` and ``head_us``, present only when an output head was timed, are the microseconds of the
steps and of the output heads in them (:class:`~lightning_memopt.memory.head_time.HeadTimer`), summed
over the ``steps`` the record covers.
A phase that did not run in a step (no optimizer step while accumulating gradients) has a peak of 0.

:class:`MemoryHistory` keeps such records with bounded memory; :func:`merge_records` combines records
of consecutive steps or of the same step on different ranks; :func:`summary` and :func:`write_report`
turn them into text, ``memory_report.md`` and, when matplotlib is installed, ``memory_report.png``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from lightning_memopt._checks import check_positive_int
from lightning_memopt._text import counted
from lightning_memopt.memory.tracker import CATEGORIES, HEAD

__all__ = [
    "HEAD",
    "PHASES",
    "TIMES",
    "MemoryHistory",
    "check_dirpath",
    "empty_record",
    "merge_records",
    "peak_phase",
    "report_dir_problem",
    "summary",
    "write_report",
]

PHASES = ("forward", "backward", "optimizer")
_FIGURES = (*CATEGORIES, HEAD)  # what a breakdown may carry at a peak, in the records' key order
TIMES = ("step_us", "head_us")
"""The keys of a timed record: microseconds of its steps, and of the output heads in them."""
_MIB = 2**20


def empty_record(
    step: int,
    phases: Sequence[str] = PHASES,
    *,
    breakdown: bool = True,
    head: bool = False,
    timed: bool = False,
) -> dict[str, int]:
    """A record for ``step`` with every peak (and, with ``breakdown``, every category, and with ``head``
    too, the output head's bytes) at 0 bytes, and with ``timed`` its :data:`TIMES` at 0 microseconds.

    Raises:
        ValueError: If a phase name contains ``_`` (it separates phase and category in the keys).
    """
    for phase in phases:
        if "_" in phase or phase in ("step", "steps"):
            raise ValueError(f"phase names must not contain '_' nor be 'step'/'steps', got {phase!r}")
    record = {"step": step, "steps": 1}
    for phase in phases:
        record[phase] = 0
        if breakdown:
            record.update({f"{phase}_{c}": 0 for c in (_FIGURES if head else CATEGORIES)})
    if timed:
        record.update(dict.fromkeys(TIMES, 0))
    return record


def record_phases(record: dict[str, int]) -> list[str]:
    """The phases a record has a peak for, in the order they were added."""
    return [k for k in record if k not in ("step", "steps") and "_" not in k]


def has_head(record: dict[str, int]) -> bool:
    """Whether the record carries the output head's bytes at each phase's peak (``<phase>_head``)."""
    phases = record_phases(record)
    return bool(phases) and f"{phases[0]}_{HEAD}" in record


def has_breakdown(record: dict[str, int]) -> bool:
    """Whether the record carries bytes by category at each phase's peak."""
    phases = record_phases(record)
    return bool(phases) and f"{phases[0]}_{CATEGORIES[0]}" in record


def fold_peak(record: dict[str, int], phase: str, peak: int, breakdown: dict[str, int] | None) -> None:
    """Raise ``record[phase]`` to ``peak`` if it is larger, taking ``breakdown`` (bytes by category at that
    peak, and by :data:`HEAD` the head's where the record has that key) along with it, so a phase entered
    several times in one step keeps its largest peak."""
    if peak < record[phase]:
        return
    record[phase] = peak
    if breakdown is not None:
        for key in _FIGURES:
            if f"{phase}_{key}" in record:
                record[f"{phase}_{key}"] = breakdown[key]


def merge_records(records: Iterable[dict[str, int]], *, same_step: bool = False) -> dict[str, int]:
    """One record holding, per phase, the largest peak of ``records`` and the breakdown at that peak, and
    their :data:`TIMES`: the sum of consecutive steps', the longest of one step's on several ranks.

    Args:
        records: Records with the same keys.
        same_step: True when the records are one step seen by several ranks (the result keeps ``steps``);
            False when they are consecutive steps (``steps`` add up and ``step`` is the first one).

    Raises:
        ValueError: If ``records`` is empty.
    """
    records = list(records)
    if not records:
        raise ValueError("merge_records needs at least one record, got none")
    out = dict(records[0])
    for other in records[1:]:
        for phase in record_phases(out):
            if other[phase] > out[phase]:
                out[phase] = other[phase]
                for figure in _FIGURES:
                    key = f"{phase}_{figure}"
                    if key in out:
                        out[key] = other[key]
        for key in TIMES:
            if key in out:
                out[key] = max(out[key], other[key]) if same_step else out[key] + other[key]
        out["step"] = min(out["step"], other["step"])
        if not same_step:
            out["steps"] += other["steps"]
    return out


def peak_phase(record: dict[str, int]) -> str:
    """The phase with the record's largest peak (the first one on a tie)."""
    phases = record_phases(record)
    return max(phases, key=lambda p: (record[p], -phases.index(p)))


class MemoryHistory:
    """Per-step records with bounded memory: past ``max_records``, neighbours are merged pairwise.

    After a merge each record covers ``steps`` consecutive batches and holds their largest peaks, so
    the history of a run of any length costs at most ``max_records`` small dicts and still shows the
    largest peak of every phase exactly.

    Args:
        max_records: How many records to keep at most (at least 2).

    Raises:
        ValueError: If ``max_records`` is smaller than 2.

    Example::

        >>> history = MemoryHistory(max_records=2)
        >>> for step, peak in enumerate([5, 9, 7]):
        ...     history.append({"step": step, "steps": 1, "forward": peak})
        >>> [(r["step"], r["steps"], r["forward"]) for r in history]
        [(0, 2, 9), (2, 1, 7)]
    """

    def __init__(self, max_records: int = 2048) -> None:
        check_positive_int("max_records", max_records, minimum=2)
        self.max_records = max_records
        self.records: list[dict[str, int]] = []

    def append(self, record: dict[str, int]) -> None:
        """Add the record of the next step, merging older ones pairwise if the cap is reached."""
        self.records.append(record)
        if len(self.records) > self.max_records:
            pairs = zip(self.records[0::2], self.records[1::2])
            merged = [merge_records(pair) for pair in pairs]
            if len(self.records) % 2:
                merged.append(self.records[-1])
            self.records = merged

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):
        return self.records[index]


def _mib(n: int | float) -> str:
    """Bytes as MiB with about three significant digits for small values (a tiny test model too)."""
    v = n / _MIB
    return f"{v:.1f}" if v >= 100 else f"{v:.2f}" if v >= 1 else f"{v:.4f}"


def _steps_text(record: dict[str, int]) -> str:
    first = record["step"]
    return f"step {first}" if record["steps"] == 1 else f"steps {first}-{first + record['steps'] - 1}"


def summary(history: Sequence[dict[str, int]], val_history: Sequence[dict[str, int]] = ()) -> str:
    """A few lines saying where the training peak was, what it was made of, and the validation peak.

    Args:
        history: Training records (see the module docstring).
        val_history: Records with a ``validation`` phase, one per validation run.

    Raises:
        ValueError: If ``history`` is empty.

    Example::

        >>> print(summary([{"step": 0, "steps": 1, "forward": 3 * 2**20, "backward": 2**21, "optimizer": 0}]))
        Memory: peak 3.00 MiB in forward at step 0 (1 steps); forward 3.00 MiB, backward 2.00 MiB, optimizer 0.0000 MiB
    """
    if not history:
        raise ValueError("summary needs at least one training record, got none; was any training step run?")
    top = merge_records(history)
    phase = peak_phase(top)
    per_phase = ", ".join(f"{p} {_mib(top[p])} MiB" for p in record_phases(top))
    at_peak = max(history, key=lambda r: r[phase])
    lines = [
        f"Memory: peak {_mib(top[phase])} MiB in {phase} at {_steps_text(at_peak)} "
        f"({top['steps']} steps); {per_phase}"
    ]
    if has_breakdown(top):
        parts = ", ".join(f"{c} {_mib(top[f'{phase}_{c}'])}" for c in CATEGORIES)
        head = f"; of which the output head {_mib(top[f'{phase}_{HEAD}'])}" if has_head(top) else ""
        lines.append(f"  at the peak (MiB): {parts}{head}")
    timed = step_times(history)
    if timed is not None:
        step, head, steps = timed
        share = head / step if step else 0.0
        lines.append(
            f"  time a step {_ms(step)} ms, of which the output head {_ms(head)} ms ({share:.1%}; median of "
            f"{counted(steps, 'step')}{', the first left out' if len(history) > 1 else ''})"
        )
    if val_history:
        val = merge_records(val_history)
        lines.append(f"  validation peak {_mib(val['validation'])} MiB over {len(val_history)} runs")
    return "\n".join(lines)


def step_times(history: Sequence[dict[str, int]]) -> tuple[float, float, int] | None:
    """Seconds of a step and of the output heads in it, and how many steps they are of; None where the
    records are not timed (:data:`TIMES`).

    Each is the median over the records of its mean per step; the first record (the first step, or the
    first steps merged, which pay one-time costs) is left out where there are others.

    Example::

        >>> records = [{"step": i, "steps": 1, "step_us": us, "head_us": us // 4} for i, us in enumerate([9000, 2000, 4000, 2400])]
        >>> step_times(records)
        (0.0024, 0.0006, 3)
    """
    if not history or TIMES[0] not in history[0]:
        return None
    records = history[1:] if len(history) > 1 else history
    step, head = (statistics.median(r[key] / r["steps"] / 1e6 for r in records) for key in TIMES)
    return step, head, sum(r["steps"] for r in records)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}" if seconds < 0.1 else f"{seconds * 1e3:,.0f}"


def _markdown(history: Sequence[dict[str, int]], val_history: Sequence[dict[str, int]], note: str) -> str:
    top = merge_records(history)
    out = ["# Memory report", "", summary(history, val_history).replace("\n  ", "\n\n"), ""]
    if note:
        out += [note, ""]
    for phase in record_phases(top):
        at_peak = max(history, key=lambda r: r[phase])
        mean = statistics.fmean(r[phase] for r in history)
        out += [f"## {phase}", "", f"Largest peak at {_steps_text(at_peak)}; mean peak {_mib(mean)} MiB.", ""]
        out += ["| category | at the largest peak (MiB) | share | mean over steps (MiB) |"]
        out += ["|---|---:|---:|---:|"]
        total = at_peak[phase]
        if has_breakdown(top):
            for category in CATEGORIES:
                key = f"{phase}_{category}"
                share = at_peak[key] / total if total else 0.0
                cat_mean = statistics.fmean(r[key] for r in history)
                out.append(f"| {category} | {_mib(at_peak[key])} | {share:.1%} | {_mib(cat_mean)} |")
        if has_head(top):
            key = f"{phase}_{HEAD}"
            share = at_peak[key] / total if total else 0.0
            head_mean = _mib(statistics.fmean(r[key] for r in history))
            out.append(f"| of which the output head | {_mib(at_peak[key])} | {share:.1%} | {head_mean} |")
        out.append(f"| **total** | {_mib(total)} | 100.0% | {_mib(mean)} |")
        out.append("")
    if val_history:
        out += ["## validation", "", "| validation run | first step | peak (MiB) |", "|---:|---:|---:|"]
        out += [f"| {i} | {r['step']} | {_mib(r['validation'])} |" for i, r in enumerate(val_history)]
        out.append("")
    return "\n".join(out)


def _plot(history: Sequence[dict[str, int]], val_history: Sequence[dict[str, int]], path: Path) -> None:
    from matplotlib.figure import Figure  # lazily: matplotlib is optional; no pyplot, no backend switch

    top = merge_records(history)
    phases = record_phases(top)
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))

    steps = [r["step"] for r in history]
    for phase in phases:
        left.plot(steps, [r[phase] / _MIB for r in history], marker=".", label=phase)
    if val_history:
        left.scatter(
            [r["step"] for r in val_history],
            [r["validation"] / _MIB for r in val_history],
            marker="x",
            color="black",
            label="validation",
            zorder=3,
        )
    left.set_title("Peak memory per training step, by phase")
    left.set_xlabel("training step (batch)")
    left.set_ylabel("peak (MiB)")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    left.legend(loc="lower right")

    if has_breakdown(top):
        bottoms = [0.0] * len(phases)
        for category in CATEGORIES:
            heights = [top[f"{p}_{category}"] / _MIB for p in phases]
            right.bar(phases, heights, bottom=bottoms, label=category)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        right.set_title("Breakdown at each phase's largest peak")
        right.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    else:
        right.bar(phases, [top[p] / _MIB for p in phases], color="grey")
        right.set_title("Largest peak per phase (no breakdown measured)")
    right.set_ylabel("MiB")
    right.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)


def check_dirpath(dirpath: object) -> None:
    """Raise ``TypeError`` unless ``dirpath`` is a directory path (``str`` or ``os.PathLike``)."""
    if not isinstance(dirpath, (str, os.PathLike)):
        raise TypeError(
            f"dirpath must be a directory path (str or os.PathLike) or None, got {dirpath!r} "
            f"({type(dirpath).__name__}); pass e.g. dirpath='logs/memory'"
        )


def report_dir_problem(directory: str | os.PathLike) -> str | None:
    """Why :func:`write_report` could not write into ``directory``, or ``None`` if it can.

    Checked without creating anything: the nearest existing ancestor must be a directory in which a file
    can be created (a probe file is created and deleted there), so an unwritable location is found
    before a run rather than after its last step.

    Example::

        >>> with tempfile.NamedTemporaryFile() as file:  # a file where a directory should be
        ...     report_dir_problem(f"{file.name}/reports").endswith("is not a directory")
        True
    """
    path = Path(directory).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{str(existing)!r} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"cannot create files in {str(existing)!r} ({type(err).__name__}: {err.strerror or err})"
    return None


def write_report(
    history: Sequence[dict[str, int]],
    directory: str | Path,
    *,
    val_history: Sequence[dict[str, int]] = (),
    filename: str = "memory_report",
    note: str = "",
    plot: bool = True,
) -> list[Path]:
    """Write ``<filename>.md`` and, if matplotlib is importable and ``plot``, ``<filename>.png``.

    The markdown has a summary, then one table per phase: bytes by category at the phase's largest peak
    (MiB), their share, and their mean over steps; then the validation peaks. The PNG has two panels:
    the peak of each phase per step, and the stacked breakdown at each phase's largest peak.

    Args:
        history: Training records (see the module docstring), oldest first.
        directory: Where to write; created if missing.
        val_history: Records with a ``validation`` phase, one per validation run.
        filename: File name without extension.
        note: A line added under the summary (e.g. how the numbers were measured).
        plot: Set False to skip the PNG even when matplotlib is installed.

    Returns:
        The paths written, markdown first.

    Raises:
        ValueError: If ``history`` is empty.
        TypeError: If ``directory`` is not a path.

    Example::

        >>> import tempfile
        >>> rec = {"step": 0, "steps": 1, "forward": 2**20, "backward": 2**21, "optimizer": 2**20}
        >>> [p.name for p in write_report([rec], tempfile.mkdtemp(), plot=False)]
        ['memory_report.md']
    """
    if not history:
        raise ValueError("write_report needs at least one training record, got none; was any step run?")
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            f"directory must be a str or os.PathLike, got {directory!r} ({type(directory).__name__})"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    md = directory / f"{filename}.md"
    md.write_text(_markdown(history, val_history, note))
    paths = [md]
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return paths
        png = directory / f"{filename}.png"
        _plot(history, val_history, png)
        paths.append(png)
    return paths
