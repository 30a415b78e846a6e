import lightning.pytorch as pl
import pytest
import torch

from lightning_memopt import AutoAccumulation, MicroBatchOOMError, OOMBackoff
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.testing import OOMInjector
from tests.batching.helpers import Net, assert_params_close, fit, oom, patch_regime


def injector(model: Net, max_size: int, phase: str = "forward") -> OOMInjector:
    """OOMs above ``max_size`` samples in the last layer, after BatchNorm and dropout have run."""
    return OOMInjector(model.net[-1], phase=phase, max_size=max_size)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_retry_equals_unsplit_sgd(tmp_path, phase):
    base = Net()
    fit(base, tmp_path=tmp_path)
    model = Net()
    callback = OOMBackoff()
    with injector(model, max_size=4, phase=phase) as oom_injector:
        trainer = fit(model, [callback], tmp_path=tmp_path)
    assert oom_injector.raised == 2  # 10 and 5 samples ran out of memory, then 3 fit
    assert callback.micro_batch_size == 3 and callback.engine.sizes.oom_retries == 2
    assert_params_close(model, base, rel=1e-6)
    assert model.step_losses == pytest.approx(base.step_losses, rel=1e-6)
    assert model.events == ["before_backward", "after_backward"] * 4
    metrics = trainer.callback_metrics
    assert float(metrics["batching/micro_batch_size"]) == 3
    assert float(metrics["batching/num_micro_batches"]) == 4
    assert float(metrics["batching/oom_retries"]) == 2


@pytest.mark.parametrize("callback_class", [OOMBackoff, AutoAccumulation])
def test_log_false_logs_nothing(tmp_path, callback_class):
    """``log=False`` holds although Lightning binds ``pl_module.log`` to every callback's ``log``."""
    model = Net()
    kwargs = {"micro_batch_size": 4} if callback_class is AutoAccumulation else {}
    callback = callback_class(log=False, **kwargs)
    trainer = fit(model, [callback], tmp_path=tmp_path)
    assert callback.log_metrics is False and callback.engine.log_metrics is False
    assert not [key for key in trainer.callback_metrics if key.startswith("batching/")]


def test_retry_equals_unsplit_adamw_bf16(tmp_path):
    base = Net("adamw")
    fit(base, tmp_path=tmp_path, precision="bf16-mixed")
    model = Net("adamw")
    with injector(model, max_size=4, phase="backward") as oom_injector:
        fit(model, [OOMBackoff()], tmp_path=tmp_path, precision="bf16-mixed")
    assert oom_injector.raised == 2
    # bf16 autocast rounds each micro-batch's activations differently from the whole batch's
    assert_params_close(model, base, rel=2e-3)  # measured 3.2e-4


def test_retry_with_batchnorm_and_dropout_equals_smaller_size_from_the_start(tmp_path):
    reference = Net(batchnorm=True, dropout=0.3)
    fit(reference, [AutoAccumulation(micro_batch_size=3)], tmp_path=tmp_path)
    # the OOM comes in the last layer: the failed attempts updated BatchNorm statistics and drew masks
    model = Net(batchnorm=True, dropout=0.3)
    with injector(model, max_size=4) as oom_injector:
        fit(model, [OOMBackoff()], tmp_path=tmp_path)
    assert oom_injector.raised == 2
    reference_state = reference.state_dict()
    assert reference_state.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference_state[name]), name


