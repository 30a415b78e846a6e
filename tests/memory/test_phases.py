import doctest
import types

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from lightning_memopt.memory import CATEGORIES, phases
from lightning_memopt.memory import device as device_module
from lightning_memopt.memory.phases import (
    BREAKDOWN_MODES,
    PhaseRecorder,
    StepPeaks,
    check_breakdown,
    merge_across_ranks,
    record_metrics,
)
from lightning_memopt.memory.report import PHASES

GIB = 2**30
PARAMS = (4 * 4 + 4) * 4  # Linear(4, 4) in float32: 80 bytes
X = 2 * 4 * 4  # the (2, 4) input, and the output too: 32 bytes


def _linear():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _one_step(recorder, model, opt, record):
    x = torch.ones(2, 4)
    recorder.start(record, "forward")
    out = model(x)
    recorder.switch("backward")
    out.sum().backward()
    del out
    recorder.switch("optimizer")
    opt.step()
    recorder.stop()


def test_documented_breakdown_modes():
    assert BREAKDOWN_MODES == ("auto", "always", "never")
    with pytest.raises(
        ValueError, match=r"breakdown must be one of \('auto', 'always', 'never'\), got 'yes'"
    ):
        check_breakdown("yes")
    with pytest.raises(ValueError, match="breakdown must be one of"):
        PhaseRecorder("cpu", torch.nn.Linear(1, 1), [], breakdown="sometimes")


def test_cpu_step_exact_bytes_per_phase_and_category():
    model, opt = _linear()
    recorder = PhaseRecorder("cpu", model, [opt])
    assert recorder.source == "live tensor bytes" and recorder.with_breakdown
    record = recorder.new_record(step=7)
    _one_step(recorder, model, opt, record)
    assert record["step"] == 7 and record["steps"] == 1
    # forward: parameters, the input (saved by autograd for the weight's gradient) and the output
    assert [record[f"forward_{c}"] for c in CATEGORIES] == [PARAMS, 0, 0, X, X]
    # backward: the gradients join; other is the output (32) plus the loss and its gradient (4 + 4)
    assert [record[f"backward_{c}"] for c in CATEGORIES] == [PARAMS, PARAMS, 0, X, X + 8]
    # optimizer: the momentum joins; the input is no longer held by autograd
    assert [record[f"optimizer_{c}"] for c in CATEGORIES] == [PARAMS, PARAMS, PARAMS, 0, X]
    for phase in PHASES:
        assert record[phase] == sum(record[f"{phase}_{c}"] for c in CATEGORIES)
    assert _get_current_dispatch_mode_stack() == []  # the tracker is entered only while a window is open


def test_breakdown_never_keeps_only_peaks():
    model, opt = _linear()
    recorder = PhaseRecorder("cpu", model, [opt], breakdown="never")
    record = recorder.new_record(0)
    _one_step(recorder, model, opt, record)
    assert record == {"step": 0, "steps": 1, "forward": PARAMS + 2 * X, "backward": 232, "optimizer": 272}


def test_a_phase_entered_twice_keeps_its_largest_peak():
    recorder = PhaseRecorder("cpu", torch.nn.Linear(4, 4), [])
    record = recorder.new_record(0, ("validation",))
    for n in (3, 1):  # the bigger batch first: its peak must survive the smaller one
        recorder.start(record, "validation")
        with torch.no_grad():
            torch.ones(n, 1024).sum()
        recorder.stop()
    assert record["validation"] == PARAMS + 3 * 1024 * 4 + 4
    assert record["validation_other"] == 3 * 1024 * 4 + 4


def test_switch_needs_an_open_window_and_discard_is_safe_twice():
    recorder = PhaseRecorder("cpu", torch.nn.Linear(4, 4), [])
    with pytest.raises(RuntimeError, match=r"switch\('backward'\) needs an open window; call start"):
        recorder.switch("backward")
    record = recorder.new_record(0)
    recorder.start(record, "forward")
    recorder.start(record, "forward")  # a step left open is dropped: the tracker is not entered twice
    assert len(_get_current_dispatch_mode_stack()) == 1
    recorder.discard()
    recorder.discard()
    assert _get_current_dispatch_mode_stack() == []
    recorder.stop()  # nothing open: nothing folded
    assert record["forward"] == 0


class FakeCuda(types.SimpleNamespace):
    def __init__(self):
        super().__init__(allocated=1000, peak=1000, resets=0)

    def max_memory_allocated(self, device):
        return self.peak

    def reset_peak_memory_stats(self, device):
        self.resets += 1
        self.peak = self.allocated


