"""What a micro-batch's loss divides by, learned from torch's loss functions as ``training_step`` calls them.

:class:`LossObserver` records the loss calls of a micro-batch, :func:`decompose` writes the returned loss
as parts of those calls, :func:`learn` finds for each mean part a :class:`Rule` that computes its count
from a micro-batch; :class:`Weigher` weighs micro-batches with the rules across the fit. The whole
method: ``docs/micro_batching.md``, "Exact by verification".
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import _reduction
from torch.overrides import TorchFunctionMode

from lightning_memopt._tree import numbers
from lightning_memopt.batching.split import micro_batch_weights, tensors_of
from lightning_memopt.head.loss import linear_cross_entropy

__all__ = [
    "LOSS_FUNCTIONS",
    "LossObserver",
    "Part",
    "Rule",
    "Term",
    "Weigher",
    "Weighting",
    "decompose",
    "learn",
]


def _items(shape: torch.Size | tuple) -> int:
    return int(torch.Size(shape).numel())


def _class_count(a: dict) -> torch.Tensor | None:
    """What ``cross_entropy``/``nll_loss`` with index targets divide by; None for probability targets."""
    target = a["target"]
    if target.is_floating_point():
        return None
    counted = target != a["ignore_index"]
    weight = a.get("weight")
    if weight is None:
        return counted.sum()
    return weight[target.masked_fill(~counted, 0)].masked_fill(~counted, 0).sum()


def _elements(a: dict, *names: str) -> torch.Tensor:
    shapes = [a[n].shape for n in names if isinstance(a.get(n), torch.Tensor)]
    return torch.tensor(_items(torch.broadcast_shapes(*shapes)))


def _batch_dim(name: str, batched: int) -> Callable[[dict], torch.Tensor]:
    """The count of a loss averaged over its batch dimension (dim 0 of ``name`` when it has ``batched`` dims)."""
    return lambda a: torch.tensor(a[name].shape[0] if a[name].dim() == batched else 1)


def _ce(a: dict) -> torch.Tensor:
    count = _class_count(a)
    if count is not None:
        return count
    logits = a["input"]  # probabilities as targets: a mean over every position but the class dim
    return torch.tensor(_items(logits.shape) // (logits.shape[1] if logits.dim() > 1 else logits.shape[0]))


#: The loss functions observed, and what each divides by with ``reduction="mean"`` (from its arguments
#: bound by name). ``kl_div`` with ``"batchmean"`` divides by dim 0 of its input.
LOSS_FUNCTIONS: dict[Callable, Callable[[dict], torch.Tensor]] = {
    F.cross_entropy: _ce,
    F.nll_loss: lambda a: _class_count(a),
    F.mse_loss: lambda a: _elements(a, "input", "target"),
    F.l1_loss: lambda a: _elements(a, "input", "target"),
    F.smooth_l1_loss: lambda a: _elements(a, "input", "target"),
    F.huber_loss: lambda a: _elements(a, "input", "target"),
    F.soft_margin_loss: lambda a: _elements(a, "input", "target"),
    F.binary_cross_entropy: lambda a: _elements(a, "input", "target"),
    F.binary_cross_entropy_with_logits: lambda a: _elements(a, "input", "target"),
    F.poisson_nll_loss: lambda a: _elements(a, "input", "target"),
    F.gaussian_nll_loss: lambda a: _elements(a, "input", "target", "var"),
    F.kl_div: lambda a: _elements(a, "input", "target"),
    F.hinge_embedding_loss: lambda a: _elements(a, "input", "target"),
    F.margin_ranking_loss: lambda a: _elements(a, "input1", "input2", "target"),
    F.cosine_embedding_loss: lambda a: torch.tensor(_items(a["target"].shape)),
    F.multilabel_soft_margin_loss: _batch_dim("input", 2),
    F.multi_margin_loss: _batch_dim("input", 2),
    F.multilabel_margin_loss: _batch_dim("input", 2),
    F.triplet_margin_loss: _batch_dim("anchor", 2),
    F.ctc_loss: _batch_dim("log_probs", 3),
    linear_cross_entropy: lambda a: _class_count(a),
}
# Arguments named otherwise than F.cross_entropy's: the labels are its target, and its weight is the
# output projection, not class weights.
_RENAMED = {linear_cross_entropy: lambda a: {**a, "target": a["labels"], "weight": None}}
_SIGNATURES = {func: inspect.signature(func) for func in LOSS_FUNCTIONS}


@dataclass
class Term:
    """One call of a loss function during a micro-batch's ``training_step``."""

    name: str
    """The function's name, e.g. ``"cross_entropy"``."""
    output: torch.Tensor
    """What it returned."""
    reduction: str
    """``"mean"``, ``"sum"``, ``"none"`` or ``"batchmean"``."""
    count: torch.Tensor | None
    """What a mean divides by (0-dim); None for other reductions."""
    target: torch.Tensor | None = None
    """Index targets of ``cross_entropy``/``nll_loss`` (to learn which batch entries are counted)."""
    ignore_index: int | None = None
    weight: torch.Tensor | None = None
    """Class weights of ``cross_entropy``/``nll_loss``."""


