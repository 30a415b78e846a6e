import csv
import gc
import io
import json
import logging
import os
import types
import warnings
import weakref

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import MemoryMonitor
from lightning_memopt.memory import CATEGORIES, MemoryTracker
from lightning_memopt.memory import device as device_module
from lightning_memopt.memory import report as report_module
from lightning_memopt.memory.report import PHASES, merge_records, report_dir_problem
from tests.distributed import run_ranks

GIB = 2**30
F32 = 4
TRAIN_KEYS = {f"memory/{p}_peak_gib" for p in PHASES} | {"memory/peak_gib"}
BREAKDOWN_KEYS = {f"memory/peak_{c}_gib" for c in CATEGORIES}


class TinyModel(pl.LightningModule):
    """Linear(32, 64) -> ReLU -> Linear(64, 8), SGD with momentum (state as big as the parameters)."""

    def __init__(self, fail_at=None):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("injected failure")
        return self.net(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


PARAM_BYTES = (32 * 64 + 64 + 64 * 8 + 8) * F32


def _loader(batch_size, n_batches=4):
    torch.manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(batch_size * n_batches, 32)), batch_size=batch_size)


def _trainer(tmp_path, callbacks, logger=True, **kwargs):
    kwargs = {"max_steps": 4, "limit_val_batches": 0, **kwargs}
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=CSVLogger(tmp_path, name="logs") if logger else False,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


def _csv_rows(trainer):
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


class ReferenceTracker(Callback):
    """What a MemoryTracker measures for each step when read directly at the same hooks."""

    def __init__(self):
        self.steps = []

    def on_fit_start(self, trainer, pl_module):
        self.tracker = MemoryTracker(pl_module, trainer.optimizers)

    def _read(self, phase):
        self.step[phase] = (self.tracker.peak, self.tracker.peak_breakdown)
        self.tracker.reset_peak()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.tracker.__enter__()
        self.tracker.reset_peak()
        self.step = {}

    def on_before_backward(self, trainer, pl_module, loss):
        self._read("forward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._read("backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._read("optimizer")
        self.tracker.__exit__(None, None, None)
        self.steps.append(self.step)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_every_n_steps": 0}, "log_every_n_steps must be a positive int, got 0; pass e.g. 1"),
        ({"log_every_n_steps": -3}, "log_every_n_steps must be a positive int, got -3"),
        ({"log_every_n_steps": 2.5}, "log_every_n_steps must be a positive int, got 2.5"),
        ({"log_every_n_steps": True}, "log_every_n_steps must be a positive int, got True"),
        (
            {"breakdown": "sometimes"},
            r"breakdown must be one of \('auto', 'always', 'never'\), got 'sometimes'",
        ),
        ({"max_history": 1}, "max_history must be an int >= 2, got 1"),
        (
            {"log": False, "log_every_n_steps": 5},
            r"log_every_n_steps=5 only applies with log=True; drop it or pass log=True",
        ),
        (
            {"report": False, "dirpath": "out"},
            r"dirpath='out' only applies with report=True; drop it or pass",
        ),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryMonitor(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # 'no' is truthy: it used to write the report silently.
        ({"report": "no"}, r"report must be True or False, got 'no'; pass a bool, e.g. report=False"),
        ({"report": 0}, r"report must be True or False, got 0"),
        ({"log": "false"}, r"log must be True or False, got 'false'; pass a bool, e.g. log=False"),
        ({"log": None}, r"log must be True or False, got None"),
        # Used to fail in on_fit_end, after every step had run.
        (
            {"dirpath": 5},
            r"dirpath must be a directory path \(str or os.PathLike\) or None, got 5 \(int\); pass e.g.",
        ),
    ],
)
def test_wrong_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        MemoryMonitor(**kwargs)


