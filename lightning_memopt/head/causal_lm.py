"""A Hugging Face causal LM's loss through :func:`~lightning_memopt.head.linear_cross_entropy`.

``model(input_ids, labels=labels)`` of a ``*ForCausalLM`` (or GPT-2's ``*LMHeadModel``) computes every
logit, then ``cross_entropy`` on them shifted by one position: the logits-sized tensors dominate a step
whose blocks are checkpointed. :func:`take_over_heads` patches such a model's instance ``forward``: a call
with ``labels`` runs the base model (``getattr(model, model.base_model_prefix)``) for the last hidden
state and computes the loss chunk by chunk from it and the weight and bias of the model's output
embeddings (:func:`output_head`); it returns the model's output type with that ``loss`` and no logits
(``keep_logits=True`` also returns the logits, computed without gradient). Calls without labels, or
without gradient, run the model's own forward. Nothing else changes: the parameters, ``state_dict`` and
the model's own forward (restored by the returned undo).

Which models are taken. Only what reproduces the model's own loss; every other causal LM gets one note:

1. Declined from the model (:func:`decline_reason`): output embeddings that are not an ``nn.Linear`` or
   are sharded on their own (FSDP2's ``fully_shard`` on the head), no base model, a router's auxiliary
   loss added to the loss (``output_router_logits=True``, Mixtral and other MoE). Logit scaling (Cohere's
   ``logit_scale``, Granite's ``logits_scaling``) and a final logit soft-capping
   (``final_logit_softcapping``, Gemma 2/3) are computed chunk by chunk too (:func:`_logit_transform`).
2. Verified at the first call with labels and gradient (a head weight that is a DTensor then, as under
   tensor parallelism, is declined): on the batch's first sample (its first 64 positions), the hidden
   states entering the model's own head must be the base model's output; then the model's own loss and
   its gradient w.r.t. them are compared with the chunked path's (same random state, so dropout draws the
   same masks; the random state is put back after), with the labels shifted by one position, or, where
   that differs, not shifted (:attr:`ChunkedHead.shift`: TrOCR's, BART's and XLNet's losses compare
   position t with label t). A difference beyond rounding of the precision the step runs in
   (:func:`check_tolerances`: 1e-4 relative; the gradient ``4 * eps`` of autocast's dtype under
   ``bf16-mixed`` or ``16-mixed``) either way declines the head, naming the difference. The check's own
   logits are those of 64 positions, not of the batch.

The model's own loss upcasts logits to float32 (``logits.float()``), also a float64 model's; the chunked
loss keeps float64 in float64, and under autocast (or with half-precision weights) computes each chunk's
logits in half precision as the model's own head does, then its softmax and loss in float32: a float32
loss equal to the model's own under the same precision.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch

from lightning_memopt._compat import fsdp_module_type, is_dtensor
from lightning_memopt._patch import patch
from lightning_memopt._rng import RngState
from lightning_memopt.head.loss import compute_dtype, linear_cross_entropy
from lightning_memopt.memory.device import is_out_of_memory

__all__ = [
    "HeadMode",
    "ChunkedHead",
    "causal_lms",
    "check_head",
    "check_tolerances",
    "check_output_head",
    "decline_reason",
    "output_heads",
    "take_over_heads",
    "TakenHeads",
]

HeadMode = Literal["auto", "chunked", "keep"]
"""``"auto"``: take each causal LM whose loss the chunked head reproduces, decline others with a note;
``"chunked"``: the same, but a model that cannot be taken (or none found) is an error; ``"keep"``: off."""

_SUFFIXES = ("ForCausalLM", "LMHeadModel")
VERIFY_TOKENS = 64  # positions of the first sample on which the first batch's check compares
_NOT_FOR_BASE = ("labels", "logits_to_keep", "num_items_in_batch", "shift_labels", "return_dict")
# config attribute -> what it does to the logits or the loss that the chunked head does not reproduce
_DECLINED = {"output_router_logits": "a router auxiliary loss added to the loss"}


def check_head(head: Any) -> HeadMode:
    """``head``; ``ValueError`` unless it is one of :data:`HeadMode`."""
    if head not in get_args(HeadMode):
        raise ValueError(
            f"head must be one of {get_args(HeadMode)}, got {head!r}; 'keep' leaves the head alone"
        )
    return head


def causal_lms(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The Hugging Face causal LMs in ``module`` (itself included): a class named ``*ForCausalLM`` or
    ``*LMHeadModel`` that holds no other (one that does is a wrapper, such as a LightningModule named so).
    Whether each can be taken is :func:`decline_reason`'s question."""
    found = [m for m in module.modules() if type(m).__name__.endswith(_SUFFIXES)]
    return [m for m in found if not any(o is not m and _holds(m, o) for o in found)]