class LossObserver(TorchFunctionMode):
    """Records the loss function calls (:data:`LOSS_FUNCTIONS`) made while it is active, as :class:`Term`.

    Every other torch function passes straight through. Calls made without gradient (metrics, logging
    under ``no_grad``) are not recorded: they cannot be part of the loss.
    """

    def __init__(self) -> None:
        super().__init__()
        self.terms: list[Term] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in LOSS_FUNCTIONS and isinstance(out, torch.Tensor) and out.requires_grad:
            self.terms.append(_term(func, args, kwargs, out))
        return out


def _term(func: Callable, args: tuple, kwargs: dict, out: torch.Tensor) -> Term:
    bound = _SIGNATURES[func].bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    a = _RENAMED.get(func, dict)(a)
    if a.get("size_average") is not None or a.get("reduce") is not None:  # the pre-1.0 spelling
        a["reduction"] = _reduction.legacy_get_string(a.get("size_average"), a.get("reduce"))
    reduction = a.get("reduction", "mean")
    with torch.no_grad():
        if reduction == "batchmean":
            count: torch.Tensor | None = torch.tensor(a["input"].shape[0] if a["input"].dim() else 1)
        else:
            count = LOSS_FUNCTIONS[func](a) if reduction == "mean" else None
    indexed = "ignore_index" in a and not a["target"].is_floating_point()
    return Term(
        name=func.__name__,
        output=out,
        reduction=reduction,
        count=count,
        target=a["target"].detach() if indexed else None,
        ignore_index=a["ignore_index"] if indexed else None,
        weight=a.get("weight") if indexed else None,
    )


@dataclass
class Part:
    """One observed loss call's share of the returned loss: ``loss = sum(part.value) + remainder``."""

    term: Term
    value: torch.Tensor
    """The part's contribution to the loss (0-dim, differentiable): its coefficient times the term."""
    kind: str
    """``"mean"`` (weighs its share of :attr:`count`), ``"sum"`` (weighs 1) or ``"unknown"``."""
    count: float = 0.0
    """For a mean: the items it divides by in this micro-batch."""
    counted: torch.Tensor | None = None
    """For a mean over entries picked by hand (``reduction="none"``): which entries count."""


def decompose(loss: torch.Tensor, terms: Sequence[Term]) -> list[Part]:
    """The returned ``loss`` as the parts that the observed ``terms`` contribute to it.

    A term's coefficient is ``d loss / d term`` (one small backward through the arithmetic between them).
    A scalar term keeps its reduction. A ``reduction="none"`` term is a mean when its nonzero coefficients
    are equal and add up to 1 (``.mean()``, a masked mean), a sum when they are equal otherwise
    (``.sum()``, ``.sum() / self.batch_size``), and unknown when they differ (a weighted mean).
    """
    used = [t for t in terms if t.output.grad_fn is not None]
    if not used or loss.grad_fn is None:
        return []
    grads = torch.autograd.grad(loss, [t.output for t in used], retain_graph=True, allow_unused=True)
    parts = []
    for term, grad in zip(used, grads):
        if grad is None or not bool(grad.any()):
            continue  # computed but not part of the loss (a metric, a logged value)
        value = (grad.detach() * term.output).sum()
        if term.output.dim() == 0 and term.reduction != "none":
            kind = "sum" if term.reduction == "sum" else "mean"
            count = float(term.count) if term.count is not None else 0.0
            parts.append(Part(term, value, kind, count))
            continue
        nonzero = grad != 0
        scale = grad[nonzero]
        if not bool(torch.allclose(scale, scale[:1].expand_as(scale), rtol=1e-6, atol=0)):
            parts.append(Part(term, value, "unknown"))
            continue
        n = int(nonzero.sum())
        mean = abs(float(scale[0]) * n - 1) <= 1e-6
        parts.append(Part(term, value, "mean" if mean else "sum", float(n), nonzero if mean else None))
    return parts