def test_unwritable_report_dir_fails_in_setup_before_any_step(tmp_path):
    """A location where no file can be created used to fail in on_fit_end: after every step had run."""
    (tmp_path / "file").write_text("")
    model = TinyModel()
    steps = []
    model.on_train_batch_start = lambda *args: steps.append(1)
    monitor = MemoryMonitor(dirpath=tmp_path / "file" / "reports")
    with pytest.raises(
        MisconfigurationException,
        match=rf"MemoryMonitor cannot write its report into '{tmp_path}/file/reports': '{tmp_path}/file' is "
        r"not a directory. Pass dirpath= a writable directory, or report=False",
    ):
        _trainer(tmp_path, [monitor], logger=False).fit(model, _loader(8))
    assert steps == []


def test_report_dir_problem_names_what_cannot_be_written(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    assert (
        report_dir_problem(tmp_path / "file" / "a" / "b") == f"{str(tmp_path / 'file')!r} is not a directory"
    )
    assert report_dir_problem(tmp_path / "new" / "dir") is None
    assert not (tmp_path / "new").exists()  # checking creates nothing

    def refuse(*args, **kwargs):  # root may write anywhere: simulate a read-only location
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(report_module.tempfile, "TemporaryFile", refuse)
    assert report_dir_problem(tmp_path / "new") == (
        f"cannot create files in {str(tmp_path)!r} (PermissionError: Permission denied)"
    )


def test_log_false_logs_nothing_and_still_writes_the_report(tmp_path):
    monitor = MemoryMonitor(log=False)
    trainer = _trainer(tmp_path, [monitor], limit_val_batches=1, val_check_interval=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModel(), _loader(8), _loader(8))
    assert not [w for w in caught if "MemoryMonitor" in str(w.message)]  # no "no logger" warning either
    assert not os.path.exists(os.path.join(trainer.logger.log_dir, "metrics.csv"))  # nothing logged
    assert len(monitor.history) == 4 and len(monitor.val_history) == 2
    assert [p.name for p in monitor.report_paths] == ["memory_report.md", "memory_report.png"]
    assert monitor.report_paths[0].parent == tmp_path / "logs" / "version_0"


def test_logs_documented_keys_every_step_with_tracker_values(tmp_path, caplog):
    batch = 16
    monitor = MemoryMonitor(log_every_n_steps=1)
    trainer = _trainer(tmp_path / "a", [monitor])
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO):
        trainer.fit(TinyModel(), _loader(batch))

    rows = _csv_rows(trainer)
    assert set(rows[0]) == TRAIN_KEYS | BREAKDOWN_KEYS | {"step"}
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]  # every step, at trainer.global_step
    assert len(monitor.history) == 4
    for row, record in zip(rows, monitor.history):
        for phase in PHASES:
            assert float(row[f"memory/{phase}_peak_gib"]) == record[phase] / GIB
        top = max(PHASES, key=lambda p: record[p])
        assert float(row["memory/peak_gib"]) == record[top] / GIB
        for category in CATEGORIES:
            assert float(row[f"memory/peak_{category}_gib"]) == record[f"{top}_{category}"] / GIB
        assert sum(float(row[k]) for k in BREAKDOWN_KEYS) == pytest.approx(
            float(row["memory/peak_gib"]), rel=1e-12
        )

    # The same fit, measured by a MemoryTracker read directly at the same hooks: identical bytes.
    reference = ReferenceTracker()
    torch.manual_seed(0)
    _trainer(tmp_path / "b", [reference], logger=False).fit(TinyModel(), _loader(batch))
    assert len(reference.steps) == len(monitor.history)
    for record, expected in zip(monitor.history, reference.steps):
        for phase in PHASES:
            peak, breakdown = expected[phase]
            assert record[phase] == peak
            assert {c: record[f"{phase}_{c}"] for c in CATEGORIES} == breakdown

    # Bytes we know by hand: parameters always; SGD momentum from the first step on; activations saved by
    # the forward (the input of each Linear: x and the ReLU output, which ReLU itself saves).
    for step, record in enumerate(monitor.history):
        for phase in PHASES:
            assert record[f"{phase}_parameters"] == PARAM_BYTES
        assert record["forward_activations"] == batch * (32 + 64) * F32
        assert record["backward_gradients"] == PARAM_BYTES
        assert record["optimizer_optimizer_state"] == PARAM_BYTES
        assert record["forward_optimizer_state"] == (PARAM_BYTES if step else 0)

    # The report, next to metrics.csv.
    assert [p.name for p in monitor.report_paths] == ["memory_report.md", "memory_report.png"]
    assert all(p.parent == tmp_path / "a" / "logs" / "version_0" for p in monitor.report_paths)
    assert "## backward" in monitor.report_paths[0].read_text()
    printed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Memory: peak")]
    assert len(printed) == 1 and "memory_report.md" in printed[0]