def _holds(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The ``nn.Linear`` that maps ``model``'s hidden states to its logits (its output embeddings, which
    transformers models name: ``lm_head``, BioGPT's ``output_projection``, RWKV's ``head``), or None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    return head if isinstance(head, torch.nn.Linear) else None


def check_output_head(head: object) -> str | None:
    """``head``; ``TypeError`` unless it is ``"auto"``, a submodule's name or None (:func:`output_heads`)."""
    if head is not None and not isinstance(head, str):
        raise TypeError(
            f"head must be 'auto', a submodule's name (e.g. 'lm_head') or None, got {head!r} "
            f"({type(head).__name__})"
        )
    return head


def output_heads(module: torch.nn.Module, head: str | None = "auto") -> list[torch.nn.Module]:
    """The output heads in ``module``, for a :class:`~lightning_memopt.memory.MemoryTracker`'s ``heads``.

    Args:
        module: The model.
        head: ``"auto"``: the output embeddings of each causal LM (:func:`causal_lms`,
            :func:`output_head`); a submodule's name (``"head"``): that one; None: none.

    Raises:
        ValueError: If ``module`` has no submodule named ``head``.
        TypeError: If ``head`` is neither a str nor None.
    """
    if check_output_head(head) is None:
        return []
    if head == "auto":
        return [h for m in causal_lms(module) if (h := output_head(m)) is not None]
    try:
        return [module.get_submodule(head)]
    except AttributeError:
        names = [n for n, _ in module.named_children()]
        raise ValueError(
            f"head={head!r} names no submodule of {type(module).__name__} (its children: {names}); pass the "
            "name of the module that computes the logits, 'auto' for Hugging Face causal LMs, or None"
        ) from None


def decline_reason(model: torch.nn.Module) -> str | None:
    """Why the chunked head cannot reproduce ``model``'s loss, read from its structure and config; None if
    nothing says (the first batch's check still may)."""
    name, head, fsdp = type(model).__name__, output_head(model), fsdp_module_type()
    if head is None:
        return f"{name}'s output embeddings are not an nn.Linear"
    if fsdp is not None and isinstance(head, fsdp):  # FSDP2 gathers its weight only while its forward runs
        return f"{name}'s output head is sharded on its own (fully_shard on it)"
    if not isinstance(getattr(model, getattr(model, "base_model_prefix", ""), None), torch.nn.Module):
        return f"{name} has no base model (base_model_prefix) whose output feeds the head"
    if torch.is_tensor(getattr(model, "logit_scale", None)):  # learned: its gradient would be lost
        return f"{name} has a learned logit scale (a tensor logit_scale)"
    config = getattr(model, "config", None)
    for attribute, what in _DECLINED.items():
        value = getattr(config, attribute, None)
        neutral = value is None or value is False or (not isinstance(value, bool) and value == 1)
        if not neutral:  # a scaling of 1 changes nothing
            return f"{name} has {what} (config.{attribute}={value!r})"
    return None