# ---------------------------------------------------------------------- rules
@dataclass(frozen=True)
class Rule:
    """How many items of a micro-batch a mean counts, computed from the micro-batch itself.

    ``path`` None: ``per`` items for each sample (the batch's dim 0). Else the entries of the batch tensor
    at ``path``, after dropping its first (``shift=1``) or last (``shift=-1``) position along dim 1, that
    are not ``ignore`` (nonzero ones for ``ignore=None``: a mask), each counting its class weight if
    ``weight`` is given. ``width``: the ignore index is the length (dim 1) of the batch tensor at that
    path, whatever the batch (extractive QA ignores answer positions outside the input, ``ignore_index``
    = its length); ``clamp``: entries at or past the ignore index are ignored too (the loss clamps them
    onto it first). Rules are equal when they give the same shares (``per`` cancels out).
    """

    path: str | None = None
    shift: int = 0
    ignore: int | None = None
    weight: torch.Tensor | None = field(default=None, compare=False)
    per: float = field(default=1.0, compare=False)
    width: str | None = None
    clamp: bool = False

    def count(self, micro_batch: Any, samples: int) -> float:
        return numbers([self.counted(micro_batch, samples)])[0]

    def counted(self, micro_batch: Any, samples: int) -> torch.Tensor | float:
        """:meth:`count`, a tensor not yet read back where the micro-batch's tensors give it."""
        if self.path is None:
            return self.per * samples
        tensors = dict(tensors_of(micro_batch, strict=False))
        x = tensors[self.path]
        if self.shift:
            x = x[:, 1:] if self.shift > 0 else x[:, :-1]
        ignore = self.ignore if self.width is None else tensors[self.width].shape[1]
        if ignore is None:
            counted = x != 0
        else:
            counted = x.clamp(0, ignore) != ignore if self.clamp else x != ignore
        if self.weight is None:
            return counted.sum()
        return self.weight[x.masked_fill(~counted, 0).long()].masked_fill(~counted, 0).sum()

    def __str__(self) -> str:
        if self.path is None:
            return "samples"
        where = {0: "", 1: "[:, 1:]", -1: "[:, :-1]"}[self.shift]
        ignore = self.ignore if self.width is None else f"{self.width}.shape[1]"
        test = " != 0" if self.ignore is None else (f" < {ignore}" if self.clamp else f" != {ignore}")
        return f"({self.path}{where}{test}).sum()" + (" weighted by class" if self.weight is not None else "")


SUM = "sum"  # the "rule" of a sum: every micro-batch weighs 1


def _candidates(part: Part, micro_batch: Any) -> list[Rule]:
    """Rules that could explain ``part``'s count, most specific first: the batch's integer tensors compared
    with the call's own ignore index, then the batch's tensors as masks (labels built from an attention
    mask, a float mask of observed targets); samples come after them (:func:`learn`)."""
    term = part.term
    if term.target is None and part.counted is None:
        return []
    tensors = [(p, x) for p, x in tensors_of(micro_batch, strict=False) if x.dim() > 0 and not x.is_complex()]
    found = []
    for ignore in [term.ignore_index, None] if term.target is not None else [None]:
        weight = term.weight if ignore is not None else None
        ways: list[tuple[str | None, bool]] = [(None, False)]
        # An index past the classes (extractive QA: the input's length) may follow the length, be clamped.
        if ignore is not None and ignore >= 0:
            widths = [None] + [p for p, x in tensors if x.dim() >= 2 and x.shape[1] == ignore]
            ways = [(w, clamp) for w in widths for clamp in (False, True)]
        for path, x in tensors:
            if ignore is not None and x.is_floating_point():
                continue  # an ignore index compares with integer targets
            for shift in (0, 1, -1) if x.dim() >= 2 else (0,):
                found += [Rule(path, shift, ignore, weight, width=w, clamp=c) for w, c in ways]
    return found


