"""Read what the user passes to ``fit``: a LightningCLI config (or a class and overrides), without
allocating the model. LightningCLI parses and instantiates the model and DataModule (on the meta device);
the Trainer is never built."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memopt.planning.build import build_fake, fake_batch, load_class, parse_batch_spec

__all__ = ["PlanInput", "load_input"]


@dataclass
class PlanInput:
    """The fake module and batch, and the trainer settings the config gave."""

    module: nn.Module
    batch: Any
    precision: str = "32-true"
    strategy: str = "ddp"
    devices: int = 1
    rebuild: Callable[[], nn.Module] | None = None
    """Builds the module again (fake), for a copy to shard."""


def load_input(
    mode: FakeTensorMode,
    *,
    configs: Sequence[str] = (),
    model: str | None = None,
    data: str | None = None,
    batch: Sequence[str] = (),
    overrides: Sequence[str] = (),
) -> PlanInput:
    """Build the module (fake) and one batch (fake) from a LightningCLI config or a class.

    Raises:
        ValueError: If neither a config nor a model class is given, the config cannot be parsed, or no
            batch can be made (no DataModule and no ``batch`` specs).
    """
    if not configs and model is None:
        raise ValueError("give --config (a LightningCLI YAML) or --model 'pkg.module:Class'")
    from lightning.pytorch.cli import LightningCLI

    model_class = load_class(model) if model else None
    data_class = load_class(data) if data else None
    holder: dict[str, Any] = {}

    class _CLI(LightningCLI):
        def instantiate_classes(self) -> None:
            # Only the model and the data: a Trainer would start processes and claim devices.
            self.config_init = self.parser.instantiate_classes(self.config)
            self.datamodule = self._get(self.config_init, "data")
            self.model = self._get(self.config_init, "model")
            self._add_configure_optimizers_method_to_model(self.subcommand)
            holder["cli"] = self

    args = [a for c in configs for a in ("--config", c)] + list(overrides)

    def factory() -> nn.Module:
        try:
            with warnings.catch_warnings():
                # LightningCLI warns when args are given while sys.argv holds this script's own arguments.
                warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
                _CLI(model_class, data_class, args=args, run=False, save_config_callback=None)
        except SystemExit as exc:  # jsonargparse exits on a bad config; say so instead
            raise ValueError(
                f"LightningCLI could not parse {args} (exit {exc.code}); see the message above"
            ) from None
        return holder["cli"].model

    what = model or "the config's model"
    module = build_fake(mode, factory, what=what)
    cli = holder["cli"]
    trainer = cli.config.get("trainer") or {}
    if batch:
        fake = parse_batch_spec(batch, mode)
    elif cli.datamodule is not None:
        fake = fake_batch(mode, _first_batch(cli.datamodule))
    else:
        raise ValueError(
            "no DataModule in the config to take a batch from; give its shapes, e.g. --batch 8x512"
        )
    rebuild = lambda: build_fake(mode, factory, what=what)  # noqa: E731
    return PlanInput(module, fake, *_trainer_settings(trainer), rebuild=rebuild)


def _first_batch(datamodule) -> Any:
    """The DataModule's first training batch, made for real (it is data, not model: small)."""
    import torch

    with torch.device("cpu"):
        datamodule.prepare_data()
        datamodule.setup("fit")
        return next(iter(datamodule.train_dataloader()))


def _trainer_settings(trainer: Any) -> tuple[str, str, int]:
    precision = trainer.get("precision") or "32-true"
    precision = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}.get(str(precision), str(precision))
    strategy = trainer.get("strategy") or "ddp"
    if not isinstance(strategy, str):
        strategy = str(getattr(strategy, "class_path", strategy))
    strategy = "fsdp" if ("fsdp" in strategy.lower() or "modelparallel" in strategy.lower()) else "ddp"
    devices = trainer.get("devices")
    devices = devices if isinstance(devices, int) and devices > 0 else 1
    return precision, strategy, devices