def test_peaks_reset_per_logging_window(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=2)
    trainer = _trainer(tmp_path, [monitor], max_steps=6)

    class GrowingBatch(TinyModel):  # a batch that grows every step, so each window's max is its last
        def training_step(self, batch, batch_idx):
            x = batch[0].repeat(batch_idx + 1, 1)
            return self.net(x).pow(2).mean()

    trainer.fit(GrowingBatch(), _loader(8, n_batches=6))
    rows = _csv_rows(trainer)
    assert [int(r["step"]) for r in rows] == [2, 4, 6]
    history = list(monitor.history)
    for i, row in enumerate(rows):
        window = merge_records(history[2 * i : 2 * i + 2])
        assert float(row["memory/forward_peak_gib"]) == window["forward"] / GIB
        assert (
            float(row["memory/peak_activations_gib"])
            == window[f"{max(PHASES, key=window.get)}_activations"] / GIB
        )
    # Not run-to-date: the first window's forward peak is below the last one's.
    assert float(rows[0]["memory/forward_peak_gib"]) < float(rows[2]["memory/forward_peak_gib"])
    assert history[1]["forward_activations"] == 2 * 8 * (32 + 64) * F32


def test_validation_peak_in_its_own_key(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1)
    trainer = _trainer(tmp_path, [monitor], max_steps=4, limit_val_batches=2, val_check_interval=2)
    trainer.fit(TinyModel(), _loader(8), _loader(8))
    assert [r["step"] for r in monitor.val_history] == [2, 4]  # after 2 and 4 batches; not the sanity check
    val_rows = [r for r in _csv_rows(trainer) if r["memory/val_peak_gib"]]
    assert [float(r["memory/val_peak_gib"]) for r in val_rows] == [
        r["validation"] / GIB for r in monitor.val_history
    ]
    record = monitor.val_history[0]
    assert record["validation_activations"] == 0  # no_grad: nothing saved for backward
    assert record["validation_parameters"] == PARAM_BYTES
    assert "## validation" in monitor.report_paths[0].read_text()


def test_gradient_accumulation_has_no_optimizer_phase_on_accumulating_batches(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1)
    trainer = _trainer(tmp_path, [monitor], max_steps=2, accumulate_grad_batches=2)
    trainer.fit(TinyModel(), _loader(8))
    assert [r["optimizer"] > 0 for r in monitor.history] == [False, True, False, True]
    assert [int(r["step"]) for r in _csv_rows(trainer)] == [0, 1, 1, 2]


def test_no_logger_warns_once_and_fit_runs(tmp_path):
    monitor = MemoryMonitor()
    trainer = _trainer(tmp_path, [monitor], logger=False)
    with pytest.warns(UserWarning, match="MemoryMonitor: the Trainer has no logger") as record:
        trainer.fit(TinyModel(), _loader(8))
    assert len([w for w in record if "MemoryMonitor" in str(w.message)]) == 1
    assert len(monitor.history) == 4
    assert monitor.report_paths[0] == tmp_path / "memory_report.md"


def test_breakdown_never_logs_only_peaks(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1, breakdown="never", report=False)
    trainer = _trainer(tmp_path, [monitor], max_steps=1)
    trainer.fit(TinyModel(), _loader(8))
    assert set(_csv_rows(trainer)[0]) == TRAIN_KEYS | {"step"}
    assert set(monitor.history[0]) == {"step", "steps", *PHASES}
    assert monitor.report_paths == [] and not (tmp_path / "logs" / "version_0" / "memory_report.md").exists()