def learn(part: Part, micro_batch: Any, samples: int) -> list[Rule] | str:
    """The rules that give ``part``'s count on ``micro_batch`` (best first), or :data:`SUM` for a sum.

    Samples always reproduce one micro-batch's count (its items per sample are free), so they come last:
    the count of a loss over index targets is first looked for in the batch's own integer tensors.
    """
    if part.kind == "sum":
        return SUM
    found = [r for r in _candidates(part, micro_batch) if _close(r.count(micro_batch, samples), part.count)]
    return found + [Rule(per=part.count / samples)]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1.0)


class Weighting:
    """The rules learned for the parts of one batch structure's loss: every rule that explains each part's
    count on a step's first micro-batch, narrowed by later micro-batches (:meth:`confirm`)."""

    def __init__(self, parts: list[Part], micro_batch: Any, samples: int) -> None:
        self.signature = [(p.term.name, p.kind) for p in parts]
        self.unknown = not parts or any(p.kind == "unknown" for p in parts)
        self.lost = [False] * len(parts)  # a part whose counts no rule followed across micro-batches
        self.rules: list[list[Rule] | str] = [learn(p, micro_batch, samples) for p in parts]

    def confirm(self, parts: list[Part], micro_batch: Any, samples: int) -> bool:
        """Keep the rules that also explain ``parts`` of another micro-batch; False if a part lost its first
        rule (the weights given so far were wrong) or the parts are not the same calls."""
        if [(p.term.name, p.kind) for p in parts] != self.signature:
            return False
        intact = True
        for i, part in enumerate(parts):
            if self.rules[i] == SUM:
                continue
            kept = [r for r in self.rules[i] if _close(r.count(micro_batch, samples), part.count)]
            intact = intact and bool(kept) and kept[0] == self.rules[i][0]
            self.lost[i] = self.lost[i] or not kept
            self.rules[i] = kept or [Rule(per=part.count / samples)]
        return intact

    def rule(self, index: int) -> Rule | str:
        chosen = self.rules[index]
        return chosen if chosen == SUM else chosen[0]

    @property
    def unexplained(self) -> bool:
        """Whether a part is weighed by samples for want of an explanation: a loss that calls no observed
        function, a weighted mean by hand, or a mean whose counts no rule followed (not even samples)."""
        return self.unknown or any(self.lost)

    def agreed_shares(self, micro_batches: Sequence[Any], sizes: Sequence[int]) -> list[float] | None:
        """The micro-batches' weights when every rule still possible for every part gives the same ones on
        this batch (the step need not be observed); None where they differ."""
        rules = [rule for rules in self.rules for rule in ([rules] if rules == SUM else rules)] or [Rule()]
        first, *others = shares(rules, micro_batches, sizes)
        if all(_close(a, b) for weights in others for a, b in zip(weights, first)):
            return first
        return None


def shares(
    rules: Sequence[Rule | str], micro_batches: Sequence[Any], sizes: Sequence[int]
) -> list[list[float]]:
    """Each micro-batch's weight under each of ``rules``: its share of the batch's count, or 1 for a sum;
    every count read back from the device at once (a steady step reads the device once, before its first
    forward).

    A batch that counts nothing at all (every label ignored) has a mean over nothing either way; its
    micro-batches are weighed by samples then.
    """
    counted = [r.counted(mb, n) for r in rules if r != SUM for mb, n in zip(micro_batches, sizes)]
    read = iter(numbers(counted))
    result = []
    for rule in rules:
        if rule == SUM:
            result.append([1.0] * len(sizes))
            continue
        counts = [next(read) for _ in sizes]
        total = sum(counts)
        if total <= 0:
            counts, total = [float(n) for n in sizes], float(sum(sizes))
        result.append([c / total for c in counts])
    return result


