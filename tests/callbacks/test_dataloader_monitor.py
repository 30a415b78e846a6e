"""DataLoaderMonitor on real fits with a fake clock: exact logged times, the warning text, the pickling
culprit, tuning that keeps the sample order, and nothing left attached after fit."""

import functools
import gc
import logging
import pickle
import warnings
import weakref

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from lightning_memopt import DataLoaderMonitor, MemoryMonitor
from lightning_memopt.callbacks import dataloader_monitor as monitor_module
from lightning_memopt.data import StepTimes, batch_cost
from lightning_memopt.data import tune as tune_module
from tests.batching.helpers import quiet_trainer
from tests.data.helpers import CostlyItems, FakeClock
from tests.data.test_pickling import Transformed

ITEM = 1 / 128  # fake seconds per __getitem__
COMPUTE = 1 / 64  # fake seconds per training step
TRANSFER = 1 / 256  # fake seconds per transfer_batch_to_device


class Capture(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def name(self):
        return "capture"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass


class LoaderNet(pl.LightningModule):
    """A linear model whose step and transfer advance a fake clock; records the sample indices it sees."""

    def __init__(self, clock=None, compute=0.0, transfer=0.0, loader=None, val_loader=None):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.clock, self.compute, self.transfer = clock, compute, transfer
        self.loader, self.val_loader = loader, val_loader
        self.seen = []

    def _advance(self, seconds):
        if self.clock is not None:
            self.clock.advance(seconds)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self._advance(self.transfer)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[:, 0].long().tolist())
        self._advance(self.compute)
        return self.layer(batch).sum()

    def validation_step(self, batch, batch_idx):
        self._advance(100.0)  # validation must not count as waiting

    def train_dataloader(self):
        return self.loader if self.loader is not None else DataLoader(CostlyItems(), batch_size=4)

    def val_dataloader(self):
        return self.val_loader

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(monitor_module, "step_clock", lambda device: fake)
    monkeypatch.setattr(monitor_module, "cores_per_rank", lambda ranks_per_node=1: 4)
    monkeypatch.setattr(monitor_module, "batch_cost", functools.partial(batch_cost, clock=lambda: fake.now))
    return fake


def _monitor_warnings(caught):
    return [str(w.message) for w in caught if str(w.message).startswith("DataLoaderMonitor")]


def _fit(monitor, model, loader, *, steps=9, logger=None, **kwargs):
    trainer = quiet_trainer([monitor], max_steps=steps, logger=logger or False, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader)
    return trainer, _monitor_warnings(caught)


def test_slow_items_log_exact_times_and_name_num_workers(clock):
    logger = Capture()
    monitor = DataLoaderMonitor(window=4, log_every_n_steps=2)
    model = LoaderNet(clock, compute=COMPUTE, transfer=TRANSFER)
    _, warned = _fit(monitor, model, DataLoader(CostlyItems(clock, ITEM), batch_size=4), logger=logger)

    wait, fraction = 4 * ITEM, (4 * ITEM + TRANSFER) / (4 * ITEM + TRANSFER + COMPUTE)  # 9/13
    expected = {
        "data/wait_ms": wait * 1e3,
        "data/transfer_ms": TRANSFER * 1e3,
        "data/compute_ms": COMPUTE * 1e3,
        "data/wait_fraction": fraction,
    }
    logged = [(step, m) for step, m in logger.calls if any(k.startswith("data/") for k in m)]
    assert [step for step, _ in logged] == [2, 4, 6, 8]
    for _, metrics in logged:
        assert metrics == pytest.approx(expected, rel=1e-12)
    # the first step (its batch came with the loader's start) is not timed: 8 of 9 steps
    # (the batch loaded once to measure its cost, when first flagged, is not counted as a wait)
    assert (monitor.times.steps, monitor.times.wait) == (8, pytest.approx(8 * wait, rel=1e-12))
    # one settle (a device sync on CUDA) per read: at each log (batches 2, 4, 6, 8) and at each window
    # end that is not a log (5, 9)
    assert clock.settles == 6
    assert len(warned) == 1
    assert warned[0].startswith("DataLoaderMonitor: the training loop is data-bound: 69% of its time")
    assert "num_workers=0 -> 2 (one batch costs 31.2 ms to load in one process against 15.6 ms" in warned[0]
    assert "persistent_workers" not in warned[0]  # one epoch: the workers never restart
    assert [f.setting for f in monitor.diagnosis.fixes] == ["num_workers"]
    assert monitor.summary_line() == "data: data-bound, wait fraction 0.69 over 8 steps; fix: num_workers=2"
    assert "transfer_batch_to_device" not in model.__dict__  # the timing wrapper is gone after fit


