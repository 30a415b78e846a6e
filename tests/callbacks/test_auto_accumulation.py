import lightning.pytorch as pl
import pytest
import torch

from lightning_memopt import AutoAccumulation
from tests.batching.helpers import Net, assert_params_close, fit


class GradRecorder(pl.Callback):
    def __init__(self):
        self.grads = []
        self.calls = 0

    def on_after_backward(self, trainer, pl_module):
        self.calls += 1
        self.grads.append([p.grad.clone() for p in pl_module.parameters()])


def test_fixed_micro_batches_equal_unsplit_sgd(tmp_path):
    base, split = Net(), Net()
    base_rec, split_rec = GradRecorder(), GradRecorder()
    base_trainer = fit(base, [base_rec], tmp_path=tmp_path)
    trainer = fit(
        split, [AutoAccumulation(micro_batch_size=3), split_rec], tmp_path=tmp_path
    )  # 10 -> [3, 3, 2, 2]
    assert_params_close(split, base, rel=1e-6)
    # on_before_backward/on_after_backward fire once per optimizer batch, with the full gradient
    assert split.events == base.events == ["before_backward", "after_backward"] * 4
    assert split_rec.calls == 4
    for g_split, g_base in zip(split_rec.grads, base_rec.grads):
        for a, b in zip(g_split, g_base):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the step loss (returned and logged) is the full batch's, not the last micro-batch's
    assert split.seen_sizes == [3, 3, 2, 2] * 4 and base.seen_sizes == [10] * 4
    assert split.step_losses == pytest.approx(base.step_losses, rel=1e-6)
    assert split.logged_losses == pytest.approx(base.logged_losses, rel=1e-6)
    assert split.logged_losses == pytest.approx(base.step_losses, rel=1e-6)
    # epoch aggregates are unchanged
    assert float(trainer.callback_metrics["train_loss_epoch"]) == pytest.approx(
        float(base_trainer.callback_metrics["train_loss_epoch"]), rel=1e-6
    )
    # the engine is removed at teardown
    assert "training_step" not in vars(trainer.strategy) and "optimizer_zero_grad" not in vars(split)