def test_tracker_exited_on_exception_and_keeps_nothing_alive(tmp_path):
    monitor = MemoryMonitor()
    model = TinyModel(fail_at=2)
    trainer = _trainer(tmp_path, [monitor], logger=False)
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.fit(model, _loader(8))
    assert _get_current_dispatch_mode_stack() == []  # no tracker left intercepting ops
    assert len(monitor.history) == 2
    assert monitor.report_paths == []  # fit did not end
    ref = weakref.ref(model.net[0].weight)
    del model, trainer
    gc.collect()
    assert ref() is None  # the callback holds no reference to the model or its tensors


@pytest.mark.parametrize("fail", [False, True], ids=["finished", "raised"])
def test_after_fit_nothing_stays_attached_or_holds_the_model(tmp_path, fail):
    monitor = MemoryMonitor(log_every_n_steps=1, report=False)
    model = TinyModel(fail_at=2 if fail else None)
    trainer = _trainer(tmp_path, [monitor], limit_val_batches=1, val_check_interval=2)
    if fail:
        with pytest.raises(RuntimeError, match="injected failure"):
            trainer.fit(model, _loader(8), _loader(8))
    else:
        trainer.fit(model, _loader(8), _loader(8))
    assert len(monitor.history) == (2 if fail else 4)
    assert _get_current_dispatch_mode_stack() == []
    assert not [k for k, v in vars(model).items() if type(v).__module__.startswith("lightning_memopt")]
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())  # the tracker's grad hooks
    torch.save(model, io.BytesIO())
    model_ref, trainer_ref = weakref.ref(model), weakref.ref(trainer)
    del model, trainer
    gc.collect()
    # The test still holds the callback: it keeps neither the model nor the Trainer alive.
    assert model_ref() is None and trainer_ref() is None


class FakeCuda(types.SimpleNamespace):
    """The allocator statistics of one CUDA device, set by the test."""

    def __init__(self):
        super().__init__(allocated=0, peak=0)

    def max_memory_allocated(self, device):
        return self.peak

    def memory_allocated(self, device):
        return self.allocated

    def reset_peak_memory_stats(self, device):
        self.peak = self.allocated


def _drive_one_step(monitor, cuda, peaks):
    """The hooks of one automatic-optimization step, with the allocator's peak set in each phase."""
    trainer = types.SimpleNamespace(log_every_n_steps=1, world_size=1, loggers=[], global_step=1)
    monitor.on_train_batch_start(trainer, None, None, 0)
    for phase, hook in zip(peaks, ("on_before_backward", "on_before_optimizer_step", None)):
        cuda.peak = peaks[phase]
        model = monitor._tracker._modules[0] if monitor._tracker else None
        if model is not None and phase == "forward":
            with torch.no_grad():
                model(torch.ones(2, 4)).sum()
        if hook:
            getattr(monitor, hook)(trainer, None, None)
    monitor.on_train_batch_end(trainer, None, None, None, 0)


@pytest.mark.parametrize("breakdown", ["auto", "always"])
def test_cuda_peaks_from_allocator(monkeypatch, breakdown):
    cuda = FakeCuda()
    monkeypatch.setattr(device_module.torch, "cuda", cuda)
    model = torch.nn.Linear(4, 4)
    monitor = MemoryMonitor(breakdown=breakdown)
    monitor._start(torch.device("cuda", 0), model, [torch.optim.SGD(model.parameters(), lr=0.1)])
    _drive_one_step(monitor, cuda, {"forward": 3000, "backward": 5000, "optimizer": 4000})
    record = monitor.history[0]
    assert (record["forward"], record["backward"], record["optimizer"]) == (3000, 5000, 4000)
    if breakdown == "auto":  # the allocator has no categories; no tracker runs
        assert monitor._tracker is None
        assert set(record) == {"step", "steps", *PHASES}
    else:  # the tracker runs alongside for the breakdown: Linear(4, 4) parameters; its input and output
        assert record["forward_parameters"] == 80
        assert record["forward_other"] == 2 * 4 * F32 + 2 * 4 * F32
        assert _get_current_dispatch_mode_stack() == []