def test_num_workers_follow_the_measured_batch_cost_once(clock, monkeypatch):
    calls = []
    monkeypatch.setattr(monitor_module, "batch_cost", lambda loader: calls.append(loader) or 0.0625)
    monitor = DataLoaderMonitor(window=4)
    loader = DataLoader(CostlyItems(clock, ITEM), batch_size=4)
    _, warned = _fit(monitor, LoaderNet(clock, compute=COMPUTE), loader)
    assert calls == [loader]  # measured once, on the training DataLoader, when first flagged
    # 62.5 ms measured (not the 31.25 ms the waits show) against 15.625 ms of compute: 4 workers
    assert "num_workers=0 -> 4 (one batch costs 62.5 ms to load in one process" in warned[0]


def test_fast_loader_is_not_flagged(clock):
    monitor = DataLoaderMonitor(window=4)
    _, warned = _fit(
        monitor, LoaderNet(clock, compute=COMPUTE), DataLoader(CostlyItems(clock, 0.0), batch_size=4)
    )
    assert warned == []
    assert monitor.diagnosis is not None and not monitor.diagnosis.data_bound
    assert monitor.times.wait_fraction == 0.0
    assert monitor.summary_line() == "data: not data-bound, wait fraction 0.00 over 8 steps"


class SlowHooks(pl.Callback):
    """Another callback whose batch-end hook takes time: it runs between steps, inside the wait."""

    def __init__(self, clock):
        self.clock = clock

    def on_train_batch_end(self, *args):
        self.clock.advance(4 * ITEM)


def test_waits_outside_the_dataloader_are_measured_but_not_blamed_on_it(clock):
    monitor = DataLoaderMonitor(window=4)
    trainer = quiet_trainer([monitor, SlowHooks(clock)], max_steps=9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LoaderNet(clock, compute=COMPUTE), DataLoader(CostlyItems(clock, 0.0), batch_size=4))
    assert monitor.times.wait_fraction == pytest.approx(2 / 3, rel=1e-12)  # measured as it is
    assert _monitor_warnings(caught) == []  # loading a batch (measured) costs nothing here
    assert monitor.diagnosis.outside_loader and not monitor.diagnosis.data_bound
    assert monitor.summary_line().endswith("(spent outside the DataLoader)")


def test_epochs_and_validation_several_epochs_ask_for_persistent_workers(clock):
    # 2 batches per epoch, 4 epochs, validation (100 fake seconds each) after every epoch and a sanity check
    val = DataLoader(CostlyItems(clock, ITEM, n=4), batch_size=4)
    model = LoaderNet(clock, compute=COMPUTE, val_loader=val)
    monitor = DataLoaderMonitor(window=3)
    _, warned = _fit(
        monitor,
        model,
        DataLoader(CostlyItems(clock, ITEM, n=8), batch_size=4),
        steps=-1,
        max_epochs=4,
        limit_val_batches=1,
        num_sanity_val_steps=1,
    )
    assert len(model.seen) == 8
    assert monitor.times.steps == 7
    assert monitor.times.wait == pytest.approx(7 * 4 * ITEM, rel=1e-12)  # no validation second in it
    assert monitor.times.compute == pytest.approx(7 * COMPUTE, rel=1e-12)
    assert len(warned) == 1 and "persistent_workers=False -> True" in warned[0]


def test_an_unpicklable_dataset_under_spawn_is_named_before_any_worker_starts(clock):
    loader = DataLoader(
        Transformed(lambda x: x), batch_size=2, num_workers=1, multiprocessing_context="spawn"
    )
    model = LoaderNet(clock)
    with pytest.raises(pickle.PicklingError, match=r"'spawn' start method .* dataset\.transform is a lambda"):
        quiet_trainer([DataLoaderMonitor()], max_steps=1).fit(model, loader)
    assert model.seen == [] and "transfer_batch_to_device" not in model.__dict__


@pytest.mark.parametrize("source", ["module", "datamodule"])
def test_loaders_from_hooks_are_checked_when_requested_and_the_hook_is_restored(clock, source):
    loader = DataLoader(
        Transformed(lambda x: x), batch_size=2, num_workers=1, multiprocessing_context="forkserver"
    )
    model = LoaderNet(clock, loader=loader)
    datamodule = pl.LightningDataModule.from_datasets(Transformed(lambda x: x), batch_size=2, num_workers=1)
    datamodule.train_dataloader = lambda: loader  # the hook returns the unpicklable loader
    owner = model if source == "module" else datamodule
    before = dict(owner.__dict__)
    with pytest.raises(
        pickle.PicklingError, match=r"'forkserver' start method .* dataset\.transform is a lambda"
    ):
        trainer = quiet_trainer([DataLoaderMonitor()], max_steps=1)
        trainer.fit(model) if source == "module" else trainer.fit(model, datamodule=datamodule)
    assert ("train_dataloader" in owner.__dict__) == ("train_dataloader" in before)
    assert owner.__dict__.get("train_dataloader") is before.get("train_dataloader")
    assert "transfer_batch_to_device" not in model.__dict__