@pytest.mark.parametrize("breakdown", ["auto", "always", "never"])
def test_cuda_peaks_come_from_the_allocator(monkeypatch, breakdown):
    cuda = FakeCuda()
    monkeypatch.setattr(device_module.torch, "cuda", cuda)
    model = torch.nn.Linear(4, 4)
    recorder = PhaseRecorder(torch.device("cuda", 0), model, [], breakdown=breakdown)
    assert recorder.source == "CUDA allocator"
    assert (recorder.tracker is not None) == (breakdown == "always") == recorder.with_breakdown
    record = recorder.new_record(0)
    recorder.start(record, "forward")
    cuda.peak = 5000
    with torch.no_grad():
        model(torch.ones(2, 4))
    recorder.switch("backward")
    cuda.peak = 3000
    recorder.stop()
    assert (record["forward"], record["backward"], record["optimizer"]) == (5000, 3000, 0)
    assert cuda.resets == 2  # one reset per window opened
    if breakdown == "always":  # the tracker's bytes at its own peak: parameters, input and output
        assert [record[f"forward_{c}"] for c in CATEGORIES] == [PARAMS, 0, 0, 0, 2 * X]
    assert _get_current_dispatch_mode_stack() == []


def test_step_peaks_records_steps_windows_and_validation_runs():
    model, opt = _linear()
    peaks = StepPeaks(max_history=8)
    peaks.step_start()  # before begin: every moment is ignored
    assert not peaks.step_end() and peaks.validation_end() is None and peaks.steps == 0
    peaks.begin("cpu", model, [opt])
    for n in (1, 3):
        peaks.step_start()
        out = model(torch.ones(n, 4))
        peaks.phase("backward")
        out.sum().backward()
        del out
        peaks.phase("optimizer")
        opt.step()
        assert peaks.step_end()
    assert [r["step"] for r in peaks.train] == [0, 1] and peaks.steps == 2
    window = peaks.take_window()
    assert window["steps"] == 2 and window["forward"] == max(r["forward"] for r in peaks.train)
    assert window["forward"] == peaks.train[1]["forward"] > peaks.train[0]["forward"]
    with pytest.raises(RuntimeError, match="take_window needs a step ended since the last call"):
        peaks.take_window()

    peaks.validation_start()
    for n in (5, 2):
        peaks.validation_batch_start()
        with torch.no_grad():
            model(torch.ones(n, 4))
        peaks.validation_batch_end()
    record = peaks.validation_end()
    assert record["step"] == 2 and record["validation_other"] == 2 * 5 * 4 * 4  # input and output of 5
    assert list(peaks.validation) == [record]

    state = peaks.state_dict()
    assert state == {"batches": 2, "history": list(peaks.train), "val_history": [record]}
    peaks.end()
    assert peaks.recorder is None and _get_current_dispatch_mode_stack() == []
    resumed = StepPeaks()
    resumed.load_state_dict(state)
    assert resumed.steps == 2 and list(resumed.train) == state["history"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_history": 1}, "max_history must be an int >= 2, got 1"),
        ({"max_history": True}, "max_history must be an int >= 2, got True"),
        ({"breakdown": "all"}, r"breakdown must be one of \('auto', 'always', 'never'\), got 'all'"),
    ],
)
def test_step_peaks_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepPeaks(**kwargs)