class ShardedModel(TinyModel):
    """TinyModel under FSDP2: each Linear sharded over the two ranks (dim 0 splits evenly)."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def _distributed_worker(root, kind):
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    if kind == "ddp":
        strategy, model = DDPStrategy(process_group_backend="gloo"), TinyModel()
    else:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        model = ShardedModel()
    monitor = MemoryMonitor(log_every_n_steps=1, head="net.2")  # the last Linear as a head: timed
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=[monitor],
        logger=CSVLogger(root, name="logs"),
        max_steps=3,
        limit_val_batches=0,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    # Rank 1 gets twice the batch, so its activations, and its peaks, are larger.
    trainer.fit(model, _loader(8 * (rank + 1), n_batches=3))
    with open(os.path.join(root, f"history_{rank}.json"), "w") as f:
        json.dump(list(monitor.history), f)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_distributed_logs_max_over_ranks(tmp_path, kind):
    run_ranks(f"{__name__}:_distributed_worker", tmp_path, kind)
    histories = [json.loads((tmp_path / f"history_{rank}.json").read_text()) for rank in range(2)]
    assert all(r1["forward"] > r0["forward"] for r0, r1 in zip(*histories))
    rows = list(csv.DictReader(open(tmp_path / "logs" / "version_0" / "metrics.csv")))
    assert len(rows) == 3
    for row, r0, r1 in zip(rows, *histories):
        top = max(PHASES, key=r1.get)
        assert float(row["memory/peak_gib"]) == r1[top] / GIB
        assert float(row["memory/forward_peak_gib"]) == r1["forward"] / GIB
        assert float(row["memory/backward_peak_gib"]) == max(r0["backward"], r1["backward"]) / GIB
        assert float(row["memory/peak_activations_gib"]) == r1[f"{top}_activations"] / GIB
        for key in ("step", "head"):  # the slower rank's
            assert float(row[f"memory/{key}_seconds"]) == max(r0[f"{key}_us"], r1[f"{key}_us"]) / 1e6 > 0
    # Each rank holds all parameters under DDP, half of them under FSDP2.
    shard = 1 if kind == "ddp" else 2
    assert all(r["forward_parameters"] == PARAM_BYTES // shard for h in histories for r in h)
    if kind == "ddp":
        assert histories[1][0]["forward_activations"] == 16 * (32 + 64) * F32
    report = (tmp_path / "logs" / "version_0" / "memory_report.md").read_text()
    assert "largest over 2 ranks" in report


def test_resume_continues_history_and_windows(tmp_path):
    first = MemoryMonitor(log_every_n_steps=1, report=False)
    trainer = _trainer(tmp_path / "a", [first], max_steps=2)
    trainer.fit(TinyModel(), _loader(8))
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    assert first.state_dict()["batches"] == 2

    resumed = MemoryMonitor(log_every_n_steps=1)
    trainer = _trainer(tmp_path / "b", [resumed], max_steps=4)
    trainer.fit(TinyModel(), _loader(8), ckpt_path=tmp_path / "two.ckpt")
    assert [r["step"] for r in resumed.history] == [0, 1, 2, 3]
    assert list(resumed.history)[:2] == list(first.history)
    assert [int(r["step"]) for r in _csv_rows(trainer)] == [3, 4]
    assert "(4 steps)" in resumed.report_paths[0].read_text()


def test_manual_optimization_phases(tmp_path):
    class Manual(TinyModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            loss = self.net(batch[0]).pow(2).mean()
            self.manual_backward(loss)
            opt.step()

    monitor = MemoryMonitor(log_every_n_steps=1, report=False)
    _trainer(tmp_path, [monitor], max_steps=2, logger=False).fit(Manual(), _loader(8))
    first, second = monitor.history
    assert first["forward_activations"] == 8 * (32 + 64) * F32
    # From the second step on, the forward peak is at its start: last step's gradients and the momentum
    # are alive until opt.zero_grad() frees the gradients, which outweigh this forward's activations.
    assert second["forward"] == 3 * PARAM_BYTES and second["forward_activations"] == 0
    for record in (first, second):
        assert record["backward_gradients"] == PARAM_BYTES
        assert record["optimizer_optimizer_state"] == PARAM_BYTES
