"""One step's logged values and outputs from its micro-batches', as the unsplit step would have them.

The rules (``self.log`` by ``reduce_fx``, torchmetrics on step, the output dict's keys):
``docs/micro_batching.md``, "One step".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_memopt._patch import patch

__all__ = ["ChangedOrEvery", "LogRecorder", "StepMetrics", "combine", "loss_of", "reductions", "warn_inexact"]

_REDUCTIONS: dict[Any, str] = {
    "mean": "mean", "avg": "mean", torch.mean: "mean",
    "sum": "sum", torch.sum: "sum",
    "max": "max", torch.max: "max", torch.amax: "max",
    "min": "min", torch.min: "min", torch.amin: "min",
}  # fmt: skip


def _is_metric(value: Any) -> bool:
    return hasattr(value, "_defaults") and hasattr(value, "_forward_cache") and hasattr(value, "merge_state")


def _mergeable(metric: Any) -> bool:
    """Whether torchmetrics can merge two states of ``metric`` (``Metric.merge_state``'s own condition)."""
    return metric.full_state_update is False and not metric.dist_sync_on_step


def _is_loss(value: Any, loss: torch.Tensor) -> bool:
    """Whether a logged ``value`` is the loss ``loss`` (itself, or detached from it)."""
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.data_ptr() == loss.data_ptr()


class LogRecorder:
    """Holds back the ``log`` calls of a step's micro-batches; :meth:`flush` logs each name once.

    Args:
        module: The LightningModule whose ``log`` (and so ``log_dict``) is held back inside the ``with``.
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        self.share = 1.0  # the current micro-batch's share of the batch's samples; set before each one
        self.loss: torch.Tensor | None = None  # the current micro-batch's loss, once known
        self._records: dict[str, list[tuple[Any, float, tuple, dict]]] = {}
        self._caches: dict[str, list[Any]] = {}
        self._undo: Any = None

    def __enter__(self) -> LogRecorder:
        self._undo = patch(self.module, "log", self._record)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._undo()

    def _record(self, original: Any, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if _is_metric(value):  # what the metric computed for this micro-batch alone
            self._caches.setdefault(name, []).append(value._forward_cache)
        self._records.setdefault(name, []).append((value, self.share, args, kwargs))

    def flush(self, losses: list[torch.Tensor] | None = None, full_loss: torch.Tensor | None = None) -> None:
        """Log every recorded name once through the module's own ``log``.

        Args:
            losses: Each micro-batch's loss, in order (to tell a logged loss from other values).
            full_loss: The whole step's loss, logged where a micro-batch's loss was.
        """
        log = self.module.log  # the module's own again: flushed after the `with` block
        for name, records in self._records.items():
            value, _, args, kwargs = records[-1]
            if len(records) > 1:
                value = self._reduce(name, records, kwargs.get("reduce_fx", "mean"), losses, full_loss)
                # the user counted a micro-batch; the step counts all
                if kwargs.get("batch_size") is not None:
                    kwargs = {**kwargs, "batch_size": sum(r[3].get("batch_size") or 0 for r in records)}
            log(name, value, *args, **kwargs)
        self._records.clear()
        self._caches.clear()

    def _reduce(self, name: str, records: list, reduce_fx: Any, losses: list | None, full_loss: Any) -> Any:
        values = [r[0] for r in records]
        if _is_metric(values[-1]):
            metric = values[-1]
            if not _mergeable(metric):  # StepMetrics computed the others for the whole step
                caches = self._caches.get(name, [])
                if all(isinstance(c, torch.Tensor) for c in caches) and len(caches) == len(records):
                    shares = [r[1] for r in records]
                    metric._forward_cache = sum(s * c for s, c in zip(shares, caches)) / sum(shares)
            return metric
        if not all(isinstance(v, (torch.Tensor, int, float)) and not isinstance(v, bool) for v in values):
            return values[-1]
        kind = _REDUCTIONS.get(reduce_fx)
        stacked = torch.stack([torch.as_tensor(v).detach().double() for v in values])
        if kind == "mean":
            if losses is not None and full_loss is not None and len(losses) == len(values):
                if all(_is_loss(v, loss) for v, loss in zip(values, losses)):
                    return full_loss.detach()
            sizes = [r[3].get("batch_size") for r in records]
            weights = [float(s) for s in sizes] if None not in sizes else [r[1] for r in records]
            result = sum(w * x for w, x in zip(weights, stacked)) / sum(weights)
        elif kind == "sum":
            result = stacked.sum(0)
        elif kind in ("max", "min"):
            result = stacked.amax(0) if kind == "max" else stacked.amin(0)
        else:
            result = reduce_fx(stacked)
        first = values[-1]
        return result.to(first.dtype) if isinstance(first, torch.Tensor) else result.item()


class StepMetrics:
    """During a split step, every torchmetrics ``Metric`` of the module accumulates the step alone, so that
    the value logged on step is the whole batch's; at the end, the step's state is merged into the metric's.

    Args:
        module: The LightningModule (its ``Metric`` submodules are found by their attributes).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.metrics = [m for m in module.modules() if _is_metric(m) and _mergeable(m)]
        self._saved: list[tuple[Any, dict, int]] = []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._saved = [(m, {a: getattr(m, a) for a in m._defaults}, m._update_count) for m in self.metrics]
        for m, _, _ in self._saved:
            m.reset()
        try:
            yield
            for m, _, _ in self._saved:
                if m._update_count:
                    sync = m._to_sync
                    m._to_sync = m.dist_sync_on_step  # the step's value, as Metric.forward computes it
                    try:
                        m._forward_cache = m.compute()
                    finally:
                        m._to_sync = sync
        finally:
            for m, saved, count in self._saved:
                updates = m._update_count
                m._update_count = count + 1  # merge_state averages "mean" states by the count
                m.merge_state(saved)
                m._update_count = count + updates
                m._computed = None
            self._saved = []


def loss_of(output: Any) -> torch.Tensor | None:
    """The scalar loss of a ``training_step`` output (the tensor, or a dict's ``"loss"``); None for None.

    Raises:
        MisconfigurationException: For a loss that is not a scalar, or an output that is neither None nor
            carries a loss tensor (a dict without ``"loss"``, a Python number): the message says what it
            returned and what to return.
    """
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if output is None:
        return None
    if not isinstance(loss, torch.Tensor):
        raise MisconfigurationException(not_a_loss(output))
    if loss.numel() != 1:
        raise MisconfigurationException(
            f"training_step must return a scalar loss, got a tensor of shape {tuple(loss.shape)}; reduce it "
            "to one number, e.g. loss.mean() (a mean over samples) or loss.sum() / n, before returning it"
        )
    return loss


_RETURN = (
    "return the loss tensor as computed (not .item() or float(...): a number has no gradient), a dict with "
    "'loss': that tensor (and anything else on_train_batch_end should get), or None to skip the batch"
)


def not_a_loss(output: Any) -> str:
    """What ``training_step`` returned instead of a loss, and what to return (one line).

    Example::

        >>> not_a_loss({"acc": 0.5}).split(";")[0]
        "training_step returned a dict without a 'loss' key (its keys: 'acc')"
        >>> not_a_loss(0.25).split(";")[0]
        'training_step returned a float (0.25), not a loss tensor'
    """
    if isinstance(output, Mapping):
        if "loss" not in output:
            keys = ", ".join(repr(k) for k in output) or "none"
            return f"training_step returned a dict without a 'loss' key (its keys: {keys}); {_RETURN}"
        return f"training_step returned a dict whose 'loss' is {_described(output['loss'])}, not a tensor; {_RETURN}"
    return f"training_step returned {_described(output)}, not a loss tensor; {_RETURN}"


def _described(value: Any) -> str:
    """``a float (0.25)``: the type and, for a short value, the value."""
    if value is None:
        return "None"
    name = type(value).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    text = repr(value)
    return f"{article} {name} ({text})" if len(text) <= 40 else f"{article} {name}"


# A reduction's autograd node, by its class name: what it reduced, and how its micro-batch values combine.
_REDUCING = {
    "MaxBackward1": "max", "AmaxBackward0": "max", "MaxBackward0": "max",
    "MinBackward1": "min", "AminBackward0": "min", "MinBackward0": "min",
    "SumBackward0": "sum", "SumBackward1": "sum",
    "MeanBackward0": "mean", "MeanBackward1": "mean",
}  # fmt: skip
# Nodes that change neither the value nor what it reduced (a cast, a copy), looked through.
_PASSING = ("ToCopyBackward0", "CloneBackward0", "AliasBackward0")


def reductions(output: Any, size: int, key: str = "") -> dict[str, tuple[str, float]]:
    """How each floating tensor in a micro-batch's ``output`` was reduced over the micro-batch's ``size``
    samples, read from its autograd node before backward frees it: by :func:`combine`'s key,
    ``(kind, weight)``, kind ``"max"``, ``"min"``, ``"sum"`` or ``"mean"``, weight the elements a mean
    averaged (1 for the others). Only reductions that cover the sample dimension (dim 0 of their input)
    are listed: those combine exactly over the micro-batches.

    Example::

        >>> x = torch.ones(4, 3, requires_grad=True)
        >>> reductions({"loss": x.sum(), "top": x.max(), "avg": x.mean(0), "n": x.detach().sum()}, 4)
        {"['loss']": ('sum', 1.0), "['top']": ('max', 1.0), "['avg']": ('mean', 4.0)}
    """
    if isinstance(output, torch.Tensor):
        how = _reduction(output, size)
        return {} if how is None else {key: how}
    if isinstance(output, Mapping):
        return {
            k: v
            for name, value in output.items()
            for k, v in reductions(value, size, f"{key}[{name!r}]").items()
        }
    if isinstance(output, (list, tuple)) and not hasattr(output, "_fields"):
        return {
            k: v for i, value in enumerate(output) for k, v in reductions(value, size, f"{key}[{i}]").items()
        }
    return {}


def _reduction(tensor: torch.Tensor, size: int) -> tuple[str, float] | None:
    node = tensor.grad_fn
    if node is None or not tensor.is_floating_point():
        return None  # no graph to read
    while type(node).__name__ in _PASSING and node.next_functions and node.next_functions[0][0] is not None:
        node = node.next_functions[0][0]
    kind = _REDUCING.get(type(node).__name__)
    if kind is None:
        return None
    try:
        if hasattr(node, "_saved_self_sym_sizes"):
            shape = tuple(int(n) for n in node._saved_self_sym_sizes)
        else:
            shape = tuple(node._saved_self.shape)  # max/min: read before backward frees it
    except RuntimeError:  # freed already (a graph that ran backward inside training_step)
        return None
    dims = getattr(node, "_saved_dim", ())
    dims = {d % max(len(shape), 1) for d in ((dims,) if isinstance(dims, int) else dims)} or set(
        range(len(shape))
    )
    if kind in ("max", "min"):
        # The largest of the micro-batches' largest is the batch's, over the samples or over none of them
        # (a value the samples do not change is the same in each micro-batch).
        return (kind, 1.0) if 0 in dims or not shape else None
    if not shape or shape[0] != size or 0 not in dims:
        return None  # a sum or mean that is not over this micro-batch's samples: summing it would be wrong
    return kind, float(torch.Size([shape[d] for d in dims]).numel()) if kind == "mean" else 1.0


def combine(
    outputs: list[Any],
    sizes: list[int],
    *,
    how: list[dict[str, tuple[str, float]]] | None = None,
    inexact: list[str] | None = None,
    key: str = "",
) -> Any:
    """One step output from the micro-batches' outputs: per-sample tensors joined, integer counts added, a
    max, min, sum or mean over the samples (``how``: each micro-batch's :func:`reductions`) combined as
    such; anything else is a guess (floats averaged by samples, other objects the last micro-batch's),
    and its key is added to ``inexact``.

    Example::

        >>> combine([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], [2, 1])
        tensor([1., 2., 3.])
        >>> combine([torch.tensor(2), torch.tensor(3)], [2, 1])
        tensor(5)
        >>> combine([torch.tensor(0.5), torch.tensor(0.9)], [2, 1], how=[{"": ("max", 1.0)}] * 2)
        tensor(0.9000)
    """
    first = outputs[-1]
    if isinstance(first, torch.Tensor):
        outputs = [o.detach() for o in outputs]
        # First what the graph said: a reduction over the samples, even of a shape that looks per-sample
        # (logits.amax(0) with as many classes as samples).
        kinds = [h.get(key) for h in how] if how is not None and len(how) == len(outputs) else [None]
        same_shape = all(o.shape == first.shape for o in outputs)
        if None not in kinds and len({k for k, _ in kinds}) == 1 and same_shape:
            return _reduce(outputs, kinds)
        if first.dim() > 0 and all(o.dim() > 0 and o.shape[0] == s for o, s in zip(outputs, sizes)):
            return torch.cat(outputs)
        if not (first.is_floating_point() or first.is_complex()):
            return torch.stack(outputs).sum(0)
        return _mean(outputs, sizes, inexact, key)
    if isinstance(first, bool) or first is None:
        return first
    if isinstance(first, int):
        return sum(outputs)
    if isinstance(first, float):
        return float(_mean([torch.tensor(o, dtype=torch.float64) for o in outputs], sizes, inexact, key))
    if isinstance(first, Mapping):
        return type(first)(
            {
                k: combine([o[k] for o in outputs], sizes, how=how, inexact=inexact, key=f"{key}[{k!r}]")
                for k in first
            }
        )
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        parts = [
            combine(list(items), sizes, how=how, inexact=inexact, key=f"{key}[{i}]")
            for i, items in enumerate(zip(*outputs))
        ]
        return type(first)(parts)
    if inexact is not None:
        inexact.append(key)
    return first


def _reduce(outputs: list[torch.Tensor], kinds: list[tuple[str, float]]) -> torch.Tensor:
    """The micro-batches' maxes, mins, sums or means (each weighted by the elements it averaged) as one."""
    kind = kinds[0][0]
    stacked = torch.stack(outputs)
    if kind == "max":
        return stacked.amax(0)
    if kind == "min":
        return stacked.amin(0)
    if kind == "sum":
        return stacked.sum(0)
    weights = torch.tensor([w for _, w in kinds], dtype=torch.float64, device=stacked.device)
    weights = weights.view(-1, *[1] * (stacked.dim() - 1))
    return ((stacked.double() * weights).sum(0) / weights.sum()).to(stacked.dtype)


def _mean(outputs: list[torch.Tensor], sizes: list[int], inexact: list[str] | None, key: str) -> Any:
    if inexact is not None:
        inexact.append(key)
    total = sum(sizes)
    return sum(o * (s / total) for o, s in zip(outputs, sizes))


class ChangedOrEvery:
    """Logs the ``batching/*`` values when one changed, and every ``log_every_n_steps`` (when Lightning
    writes to the logger): ``self.log`` costs about as much as a small step's arithmetic, so not every step.
    """

    def __init__(self) -> None:
        self._logged: dict[str, float] = {}

    def log(
        self,
        log: Any,
        trainer: Any,
        values: dict[str, float],
        every_n: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """Log ``batching/<name>`` for each of ``values`` through ``log`` (the module's own ``log``), and of
        ``every_n()`` every ``log_every_n_steps`` only (values that change every step)."""
        values = {f"batching/{name}": float(value) for name, value in values.items()}
        every = max(int(getattr(trainer, "log_every_n_steps", 1) or 1), 1)
        due = trainer.global_step % every == 0
        if values != self._logged or due:
            self._logged = values
            for name, value in values.items():
                log(name, value, on_step=True, on_epoch=False, batch_size=1)
        if due and every_n is not None:
            for name, value in every_n().items():
                log(f"batching/{name}", float(value), on_step=True, on_epoch=False, batch_size=1)


def warn_inexact(keys: list[str], seen: set[str]) -> None:
    """Say once (per set of keys; ``seen`` keeps what was said) which keys of ``training_step``'s output
    :func:`combine` could not combine exactly, and what to return instead."""
    if not keys:
        return
    names = ", ".join(f"outputs{key}" for key in keys)
    message = (
        f"micro-batching cannot combine training_step's {names} exactly from its micro-batches' values (a "
        "float is averaged by samples, any other object is the last micro-batch's), so on_train_batch_end "
        "may see other values than without micro-batching; return one value per sample (joined), an integer "
        "count (added), or a max, min, sum or mean over the samples as a tensor still attached to the graph "
        "(no .detach() or .item(): its reduction is read from it)"
    )
    if message not in seen:
        seen.add(message)
        rank_zero_warn(message)
