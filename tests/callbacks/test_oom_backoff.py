import lightning.pytorch as pl
import pytest
import torch

from lightning_memopt import AutoAccumulation, OOMBackoff
from lightning_memopt.batching.engine import MicroBatchOOMError
from lightning_memopt.memory import MemoryTracker
from tests.batching.helpers import CapSize, Net, assert_params_close, fit, oom


def capped(model: Net, max_size: int, phase: str = "forward") -> Net:
    """Put a size cap before the last layer (after BatchNorm and dropout): ``model.net[-2]``."""
    layers = list(model.net)
    layers.insert(len(layers) - 1, CapSize(max_size, phase))
    model.net = torch.nn.Sequential(*layers)
    return model


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_retry_equals_unsplit_sgd(tmp_path, phase):
    base = Net()
    fit(base, tmp_path=tmp_path)
    model = capped(Net(), max_size=4, phase=phase)
    callback = OOMBackoff()
    trainer = fit(model, [callback], tmp_path=tmp_path)
    assert model.net[-2].raised == 2  # 10 and 5 samples ran out of memory, then 3 fit
    assert callback.micro_batch_size == 3 and callback.engine.oom_retries == 2
    assert_params_close(model, base, rel=1e-6)
    assert model.step_losses == pytest.approx(base.step_losses, rel=1e-6)
    assert model.events == ["before_backward", "after_backward"] * 4
    metrics = trainer.callback_metrics
    assert float(metrics["memopt/micro_batch_size"]) == 3
    assert float(metrics["memopt/num_micro_batches"]) == 4
    assert float(metrics["memopt/oom_retries"]) == 2


def test_retry_equals_unsplit_adamw_bf16(tmp_path):
    base = Net("adamw")
    fit(base, tmp_path=tmp_path, precision="bf16-mixed")
    model = capped(Net("adamw"), max_size=4, phase="backward")
    fit(model, [OOMBackoff()], tmp_path=tmp_path, precision="bf16-mixed")
    assert model.net[-2].raised == 2
    # bf16 autocast rounds each micro-batch's activations differently from the whole batch's
    assert_params_close(model, base, rel=2e-2)


def test_retry_with_batchnorm_and_dropout_equals_smaller_size_from_the_start(tmp_path):
    reference = Net(batchnorm=True, dropout=0.3)
    fit(reference, [AutoAccumulation(micro_batch_size=3)], tmp_path=tmp_path)
    # the cap sits after BatchNorm and dropout: the failed attempts updated statistics and drew masks
    model = capped(Net(batchnorm=True, dropout=0.3), max_size=4)
    fit(model, [OOMBackoff()], tmp_path=tmp_path)
    assert model.net[-2].raised == 2
    reference_state = dict(reference.net.named_parameters()) | dict(reference.net.named_buffers())
    state = {k.replace("5.", "4.") if k.startswith("5.") else k: v for k, v in model.net.named_parameters()}
    state |= dict(model.net.named_buffers())
    assert reference_state.keys() == state.keys()
    for name, value in reference_state.items():
        assert torch.equal(state[name], value), name


class ResetSize(pl.Callback):
    """Go back to whole batches after every step, so that every step runs out of memory once."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.live = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.callbacks[0].engine.micro_batch_size = None
        self.live.append(self.tracker.current)


def test_hundred_ooms_leak_nothing(tmp_path):
    lives = []
    for max_size in (10, 5):  # no OOM; one OOM in every step
        model = capped(Net(), max_size=max_size, phase="backward")
        with MemoryTracker(model) as tracker:
            recorder = ResetSize(tracker)
            fit(model, [OOMBackoff(), recorder], steps=100, tmp_path=tmp_path)
        lives.append(recorder.live)
        raised = model.net[-2].raised
    assert raised == 100
    # live tensor bytes after 100 recoveries equal the run without any OOM, and never rise above it (an
    # attempt's leaked activations would add 960 bytes per step); the few bytes in between are the
    # scalars Lightning keeps for logged values, which differ with the number of micro-batches
    assert lives[1][-1] == lives[0][-1]
    assert max(lives[1]) <= max(lives[0])
    assert max(lives[1]) - min(lives[1]) < 64


class OOMInStep(pl.Callback):
    def __init__(self, max_size):
        self.max_size, self.raised, self.size = max_size, 0, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.size = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        engine = trainer.callbacks[0].engine
        if (engine.micro_batch_size or 10) > self.max_size:
            self.raised += 1
            raise oom("optimizer step")


def test_oom_in_optimizer_step_retries(tmp_path):
    base = Net()
    fit(base, tmp_path=tmp_path)
    model = Net()
    step_oom = OOMInStep(max_size=6)
    fit(model, [OOMBackoff(), step_oom], tmp_path=tmp_path)
    assert step_oom.raised == 1
    assert model.seen_sizes[:3] == [10, 5, 5]  # the failed whole batch, then its retry as 2 x 5
    assert_params_close(model, base, rel=1e-6)


def test_other_errors_are_not_caught(tmp_path):
    class Broken(Net):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("shape mismatch in my model")

    with pytest.raises(RuntimeError, match="shape mismatch in my model"):
        fit(Broken(), [OOMBackoff()], tmp_path=tmp_path)


def test_one_sample_per_micro_batch_raises_with_checklist(tmp_path):
    model = capped(Net(), max_size=0)
    with pytest.raises(MicroBatchOOMError, match="one sample per micro-batch") as info:
        fit(model, [OOMBackoff()], tmp_path=tmp_path)
    message = str(info.value)
    for item in ("bf16-mixed", "AutoCheckpoint", "BatchNormToGroupNorm", "ModelParallelStrategy", "Offload"):
        assert item in message
    assert "parameters" in message and "optimizer state" in message
    assert model.net[-2].raised == 5  # 10, 5, 3, 2, 1


def test_grow_after(tmp_path):
    model = Net()
    callback = OOMBackoff(grow_after=2)
    sizes = []

    class Shrink(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            sizes.append(callback.micro_batch_size)

    engine_setup = AutoAccumulation(micro_batch_size=2)
    fit(model, [callback, engine_setup, Shrink()], steps=4, tmp_path=tmp_path)
    # started at 2 (AutoAccumulation's size caps growth): no growth beyond it
    assert sizes == [2, 2, 2, 2]


def test_grow_back_after_clean_steps(tmp_path):
    model = capped(Net(), max_size=4)
    callback = OOMBackoff(grow_after=1)
    fit(model, [callback], steps=3, tmp_path=tmp_path)
    # 10 -> 5 -> 3 fits; growing is capped below the smallest failed size (5): 4
    assert callback.micro_batch_size == 4
    assert callback.engine.oom_retries == 2


def test_validation_oom_halves_eval_micro_batch(tmp_path):
    class CapEval(Net):
        def validation_step(self, batch, batch_idx):
            if len(batch[0]) > 4:
                raise oom("validation")
            return super().validation_step(batch, batch_idx)

    model = CapEval()
    callback = OOMBackoff()
    from torch.utils.data import DataLoader

    from tests.batching.helpers import dataset

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    trainer.validate(model, DataLoader(dataset(), batch_size=10))
    assert callback.engine.eval_micro_batch_size == 3
    # the logged validation loss is the whole set's mean
    x, y = dataset().tensors
    expected = torch.nn.functional.mse_loss(model(x), y)
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(float(expected), rel=1e-5)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="grow_after must be a positive int"):
        OOMBackoff(grow_after=0)


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
