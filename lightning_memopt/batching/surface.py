"""The Lightning names the micro-batch engine relies on, and the set-ups it refuses.

:data:`LIGHTNING_SURFACE` lists every Lightning name the engine uses; a test checks them, so an upgrade
that changes one fails loudly instead of training wrongly. Why each: the loops call the strategy's step
methods through ``getattr``, so the engine patches them on the instance; automatic optimization zeroes
gradients after ``training_step``, so the engine zeroes first and skips the ``optimizer_zero_grad`` call
that follows; the precision plugin's ``pre_backward``/``post_backward`` fire the backward hooks once
(DDP's own ``pre_backward`` is skipped); ``block_backward_sync`` is DDP's ``no_sync``.
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
    if trainer.accumulate_grad_batches != 1:
        raise MisconfigurationException(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} with micro-batching: the engine "
            "already accumulates within each batch. Make the DataLoader batch the optimizer batch "
            f"(batch_size * {trainer.accumulate_grad_batches}) and set accumulate_grad_batches=1 "
            "(and no GradientAccumulationScheduler); the effective batch stays the same and the "
            "engine picks how many micro-batches to run"
        )
