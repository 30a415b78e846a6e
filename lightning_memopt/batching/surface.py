"""The Lightning names the micro-batch engine relies on, why, and the set-ups it refuses.

The micro-batch engine (:mod:`~lightning_memopt.batching.engine` and the modules it drives) is the one
part of the package that touches Lightning's internals. It relies on exactly the names listed in
:data:`LIGHTNING_SURFACE` (``tests/batching/test_engine.py`` checks them, so a Lightning
upgrade that changes them fails loudly instead of training wrongly):

- ``Strategy.training_step`` / ``backward`` / ``optimizer_step`` / ``validation_step`` / ``test_step`` /
  ``predict_step`` are called by the loops through ``getattr(trainer.strategy, name)``, so the engine
  installs instance attributes of the same names at fit start and deletes them at teardown.
- Automatic optimization calls ``training_step`` → ``optimizer_zero_grad`` (first batch of an
  accumulation window only) → ``backward`` → ``optimizer.step``, all inside the closure that
  ``optimizer.step(closure)`` runs. Zero-grad comes AFTER training_step, so the engine zeroes gradients
  itself before the micro-batches and turns the LightningModule's ``optimizer_zero_grad`` into a no-op
  for the call that follows.
- ``Precision.pre_backward`` / ``post_backward`` fire ``on_before_backward`` / ``on_after_backward``;
  the engine calls only those for its step, once, with the full gradient in place. The strategy's own
  ``pre_backward`` is skipped (DDP's reducer is not prepared a second time).
- ``ParallelStrategy.block_backward_sync`` gives DDP's ``no_sync``; ``precision_plugin.scaler`` is the
  GradScaler of ``16-mixed``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy, Strategy
from lightning.pytorch.trainer.connectors.logger_connector import _LoggerConnector
from lightning.pytorch.utilities.exceptions import MisconfigurationException

__all__ = ["LIGHTNING_SURFACE", "SkipNextZeroGrad", "StrategyWrappers", "check_accumulation", "check_setup"]

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
    """Refuse Lightning's own gradient accumulation (checked at setup and every step: a
    GradientAccumulationScheduler may change it mid-fit)."""
    if trainer.accumulate_grad_batches != 1:
        raise MisconfigurationException(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} with micro-batching: the engine "
            "already accumulates within each batch. Make the DataLoader batch the optimizer batch "
            f"(batch_size * {trainer.accumulate_grad_batches}) and set accumulate_grad_batches=1 "
            "(and no GradientAccumulationScheduler); the effective batch stays the same and the "
            "engine picks how many micro-batches to run"
        )


class StrategyWrappers:
    """Installs wrappers of the strategy's step methods as instance attributes, and removes them.

    The loops look the methods up by name on the strategy instance (``getattr(trainer.strategy, name)``),
    so an instance attribute wins over the class's method. Installs are counted: every user installs and
    uninstalls, and only the first install and the last uninstall act. The Trainer is held weakly.
    """

    def __init__(self) -> None:
        self._trainer_ref: weakref.ref | None = None
        self._installs = 0
        self._originals: dict[str, Any] = {}

    @property
    def _trainer(self) -> Any:
        """The Trainer served, held weakly: a registry keyed by it must not keep its own key alive."""
        return None if self._trainer_ref is None else self._trainer_ref()

    @_trainer.setter
    def _trainer(self, trainer: Any) -> None:
        self._trainer_ref = None if trainer is None else weakref.ref(trainer)

    @property
    def installed(self) -> bool:
        return self._installs > 0

    def _wrappers(self) -> dict[str, Callable[..., Any]]:
        """The strategy's method names and their wrappers."""
        raise NotImplementedError

    def install(self, trainer: Any) -> None:
        """Wrap the strategy's step methods (counted: the second install of a trainer is a no-op)."""
        if self._installs and self._trainer is not trainer:
            raise RuntimeError("a MicroBatchEngine serves one Trainer; use MicroBatchEngine.for_trainer")
        self._installs += 1
        if self._installs > 1:
            return
        self._trainer = trainer
        strategy = trainer.strategy
        for name, wrapper in self._wrappers().items():
            if name in vars(strategy):
                raise RuntimeError(
                    f"strategy.{name} is already replaced on the instance; cannot wrap it twice"
                )
            self._originals[name] = getattr(strategy, name)
            setattr(strategy, name, wrapper)

    def uninstall(self) -> None:
        """Undo :meth:`install` when the last user calls it."""
        if self._installs == 0:
            return
        self._installs -= 1
        if self._installs:
            return
        strategy = self._trainer.strategy
        for name in self._originals:
            vars(strategy).pop(name, None)
        self._originals.clear()
        self._uninstalled()

    def _uninstalled(self) -> None:
        """After the last uninstall: drop what the fit left behind."""


class SkipNextZeroGrad:
    """Zero gradients now through the LightningModule's own hook; make the call Lightning makes after
    ``training_step`` (automatic optimization zeroes after the step, not before) a no-op."""

    def __init__(self) -> None:
        self._module: Any = None  # the module whose optimizer_zero_grad is replaced on the instance
        self._skip = False

    def zero_now(self, trainer: Any, batch_idx: int) -> None:
        module = trainer.lightning_module
        if self._module is None:
            self._module = module
            module.optimizer_zero_grad = self._optimizer_zero_grad
        for optimizer in trainer.optimizers:
            type(module).optimizer_zero_grad(module, trainer.current_epoch, batch_idx, optimizer)
        self._skip = True

    def _optimizer_zero_grad(self, *args: Any, **kwargs: Any) -> None:
        if self._skip:
            self._skip = False
            return None
        return type(self._module).optimizer_zero_grad(self._module, *args, **kwargs)

    def remove(self) -> None:
        """Give the module its own ``optimizer_zero_grad`` back."""
        if self._module is not None:
            vars(self._module).pop("optimizer_zero_grad", None)
        self._module = None
