"""BatchNormToGroupNorm: swap BatchNorm for GroupNorm before training, so micro-batching cannot change it."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_memopt._checks import check_bool, check_positive_int
from lightning_memopt.callbacks._hooks import Attachments, ReleasingCallback
from lightning_memopt.norm import ConversionReport, SwappedGroupNorm, convert_batchnorm, revert_groupnorm

__all__ = ["BatchNormToGroupNorm"]

_WHEN = ("always", "micro_batching")


class BatchNormToGroupNorm(ReleasingCallback):
    """Replace the model's BatchNorm layers by GroupNorm layers that share their Parameters.

    BatchNorm normalizes with statistics of the batch, so once a batch is split into micro-batches
    (``AutoAccumulation``, ``OOMBackoff``) it sees fewer samples and training changes; GroupNorm does not
    depend on the batch. The swap is :func:`lightning_memopt.norm.convert_batchnorm`, done in ``setup``
    before the optimizers exist (for models built in ``configure_model``, right after it), and it is
    kept for the rest of the run. The ``state_dict`` keys do not change (the running statistics stay as
    unused buffers), so checkpoints saved before or after the swap load strictly either way. The decision (layer → group count) is saved in the callback's
    state, and a run resumed from a checkpoint swaps exactly the same layers before the model's weights
    are loaded.

    With ``example_input_array`` set on the LightningModule, one no-grad forward probes each BatchNorm's
    input shape, so ``BatchNorm1d`` on ``(N, C)`` gets one group; without it every ``BatchNorm1d`` is
    assumed to see ``(N, C)`` (a warning names them).

    What it reports: an info message listing every swapped and skipped layer, ``self.report`` (the
    :class:`~lightning_memopt.norm.ConversionReport`), a warning when there was nothing to swap, and a
    warning that ``Trainer(sync_batchnorm=True)`` no longer applies. No metrics are logged.

    Args:
        num_groups: upper bound on groups per layer: a layer with ``C`` channels gets the largest divisor of
            ``C`` not above it (so 48 channels get 24 groups, 24 channels one group per channel, see
            :mod:`lightning_memopt.norm`). Default ``None``: 32, unless ``group_size`` is given.
        group_size: channels per group instead of ``num_groups`` (pass one of the two); it must divide every
            converted layer's channels, which is checked in ``setup``.
        when: ``"always"`` (default) swaps in every run; ``"micro_batching"`` swaps only when a callback in
            ``trainer.callbacks`` splits batches (one whose class has a truthy ``splits_batches``, such as
            ``AutoAccumulation`` and ``OOMBackoff``).
        micro_batch_size_below: with ``when="micro_batching"``, swap only when the splitting callbacks'
            ``micro_batch_size`` is below this. A size not known at setup (``None``) counts as below: OOM
            backoff can shrink it to anything, and the decision must be made before the optimizers exist.
        probe: run the probe forward with ``example_input_array`` (when the module sets it). Default True.

    After ``fit``, finished or failed, the swap stays (it is the model now) and nothing else of the
    callback does: the hook wrappers come off in ``teardown`` or ``on_exception``, so ``torch.save(model)``
    works and the callback holds no reference to the model or the Trainer (``report.module`` is ``None``).

    Raises:
        ValueError: an argument out of range, or both ``num_groups`` and ``group_size`` (the message names
            the value and the valid choices).
        TypeError: ``probe`` is not a bool.
        MisconfigurationException: in ``setup``, when the model has a layer that cannot be converted
            faithfully, such as a ``group_size`` that does not divide a layer's channels (see
            :func:`~lightning_memopt.norm.convert_batchnorm`), or the probe forward fails.

    Example::

        trainer = Trainer(callbacks=[BatchNormToGroupNorm(), AutoAccumulation()])

        # LightningCLI YAML
        trainer:
          callbacks:
            - class_path: lightning_memopt.BatchNormToGroupNorm
              init_args: {num_groups: 16, when: micro_batching}
    """

    def __init__(
        self,
        *,
        num_groups: int | None = None,
        group_size: int | None = None,
        when: Literal["always", "micro_batching"] = "always",
        micro_batch_size_below: int | None = None,
        probe: bool = True,
    ) -> None:
        for name, value in (("num_groups", num_groups), ("group_size", group_size)):
            if value is not None:
                check_positive_int(name, value)
        if num_groups is not None and group_size is not None:
            raise ValueError(
                f"pass num_groups or group_size, not both (got num_groups={num_groups}, group_size={group_size}): "
                "num_groups caps the groups per layer, group_size fixes the channels per group"
            )
        check_bool("probe", probe)
        if when not in _WHEN:
            raise ValueError(f"when must be one of {_WHEN}, got {when!r}")
        if micro_batch_size_below is not None:
            check_positive_int("micro_batch_size_below", micro_batch_size_below)
            if when != "micro_batching":
                raise ValueError(
                    f"micro_batch_size_below={micro_batch_size_below} only applies with when='micro_batching', "
                    f"got when={when!r}"
                )
        self.num_groups = num_groups
        self.group_size = group_size
        self.when = when
        self.micro_batch_size_below = micro_batch_size_below
        self.probe = probe
        self.report: ConversionReport | None = None
        """What the last swap did; its ``module`` is ``None`` once fit ends (the callback keeps no model)."""
        # layer name -> group count of what is swapped in this run; {} when deciding not to swap
        self._groups: dict[str, int] | None = None
        self._attached = Attachments()  # the hook wrappers on the module, taken off when fit ends

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Order of transformations (DESIGN.md): 1. this swap, before the strategy creates the optimizers
        # (they hold Parameter references; the GroupNorm reuses the BatchNorm's Parameters anyway) and before
        # 2. activation checkpointing, 3. precision conversion / DDP-FSDP wrapping / optimizers, 4. the
        # micro-batching engine. A callback's setup runs before the module's configure_model, so layers built
        # there do not exist yet: for such modules the swap runs right after configure_model instead, through
        # a wrapper on the instance's public hook (removed in teardown, or on_exception when fit raises).
        self._attached.wrap(
            pl_module, "on_load_checkpoint", before=lambda ckpt: self._match_checkpoint(pl_module, ckpt)
        )
        if is_overridden("configure_model", pl_module):
            self._attached.wrap(pl_module, "configure_model", after=lambda: self._swap(trainer, pl_module))
        else:
            self._swap(trainer, pl_module)

    @override
    def _release(self) -> None:
        # Also after an exception, or the model keeps local functions (torch.save(model) fails) that
        # reference the Trainer. The swap itself stays (it is the model now); wrappers and references go.
        self._attached.detach()
        if self.report is not None:
            self.report = dataclasses.replace(self.report, module=None)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"groups": dict(self._groups or {}), "decided": self._groups is not None}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The layers were already matched to this state before the model weights loaded (_match_checkpoint).
        if state_dict.get("decided"):
            self._groups = dict(state_dict["groups"])

    def _swap(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        swap, why = self._decide(trainer)
        if not swap:
            self._groups = _swapped_groups(pl_module)  # {} unless an earlier run on this module swapped
            rank_zero_info(f"BatchNormToGroupNorm: BatchNorm layers kept ({why})")
            return
        example = pl_module.example_input_array if self.probe else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                report = convert_batchnorm(
                    pl_module, num_groups=self.num_groups, group_size=self.group_size, example_input=example
                )
            except RuntimeError as err:
                raise MisconfigurationException(
                    f"BatchNormToGroupNorm could not probe BatchNorm input shapes with "
                    f"{type(pl_module).__name__}.example_input_array: {err.__cause__!r}. Fix example_input_array "
                    "or pass BatchNormToGroupNorm(probe=False)"
                ) from err
            except (TypeError, ValueError) as err:
                # a layer of this model cannot be converted faithfully (the message says which and why)
                raise MisconfigurationException(
                    f"BatchNormToGroupNorm cannot swap the BatchNorm layers of {type(pl_module).__name__}: {err}"
                ) from err
        for warning in caught:  # re-emitted once, on rank zero
            rank_zero_warn(str(warning.message), category=warning.category)
        self.report = report
        self._groups = _swapped_groups(pl_module)
        if not self._groups:
            skipped = "".join(f"; {layer.name} skipped: {layer.reason}" for layer in report.skipped)
            rank_zero_warn(
                f"BatchNormToGroupNorm found no BatchNorm layer to swap in {type(pl_module).__name__}{skipped}. "
                "Remove the callback if the model has none."
            )
            return
        rank_zero_info(f"BatchNormToGroupNorm ({why}): {report}")
        # Lightning keeps Trainer(sync_batchnorm=True) only on the strategy (no public accessor); read it
        # defensively, the worst a rename can do is skip this warning.
        if getattr(trainer.strategy, "_layer_sync", None) is not None:
            rank_zero_warn(
                "Trainer(sync_batchnorm=True) no longer applies: BatchNormToGroupNorm replaced the BatchNorm "
                "layers by GroupNorm, which normalizes every sample on its own and needs no synchronization "
                "across processes. Remove sync_batchnorm=True."
            )

    def _decide(self, trainer: pl.Trainer) -> tuple[bool, str]:
        if self.when == "always":
            return True, "when='always'"
        # Duck-typed so this works with any micro-batching callback: a truthy class attribute `splits_batches`,
        # and `micro_batch_size` (int, or None when not known yet).
        splitters = [cb for cb in trainer.callbacks if getattr(type(cb), "splits_batches", False)]
        if not splitters:
            return False, "no callback splits batches into micro-batches"
        names = ", ".join(type(cb).__name__ for cb in splitters)
        if self.micro_batch_size_below is None:
            return True, f"{names} splits batches"
        sizes = [getattr(cb, "micro_batch_size", None) for cb in splitters]
        known = [s for s in sizes if s is not None]
        if len(known) < len(sizes):
            return True, f"{names} splits batches into micro-batches of a size not known yet"
        size = min(known)
        if size < self.micro_batch_size_below:
            return True, f"{names} uses micro-batches of {size} < {self.micro_batch_size_below}"
        return False, f"micro-batches of {size} >= micro_batch_size_below={self.micro_batch_size_below}"

    def _match_checkpoint(self, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Before the model's weights load: make the swapped layers those of the run that saved ``checkpoint``."""
        state = (checkpoint.get("callbacks") or {}).get(self.state_key)
        if not state or not state.get("decided"):
            return  # saved without this callback (a pre-swap checkpoint): the GroupNorm layers load it as is
        saved = dict(state["groups"])
        if saved == _swapped_groups(pl_module):
            return
        revert_groupnorm(pl_module)
        if saved:
            convert_batchnorm(pl_module, groups=saved)
        self._groups = _swapped_groups(pl_module)
        rank_zero_info(f"BatchNormToGroupNorm: swapped layers set to the checkpoint's: {saved}")


def _swapped_groups(module: Any) -> dict[str, int]:
    return {
        name: sub.num_groups
        for name, sub in module.named_modules(remove_duplicate=False)
        if isinstance(sub, SwappedGroupNorm)
    }
