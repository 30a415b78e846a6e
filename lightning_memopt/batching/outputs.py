"""One step's outputs and logged values from its micro-batches' (plain torch; Lightning only for its errors).

A step run as k micro-batches must look like the unsplit step to everything after it: one loss, one
output dict, one logged value per name. Scalars are averaged by each micro-batch's share of the items
the loss averages over (its weight, :mod:`lightning_memopt.batching.counting`); per-sample tensors are
joined in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

__all__ = ["ChangedOrEvery", "LogRecorder", "StepOutputs", "combine", "detach", "loss_of"]


class LogRecorder:
    """Holds back ``module.log`` calls of the micro-batches; :meth:`flush` logs each name once, as the
    weighted mean (the full batch's value).

    Args:
        module: The LightningModule whose ``log`` is held back inside the ``with`` block.
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        self.weight = 1.0  # the current micro-batch's share; set by the caller before each one
        self.original_log = module.log
        self._records: dict[str, list] = {}

    def __enter__(self) -> LogRecorder:
        recorder = self

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            recorder._records.setdefault(name, []).append((value, recorder.weight, args, kwargs))

        self.module.log = log
        return self

    def __exit__(self, *exc: Any) -> None:
        vars(self.module).pop("log", None)

    def flush(self) -> None:
        """Log every recorded name once through the module's own ``log``."""
        for name, records in self._records.items():
            value, _, args, kwargs = records[-1]
            if len(records) > 1 and all(_is_number(r[0]) for r in records):
                value = _weighted_mean(records)
                if "batch_size" in kwargs:  # the user counted a micro-batch; the step counts them all
                    kwargs = {**kwargs, "batch_size": sum(r[3].get("batch_size", 0) for r in records)}
            # one micro-batch, or values that cannot be averaged: log exactly what the user logged (the last)
            self.original_log(name, value, *args, **kwargs)
        self._records.clear()


class StepOutputs:
    """The full batch's loss and output, built from its micro-batches' as they run.

    Args:
        micro_batches: How many micro-batches the step runs as.
    """

    def __init__(self, micro_batches: int) -> None:
        self.k = micro_batches
        self.loss: Any = None  # the full batch's loss: the micro-batches' weighted by share, detached
        self._extras: list[dict] = []  # the other keys of each micro-batch's output, detached

    def add(self, output: Any, loss: torch.Tensor, weight: float) -> None:
        """One micro-batch's ``training_step`` output, its loss, and its share of the batch."""
        if weight > 0 or self.k == 1:  # NaN * 0 is NaN: leave a micro-batch that counts nothing out
            part = loss.detach().float()
            part = part * weight if self.k > 1 else part
            self.loss = part if self.loss is None else self.loss + part
        if isinstance(output, Mapping):
            self._extras.append({k: detach(v) for k, v in output.items() if k != "loss"})

    def output(self, sizes: list[int], weights: list[float]) -> dict | None:
        """The other keys of the full batch's output (scalars weighted by share, per-sample tensors
        joined), or None when ``training_step`` returned the loss alone."""
        if not self._extras:
            return None
        return self._extras[0] if len(self._extras) == 1 else combine(self._extras, sizes, weights)


def _is_number(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool)


def _weighted_mean(records: list) -> Any:
    weight = sum(r[1] for r in records)
    # weight 0: a micro-batch that counts no items, whose means are NaN
    mean = sum(_as_tensor(r[0]).detach().float() * r[1] for r in records if r[1] > 0) / weight
    return mean if isinstance(records[-1][0], torch.Tensor) else float(mean)


def _as_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(float(value))


def loss_of(output: Any) -> torch.Tensor:
    """The scalar loss of a ``training_step`` output (the tensor, or a dict's ``"loss"``).

    Raises:
        MisconfigurationException: For a non-scalar loss, or an output without a loss tensor (None to skip
            a step cannot skip one micro-batch of it).
    """
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise MisconfigurationException(
                f"training_step must return a scalar loss, got a tensor of shape {tuple(loss.shape)}; reduce it "
                "to one number, e.g. loss.mean() (a mean over samples) or loss.sum() / n, before returning it"
            )
        return loss
    raise MisconfigurationException(
        f"with micro-batching, training_step must return the loss tensor or a dict with a 'loss' tensor, got "
        f"{type(output).__name__}; returning None to skip a step cannot skip one micro-batch of it"
    )


def detach(value: Any) -> Any:
    """``value.detach()`` for a tensor, else ``value``."""
    return value.detach() if isinstance(value, torch.Tensor) else value


def combine(outputs: list[Any], sizes: list[int], weights: list[float]) -> Any:
    """One step output from the micro-batches': per-sample tensors joined, scalars averaged by share.

    Example::

        >>> combine([torch.tensor(1.0), torch.tensor(3.0)], [2, 2], [0.5, 0.5])
        tensor(2.)
    """
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        if first.dim() > 0 and all(o.dim() > 0 and o.shape[0] == s for o, s in zip(outputs, sizes)):
            return torch.cat(outputs)
        if first.dim() == 0:
            return sum(o.float() * w for o, w in zip(outputs, weights))
        return outputs[-1]
    if isinstance(first, Mapping):
        return type(first)({k: combine([o[k] for o in outputs], sizes, weights) for k in first})
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        return type(first)(combine(list(items), sizes, weights) for items in zip(*outputs))
    return outputs[-1]


class ChangedOrEvery:
    """Logs the ``batching/*`` values when one changed, and every ``log_every_n_steps`` (when Lightning
    writes to the logger): ``self.log`` costs about as much as a small step's arithmetic, so not every step.
    """

    def __init__(self) -> None:
        self._logged: dict[str, float] = {}

    def log(self, log: Any, trainer: Any, values: dict[str, float]) -> None:
        """Log ``batching/<name>`` for each of ``values`` through ``log`` (the module's own ``log``)."""
        values = {f"batching/{name}": float(value) for name, value in values.items()}
        every = max(int(getattr(trainer, "log_every_n_steps", 1) or 1), 1)
        if values != self._logged or trainer.global_step % every == 0:
            self._logged = values
            for name, value in values.items():
                log(name, value, on_step=True, on_epoch=False, batch_size=1)
