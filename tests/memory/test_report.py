import sys

import pytest

from lightning_memopt.memory import CATEGORIES, MemoryHistory, summary, write_report
from lightning_memopt.memory.report import empty_record, fold_peak, merge_records, peak_phase

MIB = 2**20


def _record(step, forward, backward, optimizer, breakdown=True):
    """A record whose breakdown at each peak is the peak split evenly over the five categories."""
    record = empty_record(step, breakdown=breakdown)
    for phase, peak in (("forward", forward), ("backward", backward), ("optimizer", optimizer)):
        fold_peak(record, phase, peak, dict.fromkeys(CATEGORIES, peak // 5) if breakdown else None)
    return record


def test_empty_record_keys():
    assert list(empty_record(3, ("validation",))) == ["step", "steps", "validation"] + [
        f"validation_{c}" for c in CATEGORIES
    ]
    assert empty_record(0, breakdown=False) == {
        "step": 0,
        "steps": 1,
        "forward": 0,
        "backward": 0,
        "optimizer": 0,
    }


@pytest.mark.parametrize("bad", ["optimizer_step", "steps"])
def test_empty_record_bad_phase(bad):
    with pytest.raises(
        ValueError, match=f"phase names must not contain '_' nor be 'step'/'steps', got '{bad}'"
    ):
        empty_record(0, (bad,))


def test_fold_peak_keeps_largest_with_its_breakdown():
    record = empty_record(0, ("forward",))
    fold_peak(record, "forward", 100, dict.fromkeys(CATEGORIES, 20))
    fold_peak(record, "forward", 50, dict.fromkeys(CATEGORIES, 10))  # smaller: ignored
    assert record["forward"] == 100 and record["forward_activations"] == 20
    fold_peak(record, "forward", 200, {**dict.fromkeys(CATEGORIES, 0), "activations": 200})
    assert record["forward"] == 200 and record["forward_activations"] == 200 and record["forward_other"] == 0


def test_merge_records_consecutive_and_over_ranks():
    a, b = _record(4, 500, 300, 100), _record(5, 400, 600, 100)
    merged = merge_records([a, b])
    assert (merged["step"], merged["steps"]) == (4, 2)
    assert (merged["forward"], merged["backward"], merged["optimizer"]) == (500, 600, 100)
    assert merged["forward_parameters"] == 100 and merged["backward_parameters"] == 120
    ranks = merge_records([a, _record(4, 900, 100, 100)], same_step=True)
    assert (ranks["step"], ranks["steps"], ranks["forward"], ranks["forward_gradients"]) == (4, 1, 900, 180)
    assert ranks["backward"] == 300
    assert a["forward"] == 500  # inputs are not modified
    with pytest.raises(ValueError, match="needs at least one record, got none"):
        merge_records([])


def test_peak_phase():
    assert peak_phase(_record(0, 1, 3, 2)) == "backward"
    assert peak_phase(_record(0, 3, 3, 2)) == "forward"  # first on a tie


def test_history_merges_pairwise_past_the_cap():
    history = MemoryHistory(max_records=4)
    peaks = [10, 50, 20, 30, 40]
    for step, peak in enumerate(peaks):
        history.append(_record(step, peak, 0, 0))
    assert [(r["step"], r["steps"], r["forward"]) for r in history] == [(0, 2, 50), (2, 2, 30), (4, 1, 40)]
    for step in range(5, 9):
        history.append(_record(step, step, 0, 0))
    assert len(history) <= 4
    assert sum(r["steps"] for r in history) == 9
    assert max(r["forward"] for r in history) == 50
    assert history[0]["forward_parameters"] == 10  # the breakdown of the 50-byte peak came along


@pytest.mark.parametrize("bad", [1, 0, 2.0, True, "8"])
def test_history_bad_cap(bad):
    with pytest.raises(ValueError, match=f"max_records must be an int >= 2, got {bad!r}"):
        MemoryHistory(bad)


def test_summary_text():
    history = [_record(0, 5 * MIB, 10 * MIB, 2 * MIB), _record(1, 5 * MIB, 15 * MIB, 2 * MIB)]
    val = [{"step": 2, "steps": 1, "validation": MIB // 2}]
    assert summary(history, val) == (
        "Memory: peak 15.00 MiB in backward at step 1 (2 steps); "
        "forward 5.00 MiB, backward 15.00 MiB, optimizer 2.00 MiB\n"
        "  at the peak (MiB): parameters 3.00, gradients 3.00, optimizer_state 3.00, activations 3.00, "
        "other 3.00\n"
        "  validation peak 0.5000 MiB over 1 runs"
    )
    no_breakdown = summary([_record(0, MIB, 2 * MIB, 0, breakdown=False)])
    assert "at the peak" not in no_breakdown and "backward 2.00 MiB" in no_breakdown
    with pytest.raises(ValueError, match="summary needs at least one training record, got none"):
        summary([])


def test_write_report_markdown_and_png(tmp_path):
    history = [_record(0, 5 * MIB, 10 * MIB, 2 * MIB), _record(1, 7 * MIB, 5 * MIB, 200 * MIB)]
    val = [{"step": 2, "steps": 1, "validation": 3 * MIB}]
    paths = write_report(history, tmp_path / "new", val_history=val, note="Measured on a test.")
    assert [p.name for p in paths] == ["memory_report.md", "memory_report.png"]
    md = paths[0].read_text().splitlines()
    assert md[0] == "# Memory report"
    assert "Measured on a test." in md
    assert [line for line in md if line.startswith("## ")] == [
        "## forward",
        "## backward",
        "## optimizer",
        "## validation",
    ]
    forward = md.index("## forward")
    assert md[forward + 2] == "Largest peak at step 1; mean peak 6.00 MiB."
    assert md[forward + 6] == "| parameters | 1.40 | 20.0% | 1.20 |"  # 7/5 MiB at the peak; mean of 1 and 1.4
    assert md[forward + 11] == "| **total** | 7.00 | 100.0% | 6.00 |"
    optimizer = md.index("## optimizer")
    assert md[optimizer + 11] == "| **total** | 200.0 | 100.0% | 101.0 |"
    assert md[-1] == "| 0 | 2 | 3.00 |"
    png = paths[1].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # two panels of drawn content


def test_write_report_without_matplotlib_or_plot(tmp_path, monkeypatch):
    history = [_record(0, MIB, MIB, MIB, breakdown=False)]
    assert [p.name for p in write_report(history, tmp_path, plot=False, filename="a")] == ["a.md"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert [p.name for p in write_report(history, tmp_path, filename="b")] == ["b.md"]
    text = (tmp_path / "b.md").read_text()
    assert "| **total** | 1.00 | 100.0% | 1.00 |" in text and "| parameters |" not in text


def test_write_report_without_breakdown_plots(tmp_path):
    paths = write_report([_record(0, MIB, 2 * MIB, MIB, breakdown=False)], tmp_path)
    assert paths[1].stat().st_size > 10_000


def test_write_report_empty_history(tmp_path):
    with pytest.raises(ValueError, match="write_report needs at least one training record, got none"):
        write_report([], tmp_path)


def test_write_report_needs_a_path():
    rec = {"step": 0, "steps": 1, "forward": 1, "backward": 2, "optimizer": 1}
    with pytest.raises(TypeError, match=r"directory must be a str or os.PathLike, got 5 \(int\)"):
        write_report([rec], 5, plot=False)


def test_head_keys_fold_merge_and_show_in_the_report(tmp_path):
    plain = list(empty_record(0))
    record = empty_record(0, head=True)
    assert set(record) == set(plain) | {"forward_head", "backward_head", "optimizer_head"}
    assert "forward_head" not in empty_record(0, breakdown=False, head=True)  # only with a breakdown
    at_peak = {**dict.fromkeys(CATEGORIES, 100), "head": 60}
    fold_peak(record, "forward", 500, at_peak)
    later = empty_record(1, head=True)
    fold_peak(later, "forward", 700, {**dict.fromkeys(CATEGORIES, 140), "head": 90})
    fold_peak(later, "backward", 300, {**dict.fromkeys(CATEGORIES, 60), "head": 30})
    merged = merge_records([record, later])
    assert (merged["forward"], merged["forward_head"], merged["backward_head"]) == (700, 90, 30)
    assert summary([record, later]).endswith("other 0.0001; of which the output head 0.0001")
    md = write_report([record, later], tmp_path, plot=False)[0].read_text()
    assert "| of which the output head | 0.0001 | 12.9% | 0.0001 |" in md  # 90 of 700 bytes
    with pytest.raises(KeyError):  # a record with head keys needs the head's bytes with the breakdown
        fold_peak(empty_record(0, head=True), "forward", 1, dict.fromkeys(CATEGORIES, 0))


def test_time_keys_add_over_steps_take_the_longest_rank_and_show_in_the_summary():
    assert "step_us" not in empty_record(0) and "head_us" not in empty_record(0, head=True)
    records = []
    for step, (step_us, head_us) in enumerate([(900_000, 10_000), (200_000, 50_000), (400_000, 40_000)]):
        record = _record(step, MIB, 2 * MIB, MIB, breakdown=False) | {"step_us": step_us, "head_us": head_us}
        records.append(record)
    assert set(empty_record(0, breakdown=False, timed=True)) == set(records[0])
    merged = merge_records(records[1:])
    assert (merged["steps"], merged["step_us"], merged["head_us"]) == (2, 600_000, 90_000)
    ranks = merge_records([records[1], records[2] | {"step": 1}], same_step=True)
    assert (ranks["steps"], ranks["step_us"], ranks["head_us"]) == (1, 400_000, 50_000)
    # The median of the steps after the first: (200 + 400) / 2 ms, of which (50 + 40) / 2 ms
    assert summary(records).endswith(
        "\n  time a step 300 ms, of which the output head 45 ms (15.0%; median of 2 steps, the first left out)"
    )
    assert summary(records[:1]).endswith(
        "\n  time a step 900 ms, of which the output head 10 ms (1.1%; median of 1 step)"
    )


def test_the_module_examples_run():
    import doctest

    from lightning_memopt import _text
    from lightning_memopt.memory import report

    assert doctest.testmod(report, raise_on_error=True).attempted == 10
    assert doctest.testmod(_text, raise_on_error=True).attempted == 4  # first_line's too