class ChunkedHead:
    """``model``'s instance ``forward`` patched to compute its loss chunk by chunk (module docstring).

    Args:
        model: A Hugging Face causal LM (:func:`causal_lms`).
        note: Called once with the reason when the head is declined at verification.
        strict: Raise ``RuntimeError`` instead of declining.
        keep_logits: Also return the logits (computed without gradient).
        verify: Compare with the model's own loss at the first call (module docstring); False trusts the
            config's check alone (the planner, on fake tensors, where no value can be compared).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        note: Callable[[str], None],
        strict: bool = False,
        keep_logits: bool = False,
        verify: bool = True,
    ) -> None:
        self.model, self.note, self.strict, self.keep_logits = model, note, strict, keep_logits
        self.verified = not verify
        self.declined: str | None = None
        self.own = False  # True: the model's own head computes the loss (the size search tries both)
        self.shift = True  # position t's logits predict label t + 1; learned at the first batch's check
        self._signature = inspect.signature(model.forward)
        self._undo: Callable[[], None] | None = patch(model, "forward", self._forward)

    @property
    def installed(self) -> bool:
        """The model's ``forward`` is patched (not undone, not declined)."""
        return self._undo is not None

    def undo(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def _forward(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        bound = self._signature.bind(*args, **kwargs).arguments
        call = {**bound.pop("kwargs", {}), **bound}
        if self.own or call.get("labels") is None or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if not self.verified:
            self.verified = True
            reason = self._verify(original, call)
            if reason is not None:
                return self._decline(reason, original(*args, **kwargs))
        return self.chunked(call)

    def _decline(self, reason: str, result: Any) -> Any:
        self.declined = reason
        self.undo()
        if self.strict:
            raise RuntimeError(
                f"head='chunked': {reason}; use head='auto' to fall back to the model's own head"
            )
        self.note(
            f"the chunked output head (lightning_memopt.head) is not used: {reason}; "
            "the model's own head computes the loss"
        )
        return result

    def chunked(self, call: dict[str, Any]) -> Any:
        """The model's output for ``call`` (its forward's arguments by name), the loss chunked."""
        model = self.model
        base = getattr(model, model.base_model_prefix)
        outputs = base(**_for_base(base, call))
        hidden = outputs[0]  # (B, T, H): last_hidden_state
        head = output_head(model)
        scale, cap = _logit_transform(model)
        labels = call.get("shift_labels")
        given = call["labels"] if labels is None else labels
        if given.shape != hidden.shape[:-1]:
            raise _Mismatch(
                f"its base model's output has {hidden.shape[-2]} positions where the labels have "
                f"{given.shape[-1]} (the model adds positions of its own, such as image tokens)"
            )
        if labels is None and self.shift:  # position t predicts token t + 1
            hidden, labels = hidden[..., :-1, :], call["labels"][..., 1:]
        elif labels is None:  # the labels are the next tokens already (TrOCR, BART's and XLNet's LM heads)
            labels = call["labels"]
        num_items = call.get("num_items_in_batch")
        loss = linear_cross_entropy(
            hidden,
            head.weight,
            labels.to(hidden.device),
            bias=head.bias,
            reduction="mean" if num_items is None else "sum",
            logit_scale=scale,
            softcap=cap,
        )
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        logits = None
        if self.keep_logits:
            with torch.no_grad():
                logits = head(outputs[0]) * scale
                logits = logits if cap is None else torch.tanh(logits / cap) * cap
        return _output(model, outputs, loss, logits)

    def _verify(self, original: Callable[..., Any], call: dict[str, Any]) -> str | None:
        """Why the chunked path differs from the model's own on a slice of the batch, or None (both agree).

        Compared: the hidden states entering the head (the own forward's input to :func:`output_head`, the
        base model's output on the chunked path), the loss and its gradient w.r.t. those hidden states
        (which decides every gradient before the head), on the first sample's first
        :data:`VERIFY_TOKENS` positions (a causal LM's loss on a prefix is its loss on that prefix alone):
        the own path's logits there are small; the whole first sample where the model's forward fails on
        the prefix. The labels are shifted by one position, or, where that differs and the model's own loss
        does not shift them, not (:attr:`shift`). Any failure of either path (but an out-of-memory error,
        which :class:`~lightning_memopt.OOMBackoff` handles) is a reason to decline, never a crash of the
        step: the step then runs the model's own forward on the whole batch.
        """
        if is_dtensor(output_head(self.model).weight):  # as it is while the model runs
            return "its output head's weight is a DTensor while the model runs (tensor parallelism)"
        # A prefix of the first sample; the whole first sample where the model rejects the cut (XLM's and
        # FlauBERT's per-sample ``lengths`` assert they fit the positions given).
        failed: Exception | None = None
        for part in (_prefix(call, VERIFY_TOKENS), _prefix(call, None)):
            try:
                own_hidden, own, own_grad = self._run(
                    lambda part=part: original(**part), output_head(self.model), pre=True
                )
                break
            except Exception as error:  # noqa: BLE001 - any failure of the slice: the step runs the batch
                if is_out_of_memory(error):
                    raise
                failed = error
        else:
            return f"the model's own forward fails on the first sample alone ({_describe(failed)})"
        if not bool(torch.isfinite(own)):  # every label of the slice ignored: check the next call
            self.verified = False
            return None
        loss_tol, grad_tol = check_tolerances(compute_dtype(own_hidden, output_head(self.model).weight))
        base, reasons = getattr(self.model, self.model.base_model_prefix), []
        for self.shift in (True, False):
            try:
                hidden, loss, grad = self._run(lambda: self.chunked(part), base, pre=False)
            except Exception as error:  # noqa: BLE001 - declined with the cause, never a crash of the step
                self.shift = True
                if is_out_of_memory(error):
                    raise
                if isinstance(error, _Mismatch):
                    return str(error)
                return f"the chunked loss fails on the first batch ({_describe(error)})"
            if hidden.shape != own_hidden.shape or _gap(hidden, own_hidden) > grad_tol:
                self.shift = True
                return "the hidden states entering its output head are not its base model's output"
            if (gap := _gap(loss, own)) > loss_tol:
                reasons.append(
                    f"its loss differs from the model's own by {gap:.2g} (relative) on the first batch"
                )
            elif (gap := _gap(grad, own_grad)) > grad_tol:
                reasons.append(
                    f"its gradient differs from the model's own by {gap:.2g} (relative) on the first batch"
                )
            else:
                return None
        self.shift = True
        return reasons[0]

    def _run(self, run: Callable[[], Any], module: torch.nn.Module, pre: bool) -> tuple[torch.Tensor, ...]:
        """``run()``'s hidden states (``module``'s input if ``pre``, else its output), loss, and the loss's
        gradient w.r.t. those hidden states; the random state as before (the same dropout masks in each)."""
        seen: list[torch.Tensor] = []
        if pre:
            handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        else:
            handle = module.register_forward_hook(lambda m, args, out: seen.append(out[0]))
        state = RngState.capture()
        try:
            loss = run().loss
            return seen[-1].detach(), loss.detach(), *torch.autograd.grad(loss, seen[-1])
        finally:
            handle.remove()
            state.restore()


def check_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """The first batch's relative tolerances (loss, gradient) when the head's matmuls run in ``dtype``.

    float32 and float64: 1e-4 both (the model's own loss is float32 either way: ``logits.float()``). Half
    precision (``bf16-mixed``, ``16-mixed``: autocast's dtype): both paths compute the same half-precision
    logits and a float32 loss, so the loss agrees to float32 rounding of a sum (1e-4); the gradients w.r.t.
    the hidden states are products rounded to half precision on both paths, each element within an
    ulp or two of the other's: ``4 * eps`` (bf16: 0.031, fp16: 0.0039). A different shift or a transform of
    the logits moves the loss by far more than 1e-4.
    """
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-4, 4 * torch.finfo(dtype).eps
    return 1e-4, 1e-4


def _logit_transform(model: torch.nn.Module) -> tuple[float, float | None]:
    """What the model does to its head's logits before the loss: a scale (Cohere multiplies by
    ``logit_scale``, Granite divides by ``config.logits_scaling``), then Gemma 2's and 3's soft-capping
    (``softcap * tanh(logits / softcap)``, ``config.final_logit_softcapping``)."""
    config = getattr(model, "config", None)
    scale = float(getattr(model, "logit_scale", None) or getattr(config, "logit_scale", None) or 1.0)
    scale /= float(getattr(config, "logits_scaling", None) or 1.0)
    return scale, getattr(config, "final_logit_softcapping", None) or None


class _Mismatch(ValueError):
    """The base model's output does not line up with the labels: the chunked head cannot compute this loss."""


def _describe(error: BaseException) -> str:
    """``error`` in one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _prefix(call: dict[str, Any], tokens: int | None) -> dict[str, Any]:
    """``call`` cut to the first sample and its first ``tokens`` positions (the labels' dims 0 and 1; None:
    all of them)."""
    n, t = call["labels"].shape[:2]

    def cut(v: Any) -> Any:
        if not (torch.is_tensor(v) and v.dim() and v.shape[0] == n):
            return v
        return v[:1, :tokens] if tokens is not None and v.dim() > 1 and v.shape[1] == t else v[:1]

    return {k: cut(v) for k, v in call.items()}


def _for_base(base: torch.nn.Module, call: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(base.forward).parameters
    open_ = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in call.items() if k not in _NOT_FOR_BASE and (open_ or k in params)}


def _output(model: torch.nn.Module, outputs: Any, loss: torch.Tensor, logits: torch.Tensor | None) -> Any:
    """The model's own output type (its forward's return annotation) with the base model's fields."""
    kind = inspect.signature(type(model).forward).return_annotation
    if not (dataclasses.is_dataclass(kind) and isinstance(kind, type)):
        from transformers.modeling_outputs import CausalLMOutputWithPast as kind  # noqa: N813
    names = {f.name for f in dataclasses.fields(kind)}
    fields = {k: v for k, v in outputs.items() if k in names}
    # Without logits, reading them says why there are none, rather than handing back None.
    return (kind if logits is not None else _without_logits(kind))(**fields, loss=loss, logits=logits)


_WITHOUT_LOGITS: dict[type, type] = {}
# top-level modules whose code reads every field of an output (None for the logits there)
_FIELD_WALKERS = frozenset({"torch", "transformers", "lightning", "pytorch_lightning", "dataclasses", "copy"})
NO_LOGITS = (
    "this output has no logits: its loss was computed chunk by chunk from the hidden states without them "
    "(AutoCheckpoint's head='auto', lightning_memopt.head); pass AutoCheckpoint(head='keep') to read "
    "outputs.logits"
)


def _without_logits(kind: type) -> type:
    """``kind`` whose ``logits`` attribute raises :data:`NO_LOGITS` when the user's code reads it (one
    subclass per output type). Library code that walks an output's fields reads None: transformers'
    ``__post_init__``, torch's pytree and FSDP2's hooks on a forward's output, Lightning's collections."""
    if kind not in _WITHOUT_LOGITS:

        def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
            if name == "logits":
                caller = sys._getframe(1).f_globals.get("__name__", "").partition(".")[0]
                if caller not in _FIELD_WALKERS:
                    raise AttributeError(NO_LOGITS)
            return kind.__getattribute__(self, name)

        def __repr__(self: Any) -> str:  # noqa: N807
            shown = ", ".join(f"{k}={v!r}" for k, v in self.items())
            return f"{kind.__name__}({shown}, logits not computed)"

        methods = {"__getattribute__": __getattribute__, "__repr__": __repr__}
        _WITHOUT_LOGITS[kind] = type(kind.__name__, (kind,), methods)
    return _WITHOUT_LOGITS[kind]


class TakenHeads:
    """The heads :func:`take_over_heads` patched: calling it undoes them all (safe twice)."""

    def __init__(self, heads: list[ChunkedHead]) -> None:
        self.heads = heads

    def __call__(self) -> None:
        for head in self.heads:
            head.undo()

    @property
    def installed(self) -> bool:
        """Some model's loss is computed chunked (a head patched, not undone, not declined)."""
        return any(head.installed for head in self.heads)

    def use_own(self, own: bool) -> None:
        """Let each model's own head compute its loss (``own``), or the chunks again."""
        for head in self.heads:
            head.own = own


def take_over_heads(
    module: torch.nn.Module,
    head: HeadMode,
    *,
    note: Callable[[str], None],
    keep_logits: bool = False,
    verify: bool = True,
) -> TakenHeads:
    """Patch every causal LM in ``module`` (:func:`causal_lms`) to compute its loss chunked; return the heads
    patched (:class:`TakenHeads`: call it to undo them).

    ``head="auto"`` notes each model declined from its config (and, later, at verification); ``"chunked"``
    raises ``RuntimeError`` instead, and when ``module`` holds no causal LM; ``"keep"`` changes nothing.
    ``verify=False`` skips the first call's comparison with the model's own loss (see :class:`ChunkedHead`).
    """
    check_head(head)
    heads: list[ChunkedHead] = []
    if head != "keep":
        models = causal_lms(module)
        if not models and head == "chunked":
            raise RuntimeError(
                "head='chunked' found no Hugging Face causal LM (a *ForCausalLM or *LMHeadModel) "
                f"in {type(module).__name__}; call linear_cross_entropy in training_step instead, or pass "
                "head='auto'"
            )
        for model in models:
            if (reason := decline_reason(model)) is None:
                strict = head == "chunked"
                heads.append(
                    ChunkedHead(model, note=note, strict=strict, keep_logits=keep_logits, verify=verify)
                )
            elif head == "chunked":
                raise RuntimeError(f"head='chunked': {reason}; use head='auto' to keep the model's own head")
            else:
                note(f"the chunked output head (lightning_memopt.head) is not used: {reason}")
    return TakenHeads(heads)