def batch_key(batch: Any) -> str:
    """What makes two batches one structure for the learned rules: their tensors' paths, dtypes and dims."""
    tensors = ", ".join(f"{p}: {str(t.dtype)[6:]}[{t.dim()}]" for p, t in tensors_of(batch, strict=False))
    return f"{type(batch).__name__}({tensors})"


class Weigher:
    """What the engine knows about the weights of its micro-batches, across the fit.

    Args:
        count_fn: The user's ``count_fn`` (or ``"sum"``); None: learn from the loss.
    """

    def __init__(self, count_fn: Callable[[Any], Any] | str | None = None) -> None:
        self.count_fn = count_fn
        self.learned: dict[str, Weighting] = {}

    def step(self, batch: Any, micro_batches: list[Any], sizes: list[int]) -> StepWeights:
        """The weights of one pass over ``micro_batches`` of ``batch``."""
        return StepWeights(self, batch_key(batch), micro_batches, sizes)

    def unexplained(self, batch: Any) -> bool:
        """Whether ``batch``'s loss was weighed by samples for want of an explanation."""
        learned = self.learned.get(batch_key(batch))
        return self.count_fn is None and (learned is None or learned.unexplained)


class StepWeights:
    """The weights of one pass over a batch's micro-batches (:meth:`Weigher.step`)."""

    def __init__(self, weigher: Weigher, key: str, micro_batches: list[Any], sizes: list[int]) -> None:
        self.weigher, self.key, self.micro_batches, self.sizes = weigher, key, micro_batches, sizes
        self.values: list[torch.Tensor] = []
        self.relearned = False  # a rule used for an earlier micro-batch of this pass turned out wrong
        learned = weigher.learned.get(key)
        self.weights: list[float] | None = None
        if len(sizes) == 1:
            self.weights = [1.0]
        elif weigher.count_fn == SUM:
            self.weights = [1.0] * len(sizes)
        elif weigher.count_fn is not None:
            self.weights = micro_batch_weights(micro_batches, sizes, weigher.count_fn)
        elif learned is not None:
            self.weights = learned.agreed_shares(micro_batches, sizes)

    def observing(self) -> contextlib.AbstractContextManager:
        """Around a micro-batch's ``training_step``: records its loss calls where the weights need them."""
        return contextlib.nullcontext() if self.weights is not None else LossObserver()

    def weighted(self, index: int, loss: torch.Tensor, observer: LossObserver | None) -> torch.Tensor:
        """Micro-batch ``index``'s loss as its backward must see it (its padding repeats weigh 0)."""
        if index >= len(self.sizes):
            return loss * 0.0
        if self.weights is not None:
            result = loss * self.weights[index] if len(self.sizes) > 1 else loss
        else:
            result = self._by_parts(index, loss, decompose(loss, observer.terms))
        self.values.append(result.detach())
        return result

    def _by_parts(self, index: int, loss: torch.Tensor, parts: list[Part]) -> torch.Tensor:
        mb, n = self.micro_batches[index], self.sizes[index]
        learned = self.weigher.learned.get(self.key)
        if learned is None or (index == 0 and learned.signature != [(p.term.name, p.kind) for p in parts]):
            learned = self.weigher.learned[self.key] = Weighting(parts, mb, n)
        elif not learned.confirm(parts, mb, n):
            self.relearned = True
        weights = [
            w[index]
            for w in shares([learned.rule(j) for j in range(len(parts))], self.micro_batches, self.sizes)
        ]
        rest = weights[0] if weights else self.sizes[index] / sum(self.sizes)
        if len(set(weights)) <= 1:
            return loss * rest
        return loss * rest + sum((w - rest) * p.value for w, p in zip(weights, parts))

    @property
    def loss(self) -> torch.Tensor:
        """The whole batch's loss: the micro-batches' weighted losses added (those that count nothing, NaN
        means over no item, left out)."""
        values = torch.stack(self.values)  # no read back: the step goes on to the optimizer unsynced
        nan = values.isnan()
        return torch.where(nan.all(), values.sum(), values.masked_fill(nan, 0).sum())
