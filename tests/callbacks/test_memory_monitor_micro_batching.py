"""MemoryMonitor under micro-batching: each micro-batch's backward is filed under ``backward``, where it
runs, although Lightning's hooks see every micro-batch (forward and backward) inside ``training_step``."""

import pytest
import torch

from lightning_memopt import AutoAccumulation, MemoryMonitor
from lightning_memopt.memory.phases import StepPeaks, running
from tests.callbacks.test_memory_monitor import F32, PARAM_BYTES, TinyModel, _loader, _trainer

BATCH, MICRO = 16, 4
KNOWN = ("parameters", "gradients", "optimizer_state", "activations")  # the categories known by hand


def _records(tmp_path, callbacks, batch_size, **kwargs):
    monitor = MemoryMonitor(log=False, report=False)
    torch.manual_seed(0)
    trainer = _trainer(tmp_path, [monitor, *callbacks], logger=False, max_steps=2, **kwargs)
    trainer.fit(TinyModel(), _loader(batch_size, n_batches=4 * BATCH // batch_size))
    return list(monitor.history)


def _known(record, phase):
    return {c: record[f"{phase}_{c}"] for c in KNOWN}


def test_micro_batches_backward_is_filed_under_backward(tmp_path):
    """The split step's phases equal Lightning's own gradient accumulation over batches of MICRO, byte for
    byte in every category but ``other`` (the engine's few scalars), save one difference: the first
    Linear saves its input, a view of the whole batch, so the batch's storage (BATCH x 32 floats) is held
    where Lightning holds a batch of MICRO."""
    split = _records(tmp_path / "split", [AutoAccumulation(micro_batch_size=MICRO, log=False)], BATCH)[1]
    # Lightning's accumulation: 4 batches of 4 per optimizer step; the second step's last batch (momentum
    # and accumulated gradients alive, as in the split step's last micro-batch).
    accumulated = _records(tmp_path / "acc", [], MICRO, accumulate_grad_batches=BATCH // MICRO)[-1]
    view = (BATCH - MICRO) * 32 * F32
    for phase in ("forward", "backward"):
        expected = _known(accumulated, phase)
        expected["activations"] += view
        assert _known(split, phase) == expected, phase
    # By hand: forward's peak holds one micro-batch's activations (the batch, and 4 ReLU outputs of 64),
    # backward's the gradients and what the first Linear still holds for its backward.
    assert _known(split, "forward") == {
        "parameters": PARAM_BYTES,
        "gradients": PARAM_BYTES,
        "optimizer_state": PARAM_BYTES,
        "activations": (BATCH * 32 + MICRO * 64) * F32,
    }
    assert split["backward_activations"] == BATCH * 32 * F32
    assert split["backward"] > split["forward"]  # as in Lightning's accumulation: backward's peak is higher


def test_running_files_work_under_its_phase_and_returns():
    model = torch.nn.Linear(4, 4)
    peaks = StepPeaks()
    with running("backward"):  # no step measured: nothing happens
        pass
    peaks.begin("cpu", model, [])
    peaks.step_start()
    loss = model(torch.ones(2, 4)).sum()
    with pytest.raises(ValueError, match="injected"), running("backward"):
        loss.backward()
        raise ValueError("injected")
    assert peaks.recorder.phase == "forward"  # back where it was, after the exception too
    peaks.step_end()
    peaks.end()
    record = peaks.train[-1]
    assert record["backward_gradients"] == 20 * F32  # the gradients were made under backward
    with running("backward"):  # ended: no longer told
        pass
    with pytest.raises(RuntimeError, match=r"enter\('backward'\) needs a training step being measured"):
        peaks.enter("backward")