class ResetSize(pl.Callback):
    """Go back to whole batches after every step, so that every step runs out of memory once."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.live = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.callbacks[0].engine.sizes.tokens = None
        self.live.append(self.tracker.current)


def test_hundred_ooms_leak_nothing(tmp_path):
    lives = []
    for max_size in (10, 5):  # no OOM; one OOM in every step
        model = Net()
        with MemoryTracker(model) as tracker, injector(model, max_size, "backward") as oom_injector:
            recorder = ResetSize(tracker)
            fit(model, [OOMBackoff(), recorder], steps=100, tmp_path=tmp_path)
        lives.append(recorder.live)
        raised = oom_injector.raised
    assert raised == 100
    # live tensor bytes after 100 recoveries equal the run without any OOM, and never rise above it (an
    # attempt's leaked activations would add 960 bytes per step); the few bytes in between are the
    # scalars Lightning keeps for logged values, which differ with the number of micro-batches
    assert lives[1][-1] == lives[0][-1]
    assert max(lives[1]) <= max(lives[0])
    assert max(lives[1]) - min(lives[1]) < 64


@pytest.mark.parametrize("distributed", [False, True])
def test_oom_in_optimizer_step_retries(tmp_path, monkeypatch, distributed):
    """Distributed: one process posing as a rank; the first step at a size agrees after the optimizer step
    and retries (the 2-process tests in test_distributed.py check that the ranks stay equal)."""
    if distributed:
        patch_regime(monkeypatch, "is_distributed", lambda: True)
    base = Net()
    fit(base, tmp_path=tmp_path)
    model = Net()
    # the step runs out of memory when the last micro-batch was larger than 6 samples
    with OOMInjector(model.net[-1], phase="step", max_size=6) as oom_injector:
        fit(model, [OOMBackoff()], tmp_path=tmp_path)
    assert oom_injector.raised == 1
    assert model.seen_sizes[:3] == [10, 5, 5]  # the failed whole batch, then its retry as 2 x 5
    assert_params_close(model, base, rel=1e-6)


def test_other_errors_are_not_caught(tmp_path):
    class Broken(Net):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("shape mismatch in my model")

    with pytest.raises(RuntimeError, match="shape mismatch in my model"):
        fit(Broken(), [OOMBackoff()], tmp_path=tmp_path)


def test_a_fit_that_raised_leaves_the_strategy_unwrapped(tmp_path):
    """Lightning calls ``on_exception``, not ``teardown``, when fit raises: the engine must still go."""
    from torch.utils.data import DataLoader

    from tests.batching.helpers import dataset, quiet_trainer

    class FailsOnSecondStep(Net):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise ValueError("broken batch")
            return super().training_step(batch, batch_idx)

    model = FailsOnSecondStep()
    callbacks = [AutoAccumulation(micro_batch_size=3), OOMBackoff()]
    trainer = quiet_trainer(callbacks, max_steps=4, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="broken batch"):
        trainer.fit(model, DataLoader(dataset(), batch_size=10))
    hooks = ("training_step", "backward", "optimizer_step", "validation_step", "test_step", "predict_step")
    assert [name for name in hooks if name in vars(trainer.strategy)] == []
    assert "optimizer_zero_grad" not in vars(model)
    assert not callbacks[0].engine.installed and callbacks[1].engine is callbacks[0].engine
    # a teardown after on_exception (or a second on_exception) does not uninstall another user's install
    for callback in callbacks:
        callback.teardown(trainer, model, "fit")
    assert not callbacks[0].engine.installed


def test_one_sample_per_micro_batch_raises_with_checklist(tmp_path):
    model = Net()
    with (
        injector(model, max_size=0) as oom_injector,
        pytest.raises(MicroBatchOOMError, match="one sample per micro-batch") as info,
    ):
        fit(model, [OOMBackoff()], tmp_path=tmp_path)
    message = str(info.value)
    for item in ("bf16-mixed", "AutoCheckpoint", "ModelParallelStrategy", "Offload"):
        assert item in message
    assert "BatchNormToGroupNorm" not in message  # the model has no BatchNorm to swap
    assert "parameters" in message and "optimizer state" in message
    assert oom_injector.raised == 5  # 10, 5, 3, 2, 1


def test_the_error_reports_the_memory_of_the_micro_batch_that_failed(tmp_path):
    """Sized by a memory model, the first steps train whole (10); from the third step every size runs out of
    memory: the error's report names the micro-batch that failed (1), not the size last trained."""
    model = Net()
    trainer_of = []
    oom_injector = OOMInjector(
        model.net[-1], max_size=0, steps=range(2, 9), step_fn=lambda: trainer_of[0].global_step
    )

    class Keep(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            trainer_of.append(trainer)

    with oom_injector, pytest.raises(MicroBatchOOMError, match="one sample per micro-batch") as info:
        fit(
            model,
            [Keep(), AutoAccumulation(max_memory="1GiB", exactness="off"), OOMBackoff()],
            tmp_path=tmp_path,
        )
    assert "Memory of the failed step (micro-batch size 1):" in str(info.value)
    assert trainer_of[0].global_step == 2 and oom_injector.raised == 5  # 10, 5, 3, 2, 1


def test_batchnorm_stops_at_two_samples_with_advice(tmp_path):
    # Backing off to one sample would make torch raise "Expected more than 1 value per channel".
    model = Net(batchnorm=True)
    with (
        injector(model, max_size=0) as oom_injector,
        pytest.raises(
            MicroBatchOOMError, match=r"(?s)with 2 samples per micro-batch, the fewest .*BatchNormToGroupNorm"
        ),
    ):
        fit(model, [OOMBackoff()], tmp_path=tmp_path)
    assert oom_injector.raised == 4  # 10, 5, 3, 2
    # an odd batch at size 2 runs as [2, 2, 3]: never a micro-batch of one sample
    model = Net(batchnorm=True)
    with injector(model, max_size=3):
        fit(model, [OOMBackoff()], steps=1, batch=7, tmp_path=tmp_path)
    assert model.seen_sizes == [7, 3, 4, 2, 2, 3]  # 7, and 4 after its first micro-batch of 3, ran out


def test_checklist_names_only_real_options():
    import inspect
    import re

    from lightning_memopt import AutoCheckpoint
    from lightning_memopt.batching.errors import checklist

    params = inspect.signature(AutoCheckpoint).parameters
    calls = re.findall(r"AutoCheckpoint\(([^)]*)\)", checklist())
    assert calls.count("") == 1 and len(calls) == 3
    for call in filter(None, calls):
        name, value = call.split("=")
        assert name in params, f"AutoCheckpoint has no option {name!r}"
        AutoCheckpoint(**{name: eval(value)})  # accepted


def test_resume_continues_exactly(tmp_path):
    """grow_after counts clean steps across a checkpoint: resuming equals the uninterrupted run."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(ckpt_path=None):
        model = Net()
        callback = OOMBackoff(grow_after=3)
        sizes = []

        class Sizes(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                sizes.append(callback.micro_batch_size)

        # one OOM, in step 2: the run backs off to 5, then grows after 3 clean steps (3, 4, 5)
        oom_once = OOMInjector(model.net[-1], max_size=5, steps={2}, step_fn=lambda: model.global_step)
        saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)  # after step 3
        with oom_once:
            fit(model, [callback, Sizes(), saver], steps=8, ckpt_path=ckpt_path, enable_checkpointing=True)
        return model, sizes, callback

    full, full_sizes, full_callback = run()
    assert full_sizes == [None, None, 5, 5, 5, 9, 9, 9]  # grows to 9: 10 failed
    resumed, resumed_sizes, callback = run(ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"))
    assert resumed_sizes == full_sizes[4:]
    assert callback.state_dict() == full_callback.state_dict()
    assert_params_close(resumed, full, rel=0.0)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="grow_after must be a positive int"):
        OOMBackoff(grow_after=0)
    with pytest.raises(ValueError, match="overlap_after must be an int >= 0"):
        OOMBackoff(overlap_after=-1)


@pytest.mark.parametrize("fails", [False, True])
def test_nothing_keeps_the_trainer_or_model_alive(tmp_path, fails):
    import gc
    import weakref

    from torch.utils.data import DataLoader

    from tests.batching.helpers import dataset, quiet_trainer

    class Failing(Net):
        def training_step(self, batch, batch_idx):
            if fails and batch_idx == 1:
                raise ValueError("the user's bug")
            return super().training_step(batch, batch_idx)

    model = Failing()
    callbacks = [AutoAccumulation(micro_batch_size=5), OOMBackoff()]  # kept, as a user may keep them
    trainer = quiet_trainer(callbacks, max_steps=2, default_root_dir=tmp_path)
    with (
        injector(model, max_size=3),
        pytest.raises(ValueError, match="the user's bug") if fails else _none() as info,
    ):
        trainer.fit(model, DataLoader(dataset(), batch_size=10))
    alive = weakref.ref(trainer), weakref.ref(model)
    del trainer, model, info
    gc.collect()
    assert [ref() for ref in alive] == [None, None]
    assert callbacks[1].engine.sizes.oom_retries == 1  # what happened stays readable


def _none():
    import contextlib

    return contextlib.nullcontext()


def test_logged_keys(tmp_path):
    model = Net()
    trainer = fit(model, [OOMBackoff()], steps=1, tmp_path=tmp_path)
    keys = sorted(k for k in trainer.callback_metrics if "/" in k)
    assert keys == ["batching/micro_batch_size", "batching/num_micro_batches", "batching/oom_retries"]


def test_the_measured_step_time_is_logged_every_n_steps(tmp_path, monkeypatch):
    """``batching/step_seconds``: the mean wall-clock seconds between training steps' ends since the last
    log, logged every ``log_every_n_steps`` (here 2); none at step 0, where no step ended before."""
    import lightning_memopt.batching.engine as engine_module

    clock = iter(float(t) for t in (0, 3, 7, 12, 18))  # step ends: intervals 3, 4, 5, 6 seconds
    monkeypatch.setattr(engine_module, "perf_counter", lambda: next(clock))
    logged = []
    original = pl.LightningModule.log

    def log(self, name, value, *args, **kwargs):
        if name == "batching/step_seconds":
            logged.append((self.trainer.global_step, value))
        return original(self, name, value, *args, **kwargs)

    monkeypatch.setattr(pl.LightningModule, "log", log)
    fit(Net(), [OOMBackoff()], steps=5, tmp_path=tmp_path, log_every_n_steps=2)
    assert logged == [(2, 3.5), (4, 5.5)]  # steps 1-2: (3 + 4) / 2; steps 3-4: (5 + 6) / 2


def test_accumulate_grad_batches_is_refused(tmp_path):
    with pytest.raises(Exception, match=r"accumulate_grad_batches=2 with micro-batching.*batch_size \* 2"):
        fit(Net(), [OOMBackoff()], tmp_path=tmp_path, accumulate_grad_batches=2)


def test_manual_optimization_is_refused(tmp_path):
    class Manual(Net):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(Exception, match="needs automatic optimization"):
        fit(Manual(), [OOMBackoff()], tmp_path=tmp_path)


def test_retry_with_grad_scaler(tmp_path):
    """16-mixed with a GradScaler: each micro-batch loss is scaled, and retries leave the scale alone."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugin():
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))

    base = Net("adamw")
    base_trainer = fit(base, tmp_path=tmp_path, plugins=[plugin()])
    model = Net("adamw")
    with injector(model, max_size=4, phase="backward") as oom_injector:
        trainer = fit(model, [OOMBackoff()], tmp_path=tmp_path, plugins=[plugin()])
    assert oom_injector.raised == 2
    assert trainer.precision_plugin.scaler.get_scale() == base_trainer.precision_plugin.scaler.get_scale()
    assert_params_close(model, base, rel=5e-4)  # fp16 autocast rounding; measured 5.9e-5


