"""The Lightning names the micro-batch engine relies on, why, and the set-ups it refuses.

The micro-batch engine (:mod:`~lightning_memopt.batching.engine` and the modules it drives) is the one
part of the package that touches Lightning's internals. It relies on exactly the names listed in
:data:`LIGHTNING_SURFACE` (``tests/batching/test_engine.py`` checks them, so a Lightning
upgrade that changes them fails loudly instead of training wrongly):

- ``Strategy.training_step`` / ``backward`` / ``optimizer_step`` / ``validation_step`` / ``test_step`` /
  ``predict_step`` are called by the loops through ``getattr(trainer.strategy, name)``, so the engine
  patches them on the instance at fit start and takes the patches off at teardown
  (:func:`~lightning_memopt._patch.patch`).
- Automatic optimization calls ``training_step`` → ``optimizer_zero_grad`` (first batch of an
  accumulation window only) → ``backward`` → ``optimizer.step``, all inside the closure that
  ``optimizer.step(closure)`` runs. Zero-grad comes AFTER training_step, so the engine zeroes gradients
  itself (through the module's own hook) before the micro-batches and patches the LightningModule's
  ``optimizer_zero_grad`` to skip the call that follows.
- ``Precision.pre_backward`` / ``post_backward`` fire ``on_before_backward`` / ``on_after_backward``;
  the engine calls only those for its step, once, with the full gradient in place. The strategy's own
  ``pre_backward`` is skipped (DDP's reducer is not prepared a second time).
- ``ParallelStrategy.block_backward_sync`` gives DDP's ``no_sync``; ``precision_plugin.scaler`` is the
  GradScaler of ``16-mixed``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy, Strategy
from lightning.pytorch.trainer.connectors.logger_connector import _LoggerConnector
from lightning.pytorch.utilities.exceptions import MisconfigurationException

__all__ = ["LIGHTNING_SURFACE", "check_setup"]

#: The Lightning names the engine relies on: (object, attribute). Checked by a test.
LIGHTNING_SURFACE = (
    (Strategy, "training_step"),
    (Strategy, "backward"),
    (Strategy, "optimizer_step"),
    (Strategy, "validation_step"),
    (Strategy, "test_step"),
    (Strategy, "predict_step"),
    (Strategy, "precision_plugin"),
    (Strategy, "lightning_module"),
    (Strategy, "model"),
    (Strategy, "root_device"),
    (ParallelStrategy, "block_backward_sync"),
    (Precision, "pre_backward"),
    (Precision, "post_backward"),
    (MixedPrecision, "scaler"),
    (LightningModule, "optimizer_zero_grad"),
    (LightningModule, "log"),
    (LightningModule, "automatic_optimization"),
    (Trainer, "strategy"),
    (Trainer, "lightning_module"),
    (Trainer, "optimizers"),
    (Trainer, "accumulate_grad_batches"),
    (Trainer, "current_epoch"),
    (Trainer, "global_step"),
    (_LoggerConnector, "on_trainer_init"),  # sets trainer.log_every_n_steps (an instance attribute)
)


def check_setup(trainer: Any, pl_module: Any) -> None:
    """Refuse set-ups the engine cannot run exactly.

    Raises:
        MisconfigurationException: Manual optimization, DeepSpeed, or ``accumulate_grad_batches > 1``.
    """
    if not pl_module.automatic_optimization:
        raise MisconfigurationException(
            "micro-batching needs automatic optimization, but the LightningModule sets "
            "`automatic_optimization = False`; split the batch inside your own training_step "
            "(lightning_memopt.batching.split_batch) or remove AutoAccumulation/OOMBackoff"
        )
    if "deepspeed" in type(trainer.strategy).__name__.lower():
        raise MisconfigurationException(
            f"micro-batching does not work with {type(trainer.strategy).__name__}: DeepSpeed owns gradient "
            "accumulation; use its `train_micro_batch_size_per_gpu` config instead of AutoAccumulation/OOMBackoff"
        )
    check_accumulation(trainer)


def check_accumulation(trainer: Any) -> None:
    """Refuse Lightning's own gradient accumulation."""
    if trainer.accumulate_grad_batches != 1:
        raise MisconfigurationException(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} with micro-batching: the engine "
            "already accumulates within each batch. Make the DataLoader batch the optimizer batch "
            f"(batch_size * {trainer.accumulate_grad_batches}) and set accumulate_grad_batches=1 "
            "(and no GradientAccumulationScheduler); the effective batch stays the same and the "
            "engine picks how many micro-batches to run"
        )