def test_record_metrics_in_gib():
    record = {"step": 0, "steps": 1, "forward": 3 * GIB, "backward": 5 * GIB, "optimizer": GIB}
    assert record_metrics(record) == {
        "memory/forward_peak_gib": 3.0,
        "memory/backward_peak_gib": 5.0,
        "memory/optimizer_peak_gib": 1.0,
        "memory/peak_gib": 5.0,
    }
    record.update({f"{p}_{c}": 0 for p in PHASES for c in CATEGORIES})
    record.update(backward_gradients=2 * GIB, backward_activations=3 * GIB, forward_other=3 * GIB)
    metrics = record_metrics(record)
    assert {c: metrics[f"memory/peak_{c}_gib"] for c in CATEGORIES} == {
        "parameters": 0.0,
        "gradients": 2.0,
        "optimizer_state": 0.0,
        "activations": 3.0,
        "other": 0.0,
    }
    assert record_metrics({"step": 4, "steps": 1, "validation": GIB // 4}) == {"memory/val_peak_gib": 0.25}
    assert "memory/peak_head_gib" not in metrics
    record.update({f"{p}_head": GIB // 2 for p in PHASES}, backward_head=GIB)
    assert record_metrics(record)["memory/peak_head_gib"] == 1.0  # the head at the step's peak (backward)


def test_recorder_with_a_head_records_its_bytes():
    torch.manual_seed(0)
    body, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 10)
    model = torch.nn.Sequential(body, head)
    recorder = PhaseRecorder("cpu", model, [], heads=[head])
    record = recorder.new_record(0)
    recorder.start(record, "forward")
    out = model(torch.ones(3, 4))
    recorder.switch("backward")
    out.sum().backward()
    recorder.stop()
    # Forward: the logits (3 x 10 float32). Backward: the logits (still bound to `out`), the sum and its
    # gradient (one float each; the logits' gradient is an expanded view of that float).
    assert record["forward_head"] == 3 * 10 * 4
    assert record["backward_head"] == 3 * 10 * 4 + 2 * 4
    assert "forward_head" not in PhaseRecorder("cpu", model, []).new_record(0)


def test_merge_across_ranks_takes_each_phase_from_the_rank_with_its_peak():
    rank0 = [{"step": 0, "steps": 1, "forward": 10, "forward_other": 10, "backward": 7, "backward_other": 7}]
    rank1 = [{"step": 0, "steps": 1, "forward": 4, "forward_other": 4, "backward": 9, "backward_other": 9}]
    sent = []

    def all_gather(rows):  # what rank 0 would get back: every rank's rows, stacked
        sent.append(rows)
        other = torch.tensor([[r[k] for k in rank1[0]] for r in rank1], dtype=torch.int64)
        return torch.stack([rows, other])

    merged = merge_across_ranks(rank0, all_gather, "cpu")
    assert merged == [
        {"step": 0, "steps": 1, "forward": 10, "forward_other": 10, "backward": 9, "backward_other": 9}
    ]
    assert len(sent) == 1 and sent[0].dtype == torch.int64 and sent[0].shape == (1, 6)
    with pytest.raises(ValueError, match="merge_across_ranks needs at least one record, got none"):
        merge_across_ranks([], all_gather, "cpu")


def test_docstring_examples_run():
    assert doctest.testmod(phases, raise_on_error=True).attempted == 23


def test_step_times_are_read_at_each_window_every_unread_steps_and_before_the_history_merges(monkeypatch):
    from tests.data.helpers import FakeClock

    monkeypatch.setattr(phases, "UNREAD", 3)
    model, head, clock = torch.nn.Linear(4, 4), torch.nn.Linear(4, 6), FakeClock()
    head.register_forward_hook(lambda *_: clock.advance(1.0))  # the head takes 1 s a step
    peaks = StepPeaks(max_history=6)
    peaks.begin("cpu", model, [], heads=[head])
    peaks.timer.clock = clock

    def step(seconds):  # a step of 1 + seconds
        peaks.step_start()
        head(model(torch.ones(2, 4))).sum().backward()
        clock.advance(seconds)
        peaks.step_end()

    step(1.0)
    step(2.0)
    assert [r["step_us"] for r in peaks.train] == [0, 0] and clock.settles == 0  # not read yet
    window = peaks.take_window()
    assert (window["steps"], window["step_us"], window["head_us"]) == (2, 5_000_000, 2_000_000)
    assert [(r["step_us"], r["head_us"]) for r in peaks.train] == [
        (2_000_000, 1_000_000),
        (3_000_000, 1_000_000),
    ]
    assert clock.settles == 1
    step(3.0)
    step(4.0)
    step(5.0)  # 3 steps unread: read at this step's end, without a window
    assert clock.settles == 2 and [r["step_us"] for r in peaks.train][-3:] == [
        4_000_000,
        5_000_000,
        6_000_000,
    ]
    step(6.0)
    assert clock.settles == 2 and len(peaks.train) == 6 and peaks.train[-1]["step_us"] == 0
    step(7.0)  # the history is full (6 records): read before this step's record merges pairs of them
    assert clock.settles == 3
    assert [(r["steps"], r["step_us"]) for r in peaks.train] == [
        (2, 5_000_000),
        (2, 9_000_000),
        (2, 13_000_000),
        (1, 8_000_000),
    ]
    window = peaks.take_window()  # the five steps since the last window, read at two moments
    assert (window["steps"], window["step_us"], window["head_us"]) == (5, 30_000_000, 5_000_000)
    step(8.0)
    assert peaks.state_dict()["history"][-1]["step_us"] == 9_000_000  # read for a checkpoint
    step(9.0)
    peaks.end()  # and at the end of the run
    assert peaks.train[-1]["step_us"] == 10_000_000 and not head._forward_pre_hooks