def test_overlap_mode_oom_in_the_last_micro_batch_raises(tmp_path, monkeypatch):
    """The overlap path, in one process posing as a DDP rank: an OOM after the sync point is an error."""
    import types

    import lightning_memopt.batching.regime as regime_module

    patch_regime(monkeypatch, "is_distributed", lambda: True)
    monkeypatch.setattr(regime_module, "any_rank", lambda flag, device=None: bool(flag))
    monkeypatch.setattr(regime_module, "ddp_module", lambda strategy: types.SimpleNamespace())
    model = Net()
    calls = []

    def fail_fourth_forward(module, args):
        calls.append(len(args[0]))
        if len(calls) == 4:  # the last of [2, 2, 3, 3]
            raise oom("last micro-batch")

    model.net[-1].register_forward_pre_hook(fail_fourth_forward)
    with pytest.raises(MicroBatchOOMError, match="while DDP synchronizes gradients during backward"):
        fit(model, [AutoAccumulation(micro_batch_size=3), OOMBackoff(overlap_after=0)], tmp_path=tmp_path)
    assert calls == [2, 2, 3, 3]


def test_fsdp2_overlap_mode_oom_raises(tmp_path, monkeypatch):
    """FSDP2 once stable with overlap_after, in one process posing as a rank: no sync point ran, so an OOM
    is an error, and no collective was asked for."""
    import lightning_memopt.batching.regime as regime_module

    agreements = []
    patch_regime(monkeypatch, "is_distributed", lambda: True)
    monkeypatch.setattr(regime_module, "any_rank", lambda flag, device=None: agreements.append(flag) or flag)
    patch_regime(monkeypatch, "find_sharding", lambda model: regime_module.Sharding([torch.nn.Linear(1, 1)]))
    model = Net()
    with (
        OOMInjector(model.net[-1], steps={1}, step_fn=lambda: model.trainer.global_step),
        pytest.raises(MicroBatchOOMError, match=r"under FSDP2 after 1 clean steps .*overlap_after=1"),
    ):
        fit(model, [OOMBackoff(overlap_after=1)], tmp_path=tmp_path)
    # step 0 only (sync points on): on the loss, before FSDP's final callback, the training agreement and
    # the optimizer-step one (the first step at a size); step 1 asked for none before it raised
    assert agreements == [False, False, False, False]


