"""``cross_entropy(hidden @ weight.T + bias, labels)`` without ever holding the whole logits.

A language model's output head turns ``N`` tokens of ``H`` features into ``N x V`` logits (V: the
vocabulary, 50,257 for GPT-2). Plain autograd then holds three tensors of that size at once: the logits,
the log-softmax ``cross_entropy`` saves, and the logits' gradient; with checkpointed blocks they dominate
the step. :func:`linear_cross_entropy` computes the same loss a chunk of tokens at a time, and each chunk's
gradient while its logits are at hand (the softmax minus the smoothed one-hot target), so at most one
chunk's logits exist at any time and nothing logits-sized is kept for backward:

* ``reduction="mean"`` or ``"sum"``: the gradients w.r.t. ``hidden``, ``weight`` and ``bias`` are complete
  after the forward (the loss is a scalar: backward only scales them by its incoming gradient). Held from
  forward to backward: tensors of the inputs' sizes, no logits. The matmuls are the same three as
  autograd's (logits, and the two gradient products), so the time is the same.
* ``reduction="none"``: each token's gradient is scaled by its own incoming gradient, known only in
  backward; the forward keeps each token's log-sum-exp (``N`` numbers) and backward recomputes each
  chunk's logits (one more matmul than autograd's three).

The loss per token ``i`` with target ``y`` and label smoothing ``e`` over ``V`` classes (PyTorch's
definition) is ``(1 - e) * (lse_i - z_iy) + e * (lse_i - mean_j z_ij)``, and its gradient w.r.t. the
logits is ``softmax(z_i) - (1 - e) * onehot(y) - e / V``; tokens whose label is ``ignore_index`` count
zero and are not counted by the mean. With ``logit_scale`` ``s`` and ``softcap`` ``c`` the logits are
``c * tanh(s * z / c)`` first, and the gradient is multiplied by ``s * (1 - tanh(s * z / c)^2)`` on its way
back to ``z``.

Precision (:func:`compute_dtype`). Under autocast (``bf16-mixed``, ``16-mixed``) or with half-precision
inputs the matmuls run in half precision, as an ``nn.Linear`` head's would; each chunk's logits are upcast
to float32 before the softmax (a Hugging Face model's ``logits.float()``; computed a slice of the vocabulary
at a time, so no float32 copy of a chunk's logits exists), and the loss is float32. The weight's gradient:

* with one chunk, its one product, as autograd's;
* with more, for a half-precision weight (``bf16-true``), and on CUDA (:data:`WEIGHT_GRADIENT_BY_COLUMNS`)
  for any weight, a second pass over slices of the vocabulary, each as large as a chunk, computes each
  slice's logits for every token again and its gradient rows in one matmul (float32 inside, rounded once,
  as autograd's): one matmul more, and nothing weight-sized read and written by every chunk;
* with more, for a float32 weight under autocast on a CPU (``bf16-mixed``), summed over the chunks in
  float32, the weight's own dtype, so the CPU runs autograd's three matmuls.

At the Llama-3 shape (16,384 tokens, 128,256 x 2,048, bf16) the head holds 725.5 MiB above its inputs,
where the plain head holds 24,048 MiB (``benchmarks/head.py --bound``). float32 and float64 inputs compute
in their own dtype, their weight's gradient summed over the chunks.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import handle_torch_function, has_torch_function

from lightning_memopt._checks import check_positive_int
from lightning_memopt._compat import mark_dynamic
from lightning_memopt._text import first_line
from lightning_memopt.memory.tracker import open_head

__all__ = ["linear_cross_entropy", "default_chunk_size", "compute_dtype"]

_REDUCTIONS = ("mean", "sum", "none")
Backend = Literal["auto", "package", "compiled", "eager", "liger"]
"""Who computes :func:`linear_cross_entropy`: ``"auto"`` (Liger Kernel where it applies, else the
package's chunks), ``"package"`` (the chunks), ``"compiled"`` (the chunks, their per-chunk work compiled on
any device), ``"eager"`` (the chunks, never compiled), ``"liger"`` (see its ``backend`` argument)."""
COMPILES_BY_DEFAULT = ("cuda",)
"""Device types where ``"auto"`` and ``"package"`` compile the per-chunk work: on a GPU each of its eager
elementwise passes reads and writes a chunk's logits from memory, which compiled kernels fuse into a few;
on a CPU a chunk is already a few large matmuls and compiling takes seconds (``"compiled"`` asks for it)."""
_HALF = (torch.float16, torch.bfloat16)
CHUNKS = 16  # the default number of chunks: one chunk's logits are 1/16 of the whole logits
# A weight larger than a device's caches is read from memory by each chunk's three matmuls: below this many
# tokens a chunk does too little work per weight byte (the matmuls are memory-bound; many small launches).
MIN_TOKENS = {"cpu": 128, "cuda": 512}
CACHED_WEIGHT = 32 * 2**20  # bytes: a weight this small stays in the caches; no floor on the chunk
# At most this many bytes of float32 logits a chunk, where 1/16 of the logits is more (long batches).
MAX_CHUNK_BYTES = 256 * 2**20
# Bytes of one float32 slice of a chunk's half-precision logits (its softmax) or of the weight's gradient
SLICE_BYTES = 16 * 2**20
WEIGHT_GRADIENT_BY_COLUMNS = ("cuda",)
"""Device types where a head whose matmuls run in half precision computes its weight's gradient in a second
pass over slices of the vocabulary (:func:`_weight_gradient_by_columns`: one matmul more, no weight-sized sum
read and written by every chunk) whatever the weight's dtype. Elsewhere only a half-precision weight's is:
a float32 weight's (under autocast) is summed over the chunks in float32 (:class:`_WeightGradient`). On a
GPU the sum's memory traffic costs more than the matmul. On a CPU, measured (``benchmarks/head.py --shapes
--dtype``): summing a bfloat16 weight's gradient in float32 products costs more than the matmul, while a
float32 weight's sum is its own dtype's and costs less."""


def default_chunk_size(
    tokens: int, vocab: int | None = None, hidden: int | None = None, device: str | torch.device = "cpu"
) -> int:
    """Tokens per chunk when ``chunk_size`` is None: ``ceil(tokens / 16)``, and, given the shapes, never so
    few that the matmuls starve nor so many that a chunk's logits exceed :data:`MAX_CHUNK_BYTES`.

    Sixteen chunks keep one chunk's logits at 1/16 of the whole (GPT-2 small at 2 x 1,024 tokens: 128
    tokens, 24.5 MiB in fp32). Every chunk reads the whole weight three times (logits, and the two gradient
    products): where the weight (``vocab x hidden``) is larger than the caches (:data:`CACHED_WEIGHT`), a
    chunk has at least :data:`MIN_TOKENS` tokens for ``device``'s type (128 on a CPU, 512 on CUDA: few large
    matmuls). Where 1/16 of the logits is more than :data:`MAX_CHUNK_BYTES` (256 MiB), a chunk has that
    many bytes of logits (but not fewer tokens than the floor).

    Args:
        tokens: Tokens in the batch (``N``).
        vocab: The vocabulary (``V``); None: the 1/16 rule alone.
        hidden: The features (``H``); None: the 1/16 rule alone.
        device: Where the head runs (a type: ``"cpu"``, ``"cuda"``; other types count as CUDA).

    Example::

        >>> default_chunk_size(2046)  # GPT-2 small, 2 x 1,023 shifted tokens
        128
        >>> default_chunk_size(512, 128256, 2048)  # a CPU, Llama 3: 1/16 would be 32 tokens
        128
        >>> default_chunk_size(16384, 128256, 2048, "cuda")  # 1,024 tokens would hold 501 MiB of logits
        523
    """
    chunk = max(1, math.ceil(tokens / CHUNKS))
    if vocab is None or hidden is None:
        return chunk
    kind = torch.device(device).type
    floor = MIN_TOKENS.get(kind, MIN_TOKENS["cuda"])
    if vocab * hidden * 4 > CACHED_WEIGHT:
        chunk = max(chunk, floor)
    chunk = min(chunk, max(floor, MAX_CHUNK_BYTES // (vocab * 4)))
    return max(1, min(chunk, tokens))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), labels, ...)``, computed a chunk of tokens at a time.

    Loss and gradients (w.r.t. ``hidden``, ``weight`` and ``bias``) equal the unchunked computation's up
    to rounding; only the order of the sums differs. A weight shared with an embedding (tied) gets both
    gradients added, as with autograd. Micro-batching (:class:`~lightning_memopt.AutoAccumulation`,
    :class:`~lightning_memopt.OOMBackoff`) sees the call like ``F.cross_entropy``'s and counts the labels
    that are not ``ignore_index``.

    Args:
        hidden: The features, ``(..., H)`` (any number of leading dims, e.g. ``(B, T, H)`` or ``(N, H)``).
        weight: The output projection, ``(V, H)`` (an ``nn.Linear``'s or a tied embedding's weight).
        labels: Class indices, ``hidden.shape[:-1]``; ``ignore_index`` marks positions not counted.
        bias: Optional ``(V,)``.
        ignore_index: The label of positions that count zero (default -100, as ``F.cross_entropy``).
        label_smoothing: In ``[0, 1]`` (default 0), as ``F.cross_entropy``'s.
        reduction: ``"mean"`` over counted positions (default), ``"sum"`` or ``"none"`` (per position,
            shaped like ``labels``).
        chunk_size: Tokens per chunk. Default (None): :func:`default_chunk_size` of the shapes and the
            device (1/16 of the tokens, within bounds). Larger chunks run fewer, larger matmuls and hold
            more.
        logit_scale: Multiply the logits by this first (Cohere's ``logit_scale``; Granite's
            ``1 / logits_scaling``); default 1.
        softcap: Soft-cap the (scaled) logits, ``z = softcap * tanh(z / softcap)`` (Gemma 2's and 3's
            ``final_logit_softcapping``); None (default): not. Each chunk then holds a second logits-sized
            buffer (the ``tanh``, for its derivative).
        backend: ``"auto"`` (default): Liger Kernel's fused linear cross-entropy where it is installed
            (``pip install liger-kernel``), the features are on a CUDA device and it computes this call
            (``reduction`` "mean" or "sum", no ``logit_scale``; ``chunk_size`` is then Liger's own), else
            the chunks above; ``"package"``: the chunks above always; ``"liger"``: Liger or an error. The
            chunks' softmax and gradient are compiled with ``torch.compile`` on CUDA
            (:data:`COMPILES_BY_DEFAULT`), not on a CPU; ``"compiled"``: the
            chunks, compiled on any device; ``"eager"``: the chunks, never compiled. Not compiled under a
            dispatch mode (MemoryTracker, fake tensors) nor inside a region being compiled. Where compiling
            or a compiled call fails, one warning names the cause and the chunks run eagerly from then on.

    Returns:
        The loss: a scalar, or ``labels``-shaped for ``reduction="none"``.

    Raises:
        ValueError: For shapes that do not match, a label outside ``[0, V)`` other than
            ``ignore_index``, an unknown reduction, a smoothing outside ``[0, 1]``, a bad ``chunk_size``,
            a ``softcap`` that is not a positive number, a ``logit_scale`` that is not a finite number,
            an unknown ``backend``, ``backend="liger"`` where Liger cannot compute the call.
        TypeError: For labels that are not integers, or features that are not floating point.

    Example::

        >>> hidden, head = torch.randn(2, 5, 8), torch.nn.Linear(8, 11)
        >>> labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 7, 8]])
        >>> loss = linear_cross_entropy(hidden, head.weight, labels, bias=head.bias, chunk_size=3)
        >>> ref = torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), labels.flatten())
        >>> torch.allclose(loss, ref)
        True
    """
    args = (hidden, weight, labels) + (() if bias is None else (bias,))
    if has_torch_function(args):  # a TorchFunctionMode (the loss observer) or a tensor subclass
        return handle_torch_function(
            linear_cross_entropy,
            args,
            hidden,
            weight,
            labels,
            bias=bias,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            reduction=reduction,
            chunk_size=chunk_size,
            logit_scale=logit_scale,
            softcap=softcap,
            backend=backend,
        )
    if backend not in get_args(Backend):
        raise ValueError(f"backend must be one of {get_args(Backend)}, got {backend!r}; 'auto' picks")
    _check(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, chunk_size)
    if softcap is not None and (isinstance(softcap, bool) or not float(softcap) > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if isinstance(logit_scale, bool) or not math.isfinite(float(logit_scale)):
        raise ValueError(f"logit_scale must be a finite number, got {logit_scale!r}")
    open_head(hidden)  # a MemoryTracker counts what follows as the output head's bytes
    h = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    y = labels.reshape(-1)  # (N,)
    chunk = chunk_size or default_chunk_size(h.shape[0], weight.shape[0], weight.shape[1], h.device)
    cap = None if softcap is None else float(softcap)
    opts = (ignore_index, float(label_smoothing), reduction, chunk, float(logit_scale), cap)
    dtype = compute_dtype(hidden, weight)
    if backend != "package":
        fused, why_not = _liger(h, opts)
        if fused is not None:
            return _liger_loss(fused, h, weight, bias, y, opts, dtype)
        if backend == "liger":
            raise ValueError(f"backend='liger': {why_not}; pass backend='auto' to fall back to the chunks")
    loss = _LinearCrossEntropy.apply(h, weight, bias, y, opts, dtype, _compiles(backend, h))
    return loss.reshape(labels.shape) if reduction == "none" else loss


def _compiles(backend: str, h: torch.Tensor) -> bool:
    """Whether the chunks' per-chunk work is compiled (see ``backend`` in :func:`linear_cross_entropy`)."""
    if backend == "eager" or (backend != "compiled" and h.device.type not in COMPILES_BY_DEFAULT):
        return False
    # Under a dispatch mode (MemoryTracker, FakeTensorMode) what runs is measured or predicted, op by op;
    # inside a compiled region the caller's compile traces the chunks itself
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    traced = torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
    return not (traced or isinstance(h, FakeTensor) or h.device.type == "meta")


class _Compiled:
    """The per-chunk functions compiled with ``torch.compile``, each once; after a failure, eager."""

    def __init__(self):
        self.functions: dict[Callable, Callable] = {}
        self.failure: str | None = None

    def __call__(self, fn: Callable, *args, again: Callable[[], tuple] | None = None):
        """``fn(*args)`` compiled; if compiling or the compiled call fails, warns once naming why and calls
        ``fn`` eagerly on ``again()`` (arguments made anew: a failed call may have written into them)."""
        if self.failure is None:
            try:
                compiled = self.functions.get(fn)
                if compiled is None:
                    compiled = self.functions[fn] = torch.compile(fn, dynamic=None)
                for arg in args:  # the tokens a call holds vary (a batch's last chunk, every micro-batch's
                    if isinstance(arg, torch.Tensor) and arg.dim():  # length): one graph for all of them
                        mark_dynamic(arg, 0)
                return compiled(*args)
            except Exception as error:  # any failure of torch.compile's stack: the eager chunks are correct
                cause = first_line(error)
                self.failure = f"{type(error).__name__}: {cause}"
                warnings.warn(
                    f"linear_cross_entropy computes its chunks eagerly: torch.compile failed ({self.failure}); "
                    "pass backend='eager' to not try",
                    stacklevel=2,
                )
                args = again() if again is not None else args
        return fn(*args)


_COMPILED = _Compiled()


def _eager(fn: Callable, *args, again=None):
    return fn(*args)


def _liger_import() -> Callable[..., Any] | None:
    """Liger Kernel's functional fused linear cross-entropy, or None where it is not installed."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return liger_fused_linear_cross_entropy


def _liger(h: torch.Tensor, opts: tuple) -> tuple[Callable[..., Any] | None, str]:
    """Liger's function where it computes this call (and why not where it does not)."""
    _, _, reduction, _, scale, _ = opts
    if h.device.type != "cuda" or isinstance(h, FakeTensor):
        return None, f"its Triton kernels run on CUDA devices, the features are on {h.device.type}"
    if reduction not in ("mean", "sum"):
        return None, f"reduction={reduction!r} (Liger's fused loss is used for 'mean' and 'sum')"
    if scale != 1.0:
        return None, f"logit_scale={scale} (Liger has no logit scale)"
    fused = _liger_import()
    if fused is None:
        return None, "liger_kernel is not installed (pip install liger-kernel)"
    return fused, ""


def _liger_loss(fused, h, weight, bias, y, opts, dtype) -> torch.Tensor:
    """Liger's loss on the inputs cast to ``dtype`` (as autocast would cast an ``nn.Linear``'s), float32."""
    ignore_index, smoothing, reduction, _, _, softcap = opts
    with _autocast_off(h):  # the casts below are autocast's, once; its backward casts the gradients back
        out = fused(
            h.to(dtype),
            weight.to(dtype),
            y,
            None if bias is None else bias.to(dtype),
            ignore_index=ignore_index,
            label_smoothing=smoothing,
            reduction=reduction,
            softcap=softcap,
        )
    loss = out[0] if isinstance(out, tuple) else out  # versions that also return a z-loss
    return loss.to(torch.promote_types(loss.dtype, torch.float32))


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's where autocast is on for ``hidden``'s device (it casts
    every floating input but float64 to it, as it does an ``nn.Linear``'s), else the inputs' common dtype.

    The softmax, the loss and the sums over tokens are float32 (float64 for float64 inputs) whatever this
    is: :func:`linear_cross_entropy` under ``bf16-mixed`` or ``16-mixed`` computes what a Hugging Face model
    does under the same precision (half-precision logits, ``logits.float()``, float32 cross-entropy).
    """
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    device = hidden.device.type
    if dtype != torch.float64 and _autocast_on(device):
        return torch.get_autocast_dtype(device)
    return dtype


def _autocast_on(device: str) -> bool:
    try:
        return torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


def _autocast_off(h: torch.Tensor):
    """A context without autocast on ``h``'s device: the chunks choose their precision themselves."""
    if not _autocast_on(h.device.type):
        return contextlib.nullcontext()
    return torch.autocast(h.device.type, enabled=False)


def _check(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, chunk_size) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if isinstance(label_smoothing, bool) or not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    check_positive_int("chunk_size", chunk_size, meaning="tokens per chunk", none_ok=True)
    if not hidden.is_floating_point() or hidden.dim() < 1:
        raise TypeError(
            f"hidden must be a floating-point tensor (..., H), got {hidden.dtype} {tuple(hidden.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be (V, H) with H = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"got {tuple(weight.shape)}; "
            "pass the output projection's weight (nn.Linear(H, V).weight)"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(
            f"labels must be integer class indices, got {labels.dtype}; probabilities are not supported"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have hidden's shape without its last dim, {tuple(hidden.shape[:-1])}, "
            f"got {tuple(labels.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be (V,) = {tuple(weight.shape[:1])}, got {tuple(bias.shape)}")
    if isinstance(labels, FakeTensor) or labels.device.type == "meta":
        return  # no values to check: the planner predicts a step's memory on such tensors
    with torch.no_grad():  # one host sync: a clear error here instead of a device assert later
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= weight.shape[0]))
        if bool(bad.any()):
            raise ValueError(
                f"labels must be class indices in [0, {weight.shape[0]}) or ignore_index={ignore_index}, "
                f"got {labels[bad][0].item()}; mark positions not to count with ignore_index"
            )


def _chunk_grad(z, y, opts, scale):
    """One chunk's losses ``(c,)`` and their gradient w.r.t. its float32 or float64 logits ``z (c, V)``, each
    row times ``scale`` ``(c,)``: ``z`` becomes the softmax, then the gradient, in place (one buffer).
    """
    ignore_index, smoothing, _, _, scale_logits, softcap = opts
    if scale_logits != 1.0:
        z.mul_(scale_logits)
    if softcap is not None:  # z = softcap * tanh(z / softcap); keep the tanh for the derivative
        tanh = z.div_(softcap).tanh_().clone()
        z.mul_(softcap)
    counted = y != ignore_index  # (c,)
    target = y.masked_fill(~counted, 0)
    picked = z.gather(1, target[:, None]).squeeze(1)  # z_iy
    average = z.mean(1) if smoothing else None  # mean_j z_ij
    top = z.amax(1)
    z.sub_(top[:, None]).exp_()
    total = z.sum(1)
    lse = top + total.log()
    loss = (1 - smoothing) * (lse - picked)
    if smoothing:
        loss = loss + smoothing * (lse - average)
    weights = counted.to(z.dtype) * scale.to(z.dtype)  # (c,)
    z.mul_((weights / total)[:, None])  # the softmax, scaled
    z.scatter_add_(1, target[:, None], (-(1 - smoothing) * weights)[:, None])
    if smoothing:
        z.sub_((smoothing / z.shape[1]) * weights[:, None])
    if softcap is not None:  # through the cap: d(softcap * tanh(x / softcap))/dx = 1 - tanh^2
        z.mul_(tanh.square_().neg_().add_(1))
    if scale_logits != 1.0:
        z.mul_(scale_logits)
    return loss.masked_fill(~counted, 0), z


def _capped(part: torch.Tensor, opts: tuple) -> torch.Tensor:
    """Half-precision logits as float32 numbers, scaled and capped as :func:`_chunk_grad`'s."""
    _, _, _, _, scale_logits, softcap = opts
    x = part.float()
    if scale_logits != 1.0:
        x = x * scale_logits
    if softcap is not None:
        x = x.div_(softcap).tanh_().mul_(softcap)
    return x


def _through_cap(g: torch.Tensor, x: torch.Tensor, opts: tuple) -> torch.Tensor:
    """``g``, the gradient w.r.t. the capped logits ``x``, made the gradient w.r.t. the matmul's logits."""
    _, _, _, _, scale_logits, softcap = opts
    if softcap is not None:  # d(softcap * tanh(x / softcap))/dx = 1 - tanh^2, tanh = capped / softcap
        g = g.mul_(x.div(softcap).square_().neg_().add_(1))
    return g.mul_(scale_logits) if scale_logits != 1.0 else g


def _token_weights(y, scale, ignore_index):
    """Which tokens count ``(c,)``, their targets with ignored ones at column 0, and each one's weight in
    the gradient (float32: ``scale``, zero where ignored)."""
    counted = y != ignore_index
    return counted, y.masked_fill(~counted, 0), counted.float() * scale.float()


def _grad_columns(part, lse, weights, opts, vocab, want_sums):
    """Half-precision logits ``part (c, w)`` (some of a vocabulary of ``vocab`` columns) become their
    gradient in place, every column as if it were no token's target (the targets' columns are written after:
    :func:`_chunk_grad_half`'s ``at_target``), from each token's log-sum-exp ``lse (c,)`` and weight
    ``weights (c,)``; returns the gradient's float32 column sums ``(w,)`` if ``want_sums`` (the bias's)."""
    smoothing = opts[1]
    x = _capped(part, opts)
    g = (x - lse[:, None]).exp_().mul_(weights[:, None])  # the softmax, weighted
    if smoothing:
        g.sub_((smoothing / vocab) * weights[:, None])
    g = _through_cap(g, x, opts)
    part.copy_(g)
    return g.sum(0) if want_sums else None


def _chunk_grad_half(z, y, opts, scale, width, want_sums=True):
    """:func:`_chunk_grad` for half-precision logits ``z (c, V)``: the same float32 losses ``(c,)`` and
    gradient, computed ``width`` vocabulary columns at a time and rounded into ``z`` in place (what autograd's
    backward through ``logits.float()`` hands the matmuls), and the gradient's float32 column sums ``(V,)``
    (the bias's gradient; None unless ``want_sums``); with each token's log-sum-exp ``(c,)`` (float32) and
    its target column's gradient ``(c,)`` (in ``z``'s dtype), which a second pass over the vocabulary
    (:func:`_weight_gradient_by_columns`) needs.

    Nothing float32 of the chunk's whole size exists: one chunk holds its half-precision logits and one
    slice of float32 numbers, half of what float32 logits would hold (at the Llama-3 shape under bf16 that
    is what brings the head under its bound: ``benchmarks/head.py --bound``). Each slice's logits are read
    twice (the running log-sum-exp, then the gradient) and their scale and cap recomputed, not kept.
    """
    smoothing, vocab = opts[1], z.shape[1]
    counted, target, weights = _token_weights(y, scale, opts[0])  # (c,) each
    picked = _capped(z.gather(1, target[:, None]), opts).squeeze(1)  # z_iy, (c,)
    top = torch.full_like(picked, -math.inf)
    total = torch.zeros_like(picked)
    summed = torch.zeros_like(picked)  # sum_j z_ij, for the smoothing
    for start in range(0, vocab, width):  # an online log-sum-exp, one slice at a time
        x = _capped(z[:, start : start + width], opts)  # (c, width)
        new = torch.maximum(top, x.amax(1))
        total = total * (top - new).exp() + x.sub_(new[:, None]).exp_().sum(1)
        top = new
        if smoothing:
            summed += _capped(z[:, start : start + width], opts).sum(1)
        del x
    lse = top + total.log()
    loss = (1 - smoothing) * (lse - picked)
    if smoothing:
        loss = loss + smoothing * (lse - summed / vocab)
    sums = torch.zeros(vocab, dtype=torch.float32, device=z.device) if want_sums else None
    for start in range(0, vocab, width):
        columns = _grad_columns(z[:, start : start + width], lse, weights, opts, vocab, want_sums)
        if sums is not None:
            sums[start : start + width] += columns
    # Each token's target column, from float32 numbers (rounded once, like every other column)
    soft = (picked - lse).exp() - smoothing / vocab - (1 - smoothing)
    at_target = _through_cap((soft * weights)[:, None], picked[:, None], opts).to(z.dtype)  # (c, 1)
    z.scatter_(1, target[:, None], at_target)
    if sums is not None:
        sums.index_add_(
            0, target, _through_cap((-(1 - smoothing) * weights)[:, None], picked[:, None], opts)[:, 0]
        )
    return loss.masked_fill(~counted, 0), sums, lse, at_target[:, 0]


def _slice(length: int) -> int:
    """How many columns of ``length`` float32 numbers make a slice of :data:`SLICE_BYTES` (at least one)."""
    return max(1, SLICE_BYTES // (4 * max(1, length)))


class _WeightGradient:
    """The weight's gradient: one chunk's product as autograd makes it (in the matmuls' dtype), or several
    chunks' products summed in ``acc`` (float32, or float64 for float64 matmuls; each product made in float32
    from half-precision matmuls); where the dtypes differ, a slice of ``rows`` rows at a time into a buffer of
    the weight's size (no product of the weight's size beside it), cast to the weight's dtype at the end."""

    def __init__(self, weight: torch.Tensor, acc: torch.dtype, rows: int, chunks: int):
        self.shape, self.dtype, self.rows, self.single = weight.shape, weight.dtype, rows, chunks == 1
        self.acc, self.device = weight.dtype if self.single else acc, weight.device
        self.sum: torch.Tensor | None = None

    def addmm(self, dz: torch.Tensor, hc: torch.Tensor) -> None:
        """Adds ``dz.T @ hc`` (``dz (c, V)``, ``hc (c, H)``)."""
        if self.single and dz.dtype == self.dtype:
            self.sum = torch.mm(dz.t(), hc)
            return
        if self.single:  # each slice of rows written once: no zeros to add to
            self.sum = torch.empty(self.shape, dtype=self.acc, device=self.device)
            for start in range(0, self.shape[0], self.rows):
                self.sum[start : start + self.rows] = torch.mm(dz[:, start : start + self.rows].t(), hc)
            return
        if self.sum is None:
            self.sum = self._zeros()
        if dz.dtype == self.sum.dtype == hc.dtype:
            self.sum.addmm_(dz.t(), hc)  # in place: no product of the weight's size
            return
        for start in range(0, self.shape[0], self.rows):
            self.sum[start : start + self.rows] += _float_mm(dz[:, start : start + self.rows].t(), hc)

    def result(self) -> torch.Tensor:
        return (self._zeros() if self.sum is None else self.sum).to(self.dtype)  # no chunk: no tokens

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.acc, device=self.device)


_NO_FLOAT_OUT: set[str] = set()  # device types whose half-precision matmul cannot write float32


def _float_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32 (or wider) from half-precision matrices, without rounding it to half precision
    (as one autograd matmul over every token would not): a CUDA matmul writes float32 itself
    (``out_dtype``); elsewhere, or where that fails, both are upcast first (a slice of rows and one chunk)."""
    if a.dtype not in _HALF:
        return torch.mm(a, b)
    kind = a.device.type
    if kind in ("cuda", "meta") and kind not in _NO_FLOAT_OUT:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError):  # an older GPU or build: upcast from now on
            _NO_FLOAT_OUT.add(kind)
    return torch.mm(a.float(), b.float())


def _logits(hc, w, b):
    return torch.matmul(hc, w.t()) if b is None else torch.addmm(b, hc, w.t())


def _anew(args, hc, w, b):
    """``args`` with their first, the chunk's logits, computed again (a failed compiled call may have written
    into them)."""
    args[0].copy_(_logits(hc, w, b))
    return args


def _chunks(h, weight, bias, y, opts, scale, needs, losses=None, dtype=None, run=_eager):
    """The gradients w.r.t. ``h``, ``weight``, ``bias`` (None where not ``needs``) of ``sum_i scale_i *
    loss_i``, one chunk of tokens at a time; each token's loss written into ``losses`` if given.

    ``dtype`` (default ``h``'s): what the matmuls run in (:func:`compute_dtype`). In half precision they
    are autocast's: the logits in half precision, upcast to float32 for the softmax and the loss (as a
    Hugging Face model's ``logits.float()``; :func:`_chunk_grad_half`, a slice of columns at a time), the
    logits' gradient rounded back to half precision for the two gradient products (as autograd's backward
    through that upcast); the bias's gradient is summed over chunks in float32, and the weight's too for a
    float32 weight on a CPU or a single chunk (:class:`_WeightGradient`), else computed by columns in a
    second pass (:func:`_weight_gradient_by_columns`). ``run(fn, *args)`` calls the per-chunk
    functions: eagerly, or compiled (:class:`_Compiled`: each chunk's softmax is then one slice, the whole
    vocabulary, which the compiled kernels go through without a float32 copy).
    """
    chunk, dtype = opts[3], dtype or h.dtype
    low = dtype in _HALF
    w = weight.to(dtype)  # once, not per chunk (autocast caches the same copy of a leaf weight)
    b = None if bias is None else bias.to(dtype)
    dh = torch.empty_like(h) if needs[0] else None
    chunks = -(-h.shape[0] // chunk)
    by_columns = (
        needs[1]
        and low
        and chunks > 1
        and (weight.dtype in _HALF or h.device.type in WEIGHT_GRADIENT_BY_COLUMNS)
    )
    acc = torch.promote_types(dtype, torch.float32)  # the sums over tokens: float32, or float64's
    dw = (
        _WeightGradient(weight, acc, _slice(weight.shape[1]), chunks) if needs[1] and not by_columns else None
    )
    db = torch.zeros(weight.shape[:1], dtype=acc, device=h.device) if needs[2] else None
    if by_columns:  # each token's log-sum-exp and target column's gradient, for the second pass
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        at_target = torch.empty(h.shape[0], dtype=dtype, device=h.device)
    for start in range(0, h.shape[0], chunk):
        part = slice(start, start + chunk)
        hc = h[part].to(dtype)  # (c, H); no copy unless the precision changes

        z = _logits(hc, w, b)  # (c, V), in dtype
        if low:  # float32 math on half-precision logits; z becomes their gradient, rounded
            width = z.shape[1] if run is not _eager else _slice(z.shape[0])
            args = (z, y[part], opts, scale[part], width, db is not None)
            loss, sums, chunk_lse, chunk_target = run(
                _chunk_grad_half, *args, again=functools.partial(_anew, args, hc, w, b)
            )
            if by_columns:
                lse[part], at_target[part] = chunk_lse, chunk_target
        else:
            args = (z, y[part], opts, scale[part])
            loss, z = run(_chunk_grad, *args, again=functools.partial(_anew, args, hc, w, b))
            sums = z.sum(0) if db is not None else None
        if losses is not None:
            losses[part] = loss
        if dh is not None:
            if low:
                dh[part] = torch.mm(z, w)
            else:
                torch.matmul(z.to(h.dtype), weight, out=dh[part])
        if dw is not None:
            dw.addmm(z, hc)
        if db is not None:
            db.add_(sums)
        del z, sums, args  # before the next chunk's logits: one chunk at a time
    if by_columns:
        dw = _weight_gradient_by_columns(h.to(dtype), w, b, y, opts, scale, lse, at_target, weight.dtype, run)
    elif dw is not None:
        dw = dw.result()
    return dh, dw, None if db is None else db.to(weight.dtype)


def _weight_gradient_by_columns(h, w, b, y, opts, scale, lse, at_target, out_dtype, run=_eager):
    """The weight's gradient ``(V, H)`` in ``out_dtype``, in a second pass over slices of the vocabulary
    (the first pass, over chunks of tokens, gave each token's log-sum-exp ``lse`` and its target column's
    gradient ``at_target``): each slice's logits for every token computed again (``h @ w[cols].T``, ``h``
    and ``w`` in the matmuls' half precision), made their gradient in place (:func:`_grad_columns`, the
    same float32 numbers as the first pass's), and ``dw[cols] = dz.T @ h`` in one matmul over every token.

    Where each chunk's product was summed into a weight-sized buffer instead (:class:`_WeightGradient`),
    every chunk reads and writes that buffer (on a GPU at the Llama-3 shape, 32 chunks of 0.75 GiB each
    way); here nothing weight-sized is summed, and the one matmul sums every token in float32 and rounds
    once, as autograd's does. It costs one matmul more (the slice's logits again).
    """
    n, vocab = h.shape[0], w.shape[0]
    columns = min(vocab, -(-opts[3] * vocab // n))  # a slice holds as many logits as a chunk of tokens
    width = columns if run is not _eager else _slice(n)
    _, target, weights = _token_weights(y, scale, opts[0])
    dw = torch.empty(w.shape, dtype=out_dtype, device=h.device)
    for start in range(0, vocab, columns):
        cols = slice(start, start + columns)
        z = _logits(h, w[cols], None if b is None else b[cols])  # (n, columns)
        for sub in range(start, start + z.shape[1], width):
            part = slice(sub, sub + width)
            args = (z[:, sub - start : sub - start + width], lse, weights, opts, vocab, False)
            mark_dynamic(args[0], 1)  # the last slice is narrower: the same graph
            again = functools.partial(_anew, args, h, w[part], None if b is None else b[part])
            run(_grad_columns, *args, again=again)
        # The targets in this slice get the first pass's column (no data-dependent index: the other rows
        # write back what they hold, so fake and meta tensors run it too)
        local = target - start
        inside = ((local >= 0) & (local < z.shape[1]))[:, None]
        index = local.clamp_(0, z.shape[1] - 1)[:, None]
        z.scatter_(1, index, torch.where(inside, at_target[:, None], z.gather(1, index)))
        if out_dtype == z.dtype:
            torch.mm(z.t(), h, out=dw[cols])
        else:  # a float32 weight under autocast: the product in float32, not rounded to half precision
            dw[cols] = _float_mm(z.t(), h)
        del z, args, again  # before the next slice's logits: one slice at a time
    return dw


class _LinearCrossEntropy(torch.autograd.Function):
    """``h (N, H)``, ``weight (V, H)``, ``bias (V,)``, ``y (N,)``; ``opts``: (ignore_index, smoothing,
    reduction, chunk, logit_scale, softcap); ``dtype``: the matmuls' (:func:`compute_dtype`); ``compiled``:
    whether the per-chunk work is compiled (:func:`_compiles`). See the module docstring for what is held
    between forward and backward."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, opts, dtype, compiled):
        needs = ctx.needs_input_grad[:3]
        # float32 for half-precision inputs (the model's own loss is float32: logits.float()), else h's
        losses = torch.empty(h.shape[0], dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        ctx.opts, ctx.dtype, ctx.ahead = opts, dtype, opts[2] != "none"
        ctx.run = _COMPILED if compiled else _eager
        count = (y != opts[0]).sum()
        # A mean's gradients are the sum's divided by the count: each token's weighs 1 / count in the chunks
        # (every label ignored: the loss is 0/0, NaN, and the gradients zero, as F.cross_entropy's)
        each = torch.ones((), dtype=losses.dtype, device=h.device)
        if opts[2] == "mean":
            each = each / count.clamp(min=1)
        # A scalar loss: every gradient now, while each chunk's logits exist. Per-token losses: in backward.
        with _autocast_off(h):  # the precision is dtype's, chosen once; autocast would re-cast every op
            needs = needs if ctx.ahead else (False,) * 3
            each = each.expand(h.shape[0])
            ctx.grads = _chunks(h, weight, bias, y, opts, each, needs, losses, dtype, ctx.run)
        if not ctx.ahead:
            ctx.save_for_backward(h, weight, bias, y)
            return losses
        total = losses.sum()
        return total if opts[2] == "sum" else total / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        if ctx.ahead:
            grads, ctx.grads = ctx.grads, None  # autograd takes them over: no copy
            dh, dw, db = (None if g is None else g.mul_(grad) for g in grads)
            del grads
        else:
            h, weight, bias, y = ctx.saved_tensors
            with _autocast_off(h):
                scale = grad.reshape(-1)
                dh, dw, db = _chunks(
                    h, weight, bias, y, ctx.opts, scale, ctx.needs_input_grad[:3], None, ctx.dtype, ctx.run
                )
        return dh, dw, db, None, None, None, None