def test_tune_keeps_the_sample_order_and_sets_the_fastest(clock, monkeypatch):
    monkeypatch.setattr(tune_module, "cores_per_rank", lambda ranks_per_node=1: 1)  # candidates 0 and 1

    def run(tune):
        pl.seed_everything(7, verbose=False)
        loader = DataLoader(CostlyItems(n=32), batch_size=4, shuffle=True)
        model = LoaderNet()
        monitor = DataLoaderMonitor(tune=tune, tune_batches=3)
        trainer = quiet_trainer([monitor], max_steps=6)
        trainer.fit(model, loader)
        return model.seen, monitor, trainer

    seen_plain, _, _ = run(False)
    seen_tuned, monitor, trainer = run(True)
    assert seen_tuned == seen_plain
    (result,) = monitor.tune_results
    assert [row.num_workers for row in result.rows] == [0, 1]
    assert trainer.train_dataloader.num_workers == result.best


def test_memory_monitor_summary_gets_the_data_line(clock, tmp_path, caplog):
    monitor = DataLoaderMonitor(window=4)
    callbacks = [MemoryMonitor(dirpath=tmp_path), monitor]
    trainer = quiet_trainer(callbacks, max_steps=5)
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(LoaderNet(clock, compute=COMPUTE), DataLoader(CostlyItems(clock, ITEM), batch_size=4))
    (printed,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Memory: peak")]
    assert printed.endswith("\n  data: data-bound, wait fraction 0.67 over 4 steps; fix: num_workers=2")


def test_nothing_is_left_attached_or_alive_after_fit(clock):
    monitor = DataLoaderMonitor(window=4)
    model = LoaderNet(clock, compute=COMPUTE)
    loader = DataLoader(CostlyItems(clock, ITEM), batch_size=4)
    trainer, _ = _fit(monitor, model, loader)
    assert monitor.times.steps == 8 and "transfer_batch_to_device" not in model.__dict__
    model_ref, loader_ref = weakref.ref(model.layer.weight), weakref.ref(loader)
    del model, trainer, loader
    monitor.__dict__.pop("log", None), monitor.__dict__.pop("log_dict", None)  # Lightning binds these
    gc.collect()
    assert model_ref() is None and loader_ref() is None  # the monitor holds neither


def test_state_dict_round_trip():
    monitor = DataLoaderMonitor()
    monitor.times.add(StepTimes(steps=3, wait=0.5, transfer=0.25, compute=1.0, max_wait=0.25))
    monitor._warned = True
    other = DataLoaderMonitor()
    other.load_state_dict(monitor.state_dict())
    assert other.times == monitor.times and other._warned
    assert DataLoaderMonitor().summary_line() == "data: not measured (no timed training steps)"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": 0}, r"threshold must be a fraction in \(0, 1\), got 0;"),
        ({"threshold": 1.0}, r"threshold must be a fraction in \(0, 1\), got 1.0"),
        ({"threshold": True}, r"threshold must be a fraction in \(0, 1\), got True"),
        ({"threshold": "0.1"}, r"threshold must be a fraction in \(0, 1\), got '0.1'"),
        ({"window": 0}, "window must be a positive int, got 0"),
        ({"window": 2.5}, "window must be a positive int, got 2.5"),
        ({"window": None}, "window must be a positive int, got None"),
        ({"tune_batches": 0}, "tune_batches must be a positive int, got 0"),
        ({"log_every_n_steps": -1}, "log_every_n_steps must be a positive int, got -1"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataLoaderMonitor(**kwargs)


def test_tune_must_be_a_bool():
    with pytest.raises(
        TypeError, match="tune must be True or False, got 'yes'; pass a bool, e.g. tune=False"
    ):
        DataLoaderMonitor(tune="yes")


def test_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_memopt.DataLoaderMonitor\n"
        "      init_args:\n        threshold: 0.25\n        window: 8\n        tune: true\n"
    )
    cli = LightningCLI(LoaderNet, args=["--config", str(config)], run=False, save_config_callback=None)
    (monitor,) = [c for c in cli.trainer.callbacks if isinstance(c, DataLoaderMonitor)]
    assert (monitor.threshold, monitor.window, monitor.tune) == (0.25, 8, True)


def test_log_false_logs_nothing_and_still_diagnoses(clock):
    logger = Capture()
    monitor = DataLoaderMonitor(window=4, log_every_n_steps=2, log=False)
    model = LoaderNet(clock, compute=COMPUTE, transfer=TRANSFER)
    _, warned = _fit(monitor, model, DataLoader(CostlyItems(clock, ITEM), batch_size=4), logger=logger)
    assert [m for _, m in logger.calls if any(k.startswith("data/") for k in m)] == []
    assert len(warned) == 1 and monitor.times.steps == 8  # measured and judged all the same


def test_log_must_be_a_bool():
    with pytest.raises(TypeError, match="log must be True or False, got 'no'; pass a bool, e.g. log=False"):
        DataLoaderMonitor(log="no")