def test_training_step_returning_none_is_refused(tmp_path):
    class Skips(Net):
        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(Exception, match="training_step returned None .* of a batch that runs as several"):
        fit(Skips(), [AutoAccumulation(micro_batch_size=3)], tmp_path=tmp_path)


def test_distributed_optimizer_step_oom_once_stable_raises(tmp_path, monkeypatch):

    patch_regime(monkeypatch, "is_distributed", lambda: True)
    model = Net()
    with (
        OOMInjector(phase="step", steps={2}, step_fn=lambda: model.trainer.global_step),
        pytest.raises(MicroBatchOOMError, match="at a micro-batch size that had already stepped cleanly"),
    ):
        fit(model, [OOMBackoff()], tmp_path=tmp_path)
    assert model.trainer.global_step == 2


def test_validation_oom_at_one_sample_raises(tmp_path):
    class AlwaysOOM(Net):
        def validation_step(self, batch, batch_idx):
            raise oom("validation")

    from torch.utils.data import DataLoader

    from tests.batching.helpers import dataset

    trainer = pl.Trainer(
        accelerator="cpu",
        callbacks=[OOMBackoff()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(MicroBatchOOMError, match="out of memory in validation_step with one sample"):
        trainer.validate(AlwaysOOM(), DataLoader(dataset(), batch_size=10))


@pytest.mark.parametrize("cls", [OOMBackoff, AutoAccumulation])
def test_log_must_be_a_bool(cls):
    # 'no' is truthy: it used to log silently.
    with pytest.raises(TypeError, match="log must be True or False, got 'no'; pass a bool, e.g. log=False"):
        cls(log="no")
