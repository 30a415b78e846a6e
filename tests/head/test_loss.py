"""linear_cross_entropy: the unchunked loss and gradients, with at most one chunk of logits alive."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_memopt.head import default_chunk_size, linear_cross_entropy
from lightning_memopt.head.loss import compute_dtype
from lightning_memopt.memory import MemoryTracker
from tests.head.helpers import second_passes

V, H = 11, 8


def _inputs(shape=(3, 7), dtype=torch.float64, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, dtype=dtype, generator=g).requires_grad_()
    weight = torch.randn(V, H, dtype=dtype, generator=g).requires_grad_()
    b = torch.randn(V, dtype=dtype, generator=g).requires_grad_() if bias else None
    labels = torch.randint(0, V, shape, generator=g)
    return hidden, weight, b, labels


def _reference(hidden, weight, labels, bias=None, **kw):
    out = F.cross_entropy(F.linear(hidden, weight, bias).reshape(-1, V), labels.reshape(-1), **kw)
    return out.reshape(labels.shape) if kw.get("reduction") == "none" else out


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, [t for t in inputs if t is not None], g)


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 4, 21, 100, None])
def test_equals_unchunked_float64(reduction, smoothing, bias, chunk_size):
    hidden, weight, b, labels = _inputs(bias=bias)
    labels[0, :] = -100  # a whole chunk of 4 (and of 1) ignored
    labels[2, 3] = -100
    kw = dict(label_smoothing=smoothing, reduction=reduction)
    out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=chunk_size, **kw)
    ref = _reference(hidden, weight, labels, b, **kw)
    assert out.shape == ref.shape
    assert _rel(out, ref) <= 1e-12
    for got, want in zip(_grads(out, (hidden, weight, b)), _grads(ref, (hidden, weight, b))):
        assert _rel(got, want) <= 1e-12


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("chunk_size", [1, 4, None])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_scale_and_softcap_equal_the_transformed_logits_cross_entropy_float64(
    reduction, smoothing, chunk_size, scale
):
    hidden, weight, b, labels = _inputs(bias=True)
    hidden.data.mul_(3 / scale)  # scaled logits of about +-25: the cap (10) bends them
    labels[2, 3] = -100
    kw = dict(label_smoothing=smoothing, reduction=reduction)
    out = linear_cross_entropy(
        hidden, weight, labels, bias=b, chunk_size=chunk_size, logit_scale=scale, softcap=10.0, **kw
    )
    capped = 10.0 * torch.tanh(F.linear(hidden, weight, b) * scale / 10.0)
    ref = F.cross_entropy(capped.reshape(-1, V), labels.reshape(-1), **kw)
    ref = ref.reshape(labels.shape) if reduction == "none" else ref
    uncapped = _reference(hidden, weight, labels, b, **kw)
    assert _rel(out, ref) <= 1e-12 and _rel(uncapped, ref) > 1e-2  # the cap changed the loss
    for got, want in zip(_grads(out, (hidden, weight, b)), _grads(ref, (hidden, weight, b))):
        assert _rel(got, want) <= 1e-12


def test_logit_scale_alone_equals_the_scaled_logits_cross_entropy_float64():
    hidden, weight, b, labels = _inputs(bias=True)
    out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=4, logit_scale=0.125)
    ref = F.cross_entropy((F.linear(hidden, weight, b) * 0.125).reshape(-1, V), labels.reshape(-1))
    assert _rel(out, ref) <= 1e-12 and _rel(_reference(hidden, weight, labels, b), ref) > 1e-2
    for got, want in zip(_grads(out, (hidden, weight, b)), _grads(ref, (hidden, weight, b))):
        assert _rel(got, want) <= 1e-12


def test_ignore_index_other_than_default_and_float32():
    hidden, weight, _, labels = _inputs(dtype=torch.float32)
    labels[1, ::2] = 3  # class 3 is ignored here
    out = linear_cross_entropy(hidden, weight, labels, ignore_index=3, chunk_size=5)
    ref = _reference(hidden, weight, labels, ignore_index=3)
    assert _rel(out, ref) <= 1e-6
    for got, want in zip(_grads(out, (hidden, weight)), _grads(ref, (hidden, weight))):
        assert _rel(got, want) <= 1e-5


def test_every_label_ignored_is_nan_with_zero_gradients_as_cross_entropy():
    hidden, weight, _, labels = _inputs()
    labels.fill_(-100)
    out = linear_cross_entropy(hidden, weight, labels, chunk_size=4)
    ref = _reference(hidden, weight, labels)
    assert out.isnan() and ref.isnan()
    dh, dw = torch.autograd.grad(out, (hidden, weight))
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_tokens_give_cross_entropy_loss_and_zero_gradients(dtype, reduction):
    """An empty batch of tokens (no chunk runs): the loss is ``F.cross_entropy``'s (NaN for a mean, 0 for a
    sum, empty per token) and every gradient zero, of its input's shape and dtype."""
    hidden = torch.randn(0, H, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, dtype=dtype, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long)
    out = linear_cross_entropy(hidden, weight, labels, reduction=reduction)
    ref = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction=reduction)
    assert out.shape == ref.shape and torch.equal(out.isnan(), ref.isnan())
    dh, dw = torch.autograd.grad(out.sum(), (hidden, weight), allow_unused=True)
    assert dh.shape == hidden.shape
    assert dw.dtype == dtype and torch.equal(dw, torch.zeros_like(weight))


def test_tied_weight_gets_both_gradients():
    g = torch.Generator().manual_seed(0)
    embed = torch.nn.Embedding(V, H, dtype=torch.float64)
    ids = torch.randint(0, V, (2, 6), generator=g)
    labels = torch.randint(0, V, (2, 6), generator=g)
    linear_cross_entropy(torch.tanh(embed(ids)), embed.weight, labels, chunk_size=5).backward()
    got, embed.weight.grad = embed.weight.grad, None
    _reference(torch.tanh(embed(ids)), embed.weight, labels).backward()
    assert _rel(got, embed.weight.grad) <= 1e-12


def test_non_contiguous_and_2d_inputs():
    hidden, weight, b, labels = _inputs(shape=(6, 5), bias=True)
    h2 = hidden.transpose(0, 1)  # (5, 6, H), not contiguous
    w2 = weight.detach().t().contiguous().t().requires_grad_()  # (V, H) stored transposed
    y2 = labels.t()
    out = linear_cross_entropy(h2, w2, y2, bias=b, chunk_size=7)
    ref = _reference(h2, w2, y2, b)
    assert _rel(out, ref) <= 1e-12
    for got, want in zip(_grads(out, (hidden, w2, b)), _grads(ref, (hidden, w2, b))):
        assert _rel(got, want) <= 1e-12
    flat = linear_cross_entropy(hidden.reshape(-1, H), weight, labels.reshape(-1), reduction="none")
    assert (
        flat.shape == (30,)
        and _rel(flat, _reference(hidden, weight, labels, reduction="none").reshape(-1)) <= 1e-12
    )


def test_frozen_weight_and_hidden_without_grad():
    hidden, weight, _, labels = _inputs()
    weight.requires_grad_(False)
    out = linear_cross_entropy(hidden, weight, labels)
    (dh,) = torch.autograd.grad(out, hidden)
    (want,) = torch.autograd.grad(_reference(hidden, weight, labels), hidden)
    assert _rel(dh, want) <= 1e-12
    with torch.no_grad():
        assert not linear_cross_entropy(hidden, weight, labels).requires_grad


def test_default_chunk_size():
    assert default_chunk_size(2046) == 128  # GPT-2 small, 2 x 1,023 shifted tokens
    assert default_chunk_size(64) == 4
    assert default_chunk_size(3) == 1
    # A weight in the caches (99 x 32): the 1/16 rule alone, on any device
    assert default_chunk_size(124, 99, 32) == default_chunk_size(124, 99, 32, "cuda") == 8
    # A weight beyond the caches: at least 128 tokens a chunk on a CPU, 512 on CUDA, never more than the batch
    assert default_chunk_size(2046, 50_257, 768) == 128
    assert default_chunk_size(512, 128_256, 2_048) == 128
    assert default_chunk_size(512, 128_256, 2_048, torch.device("cuda", 1)) == 512
    assert default_chunk_size(100, 128_256, 2_048, "cuda") == 100
    # 1/16 of long batches' logits beyond 256 MiB: 256 MiB of float32 logits a chunk, not under the floor
    assert default_chunk_size(16_384, 128_256, 2_048, "cuda") == 2**28 // (128_256 * 4) == 523
    assert default_chunk_size(262_144, 50_257, 768) == 2**28 // (50_257 * 4) == 1_335
    assert default_chunk_size(65_536, 2_000_000, 128, "cuda") == 512  # a huge vocabulary: the floor
    assert default_chunk_size(2046, 50_257, 768, "meta") == 512  # other device types count as CUDA


def test_the_default_chunk_follows_the_shapes():
    """linear_cross_entropy without chunk_size uses default_chunk_size of its shapes and device: a 128-token
    chunk of a weight beyond the caches (one chunk here, where 1/16 would be 16 chunks of 8 tokens)."""
    seen = []
    original = torch.Tensor.exp_

    def spy(self):
        seen.append(self.shape[0])
        return original(self)

    hidden, labels = torch.randn(128, 64), torch.randint(0, 131_073, (128,))
    weight = torch.zeros(131_073, 64)  # 32 MiB + 256 bytes: just beyond the caches
    torch.Tensor.exp_ = spy
    try:
        linear_cross_entropy(hidden, weight, labels)
        linear_cross_entropy(hidden, weight[:-1], labels.clamp(max=131_071))  # 32 MiB: in the caches
    finally:
        torch.Tensor.exp_ = original
    assert seen == [128] + [8] * 16


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(reduction="avg"), ValueError, "reduction must be one of"),
        (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be a float in \[0, 1\], got 1.5"),
        (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
        (
            dict(weight=torch.randn(V, H + 1)),
            ValueError,
            r"weight must be \(V, H\) with H = hidden.shape\[-1\] = 8",
        ),
        (dict(labels=torch.zeros(3, 6, dtype=torch.long)), ValueError, "labels must have hidden's shape"),
        (dict(labels=torch.zeros(3, 7)), TypeError, "labels must be integer class indices"),
        (dict(hidden=torch.zeros(3, 7, H, dtype=torch.long)), TypeError, "hidden must be a floating-point"),
        (dict(bias=torch.zeros(V + 1)), ValueError, r"bias must be \(V,\) = \(11,\)"),
        (dict(softcap=0.0), ValueError, r"softcap must be a positive number or None, got 0.0"),
        (dict(logit_scale=float("inf")), ValueError, r"logit_scale must be a finite number, got inf"),
        (
            dict(labels=torch.full((3, 7), V)),
            ValueError,
            r"labels must be class indices in \[0, 11\) or ignore_index=-100, got 11",
        ),
    ],
)
def test_bad_arguments(change, error, match):
    args = dict(
        hidden=torch.randn(3, 7, H), weight=torch.randn(V, H), labels=torch.zeros(3, 7, dtype=torch.long)
    )
    kwargs = {k: change.pop(k) for k in list(change) if k not in args}
    args.update(change)
    with pytest.raises(error, match=match):
        linear_cross_entropy(args["hidden"], args["weight"], args["labels"], **kwargs)


def test_a_torch_function_mode_sees_the_call():
    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    hidden, weight, _, labels = _inputs()
    with Spy():
        linear_cross_entropy(hidden, weight, labels, label_smoothing=0.1)
    assert seen[0] is linear_cross_entropy


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_at_most_one_chunk_of_logits_is_alive(reduction):
    """MemoryTracker's live bytes: forward holds one chunk of logits at a time (default chunk size: 16 of 256
    tokens) and keeps nothing logits-sized for backward; plain autograd holds logits and log-softmax."""
    n, h, v = 256, 16, 512
    hidden, weight = torch.randn(n, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    logits, chunk = n * v * 4, default_chunk_size(n) * v * 4
    assert chunk == logits // 16
    ahead = reduction == "mean"  # gradients computed in forward, held until backward
    with MemoryTracker() as tracker:
        (hidden.sum(), weight.sum(), labels.sum())  # the inputs are counted before the head runs
        before = tracker.current
        tracker.reset_peak()
        loss = linear_cross_entropy(hidden, weight, labels, reduction=reduction)
        held = tracker.current - before
        assert held == (n * h * 4 + v * h * 4 + 4 if ahead else n * 4)  # the gradients / the losses
        transient = tracker.peak - before - held
        assert chunk <= transient <= chunk + 128 * 16 + (0 if ahead else n * 4)
        assert transient <= logits // 8
        tracker.reset_peak()
        loss.sum().backward()
        if ahead:  # backward only scales them: no new bytes but the scalar gradient
            assert tracker.peak - tracker.current <= 8
        else:  # recomputed one chunk at a time
            assert tracker.peak - before - (n * h * 4 + v * h * 4) <= logits // 8
        hidden.grad = weight.grad = None
        before = tracker.current
        tracker.reset_peak()
        F.cross_entropy(hidden @ weight.t(), labels).backward()
        assert tracker.peak - before >= 2 * logits  # the logits and their log-softmax


def _half_inputs(dtype=torch.float32, bias=True, n=40, h=24, v=300):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    return hidden, weight, b, labels


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [3, None])
def test_under_autocast_the_loss_is_the_float32_cross_entropy_of_half_precision_logits(
    half, reduction, chunk_size
):
    """As a Hugging Face model under bf16-mixed / 16-mixed: half-precision logits, ``logits.float()``, a
    float32 loss. The loss agrees to float32 rounding (the logits are the same half-precision numbers); the
    gradients are half-precision products on both sides (rounding of half precision apart)."""
    hidden, weight, b, labels = _half_inputs()
    kw = dict(reduction=reduction, label_smoothing=0.1)
    with torch.autocast("cpu", dtype=half):
        out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=chunk_size, **kw)
        logits = F.linear(hidden, weight, b)
        assert logits.dtype == half
        ref = F.cross_entropy(logits.float(), labels, **kw)
    assert out.dtype == ref.dtype == torch.float32
    assert _rel(out, ref) <= 1e-6
    got, want = _grads(out, (hidden, weight, b)), _grads(ref, (hidden, weight, b))
    for a, w in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        assert _rel(a, w) <= 4 * torch.finfo(half).eps
    exact = _grads(F.cross_entropy(F.linear(hidden, weight, b), labels, **kw), (hidden, weight, b))
    assert _rel(got[0], exact[0]) > 1e-4  # the gradients are half precision's, as the model's own


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [7, 1, 40])
def test_half_precision_inputs_give_a_float32_loss(half, chunk_size, monkeypatch):
    """bf16 or fp16 weights and features (``bf16-true``): the loss is float32, not rounded to the half
    precision (12.1875 where the float32 loss is 12.1696 on the Llama-3 shape in bf16); gradients come back
    in the half precision, within the plain head's rounding, over 6 or 40 chunks the weight's by columns in a
    second pass (on a CPU too: the weight is half precision), in one chunk as the chunk's one product."""
    hidden, weight, b, labels = _half_inputs(half)
    calls = second_passes(monkeypatch)
    out = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=chunk_size)
    assert calls == ([hidden.shape] if chunk_size < len(labels) else [])
    ref = F.cross_entropy(F.linear(hidden, weight, b).float(), labels)
    assert out.dtype == torch.float32
    assert _rel(out, ref) <= 1e-6
    assert float(out.detach()) != float(out.detach().to(half))  # not a half-precision number
    dh, dw, db = _grads(out, (hidden, weight, b))
    assert dh.dtype == dw.dtype == db.dtype == half
    for a, w in zip((dh, dw, db), _grads(ref, (hidden, weight, b)), strict=True):
        assert _rel(a, w) <= 4 * torch.finfo(half).eps


def test_compute_dtype_follows_autocast():
    hidden, weight = torch.randn(2, H), torch.randn(V, H)
    assert compute_dtype(hidden, weight) == torch.float32
    assert compute_dtype(hidden.bfloat16(), weight.bfloat16()) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(hidden, weight) == torch.bfloat16
        assert compute_dtype(hidden.double(), weight.double()) == torch.float64  # autocast leaves float64
    with torch.autocast("cpu", dtype=torch.float16):
        assert compute_dtype(hidden, weight) == torch.float16


class _FakeLiger:
    """Stands in for liger_kernel's functional fused linear cross-entropy (a CUDA/Triton kernel): records
    each call and computes its documented result."""

    def __init__(self):
        self.calls = []

    def __call__(self, h, w, y, bias=None, *, ignore_index, label_smoothing, reduction, softcap):
        self.calls.append(dict(dtypes=(h.dtype, w.dtype), softcap=softcap, reduction=reduction))
        z = F.linear(h, w, bias).float()
        z = z if softcap is None else softcap * torch.tanh(z / softcap)
        kw = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)
        return F.cross_entropy(z, y, **kw), None  # (loss, z_loss) as some versions return


@pytest.fixture
def liger(monkeypatch):
    """Liger "installed" and the features "on CUDA": the dispatch is what is tested, not Liger's kernel."""
    from lightning_memopt.head import loss as head_loss

    fake = _FakeLiger()
    monkeypatch.setattr(head_loss, "_liger_import", lambda: fake)
    real = head_loss._liger

    class _Cuda:  # the device check reads .device.type only
        def __init__(self, h):
            self.device = torch.device("cuda")

    monkeypatch.setattr(head_loss, "_liger", lambda h, opts: real(_Cuda(h), opts))
    return fake


def test_liger_computes_the_call_where_it_applies(liger):
    hidden, weight, b, labels = _half_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(hidden, weight, labels, bias=b, softcap=30.0, label_smoothing=0.1)
        ref = linear_cross_entropy(
            hidden, weight, labels, bias=b, softcap=30.0, label_smoothing=0.1, backend="package"
        )
    assert liger.calls == [dict(dtypes=(torch.bfloat16, torch.bfloat16), softcap=30.0, reduction="mean")]
    assert out.dtype == torch.float32 and _rel(out, ref) <= 1e-5
    dh, dw, db = _grads(out, (hidden, weight, b))  # through the casts back to float32
    assert dh.dtype == dw.dtype == db.dtype == torch.float32


def test_liger_does_not_take_what_it_does_not_compute(liger):
    hidden, weight, _, labels = _half_inputs(bias=False)
    linear_cross_entropy(hidden, weight, labels, reduction="none")
    linear_cross_entropy(hidden, weight, labels, logit_scale=0.5)
    linear_cross_entropy(hidden, weight, labels, backend="package")
    assert liger.calls == []
    with pytest.raises(ValueError, match=r"backend='liger': logit_scale=0.5 \(Liger has no logit scale\)"):
        linear_cross_entropy(hidden, weight, labels, logit_scale=0.5, backend="liger")
    with pytest.raises(ValueError, match=r"backend='liger': reduction='none' \(Liger's fused loss is used"):
        linear_cross_entropy(hidden, weight, labels, reduction="none", backend="liger")


def test_liger_backend_errors_without_cuda_or_liger(monkeypatch):
    from lightning_memopt.head import loss as head_loss

    hidden, weight, _, labels = _half_inputs(bias=False)
    with pytest.raises(
        ValueError, match=r"backend='liger': its Triton kernels run on CUDA devices, the features"
    ):
        linear_cross_entropy(hidden, weight, labels, backend="liger")
    monkeypatch.setattr(head_loss, "_liger_import", lambda: None)
    assert head_loss._liger(hidden.to("meta"), (-100, 0.0, "mean", 1, 1.0, None))[1] == (
        "its Triton kernels run on CUDA devices, the features are on meta"
    )
    with pytest.raises(
        ValueError,
        match=r"backend must be one of \(.auto., .package., .compiled., .eager., .liger.\), got .fast.",
    ):
        linear_cross_entropy(hidden, weight, labels, backend="fast")


def _bf16_head_bytes(monkeypatch, n: int, h: int, v: int, c: int) -> tuple[int, int]:
    """A bf16 head of ``n`` tokens, ``h`` features, ``v`` classes in chunks of ``c`` (float32 slices of
    4,096 bytes): the bytes held above its inputs after the forward, and its peak above them."""
    from lightning_memopt.head import loss as head_loss

    monkeypatch.setattr(head_loss, "SLICE_BYTES", 4096)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(v, h, generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    with MemoryTracker() as tracker:
        (hidden.sum(), weight.sum(), labels.sum())  # the inputs are counted before the head runs
        before = tracker.current
        tracker.reset_peak()
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=c)
        held, peak = tracker.current - before, tracker.peak - before
        del loss
    return held, peak


def test_compiled_chunks_equal_the_eager_ones():
    """backend="compiled" on a CPU: torch.compile of the bf16 softmax of two chunks of 6 tokens and of the
    second pass's two slices of 10 columns (one shape each to compile) gives the eager chunks' loss and
    gradients."""
    hidden, weight, _, labels = _half_inputs(torch.bfloat16, bias=False, n=12, h=8, v=20)
    kw = dict(chunk_size=6, label_smoothing=0.1, softcap=3.0)
    results = []
    for backend in ("eager", "compiled"):
        loss = linear_cross_entropy(hidden, weight, labels, backend=backend, **kw)
        results.append((loss, *torch.autograd.grad(loss, (hidden, weight))))
    for eager, compiled in zip(*results, strict=True):
        assert compiled.dtype == eager.dtype
        assert _rel(compiled.float(), eager.float()) <= 1e-6


def test_compiled_chunks_compile_each_function_once_whatever_the_tokens():
    """A batch's last chunk holds fewer tokens, the second pass's last slice fewer columns, and every
    micro-batch length gives other chunks: each compiled function still compiles one graph (on an H200 the
    first chunked step compiled for 12 s, the last chunk's shape a second time)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    weight = torch.randn(50, 8, dtype=torch.bfloat16, requires_grad=True)
    for n in (25, 17):  # chunks of 10: 10 + 10 + 5, then 10 + 7; slices of 20 columns: 20 + 20 + 10
        hidden = torch.randn(n, 8, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, 50, (n,))
        linear_cross_entropy(hidden, weight, labels, chunk_size=10, backend="compiled").backward()
    assert counters["stats"]["unique_graphs"] == 2  # the chunks' softmax, the slices' gradient


def test_a_failed_compile_warns_once_and_the_chunks_run_eagerly(monkeypatch):
    """Compiling fails (here: the compiled function raises after writing into the chunk's logits): one
    warning naming the cause, then eager chunks on logits computed anew, equal to backend="eager"'s."""
    from lightning_memopt.head import loss as head_loss

    def broken(fn, **kwargs):
        def call(z, *args):
            z.fill_(float("nan"))
            raise RuntimeError("InductorError: no C++ compiler\nthe rest of the traceback")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(head_loss, "_COMPILED", head_loss._Compiled())
    hidden, weight, b, labels = _inputs(bias=True)
    want = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=4, backend="eager")
    with pytest.warns(UserWarning) as record:
        got = [linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=4, backend="compiled")]
        got.append(linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=4, backend="compiled"))
    assert [str(w.message) for w in record] == [
        "linear_cross_entropy computes its chunks eagerly: torch.compile failed (RuntimeError: "
        "InductorError: no C++ compiler); pass backend='eager' to not try"
    ]
    want_grads = _grads(want, (hidden, weight, b))
    for loss in got:
        assert torch.equal(loss, want)
        for a, w in zip(_grads(loss, (hidden, weight, b)), want_grads, strict=True):
            assert torch.equal(a, w)


def test_nothing_is_compiled_by_default_on_a_cpu(monkeypatch):
    from lightning_memopt.head.loss import _compiles

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(fn) or fn)
    hidden, weight, b, labels = _inputs(bias=True)
    for backend in ("auto", "package", "eager"):
        linear_cross_entropy(hidden, weight, labels, bias=b, backend=backend).backward()
    assert calls == []

    class _Cuda:  # _compiles reads .device.type
        device = torch.device("cuda")

    cuda = _Cuda()
    assert [_compiles(b, cuda) for b in ("auto", "package", "compiled", "eager")] == [True, True, True, False]
    assert [_compiles(b, hidden) for b in ("auto", "package", "compiled", "eager")] == [
        False,
        False,
        True,
        False,
    ]
    with MemoryTracker():  # a dispatch mode measures the eager chunks
        assert not _compiles("compiled", hidden) and not _compiles("auto", cuda)
    assert not _compiles("compiled", hidden.to("meta"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_cuda_the_compiled_chunks_match_a_float64_cross_entropy(dtype, recwarn):
    """On CUDA the default backend compiles the chunks (no fallback warning) at several chunks of a
    1,000-token, 4,000-class head, and the loss and gradients are a float64 cross-entropy's of the same
    logits (bf16 inputs: the logits rounded to bf16, as the plain head's bf16 matmul gives them) within
    rounding: the loss to 1e-5, the gradients to their dtype's."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 1000, 64, 4000
    hidden = torch.randn(n, h, generator=g).to("cuda", dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to("cuda", dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g).cuda()
    labels[::9] = -100
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=256, label_smoothing=0.1)
    got = (loss, *torch.autograd.grad(loss, (hidden, weight)))
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    logits = h64 @ w64.T
    ref = F.cross_entropy(logits.to(dtype).double(), labels, label_smoothing=0.1)
    want = (ref, *torch.autograd.grad(ref, (h64, w64)))
    assert [str(w.message) for w in recwarn if "linear_cross_entropy" in str(w.message)] == []
    assert loss.dtype == torch.float32
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 gradients are rounded to 8 bits
    assert _rel(got[0].double(), want[0]) <= 1e-5
    for a, w in zip(got[1:], want[1:], strict=True):
        assert a.dtype == dtype
        assert _rel(a.double(), w) <= tolerance


@pytest.mark.parametrize("options", [{}, dict(label_smoothing=0.1, softcap=3.0, logit_scale=0.5)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_weight_gradient_by_columns_equals_the_chunks_sum(monkeypatch, options, bias, reduction):
    """A float32 weight under bf16 autocast (``bf16-mixed``), its gradient from a second pass over slices of
    the vocabulary (what a GPU runs; 300 tokens in chunks of 7: slices of 24 columns, 42 slices of 1,000
    classes, targets in most) and summed over the chunks (a CPU's): the loss and the other gradients are
    bit for bit the same, the weight's within float32's rounding (both sum in float32)."""
    n, v, chunk = 300, 1000, 7
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, 16, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, 16, generator=g) / 4).requires_grad_()
    b = torch.randn(v, generator=g).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    results = {}
    for on in ((), ("cpu",)):
        calls = second_passes(monkeypatch, on)
        with torch.autocast("cpu", torch.bfloat16):
            loss = linear_cross_entropy(
                hidden, weight, labels, bias=b, chunk_size=chunk, reduction=reduction, **options
            )
        results[on] = (loss, *_grads(loss, (hidden, weight, b)))
        assert calls == ([hidden.shape] if on else [])
    chunks, columns = results[()], results[("cpu",)]
    for i, (a, w) in enumerate(zip(columns, chunks, strict=True)):
        assert a.dtype == w.dtype
        if i != 2:  # all but the weight's
            assert torch.equal(a, w)
    assert _rel(columns[2], chunks[2]) <= 1e-5


def test_a_bfloat16_head_holds_its_gradients_and_one_chunk_of_logits(monkeypatch):
    """bf16-true: held from forward to backward, the bf16 gradients alone (hidden's and the weight's); while
    the head runs, one chunk's bf16 logits (or one slice of the vocabulary's, as many numbers), a few slices
    of float32 numbers (SLICE_BYTES) and a few numbers a token above them: never a float32 chunk, nor a
    weight-sized sum."""
    n, h, v, c = 256, 256, 1024, 32
    calls = second_passes(monkeypatch)
    held, peak = _bf16_head_bytes(monkeypatch, n, h, v, c)
    grads = n * h * 2 + v * h * 2
    assert held == grads + 4  # the bf16 gradients and the loss
    logits = c * v * 2  # a chunk's, and a slice's: 128 columns of 256 tokens
    assert grads + logits <= peak <= grads + logits + 96 * n + 6 * 4096
    assert 96 * n + 6 * 4096 < min(c * v * 2, v * h)  # less than a float32 chunk's extra, or a sum's
    assert calls == [(n, h)]


def test_one_chunk_under_bf16_autocast_writes_the_weight_gradient_as_autograd_rounds_it(monkeypatch):
    """``bf16-mixed`` with one chunk (a float32 weight, bf16 matmuls): no second pass; the weight's gradient
    is the chunk's bf16 product, as autograd's (within a bf16 rounding of the plain head's), written into the
    float32 gradient a slice of rows at a time: the peak holds the float32 gradients, the bf16 weight and one
    chunk of bf16 logits, never a bf16 product of the weight's size beside its float32 gradient."""
    from lightning_memopt.head import loss as head_loss

    monkeypatch.setattr(head_loss, "SLICE_BYTES", 4096)  # rows of the weight a slice: 4,096 / (4 * 64) = 16
    n, h, v = 64, 64, 2048
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / 8).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    calls = second_passes(monkeypatch)
    with MemoryTracker() as tracker:
        (hidden.sum(), weight.sum(), labels.sum())
        before = tracker.current
        tracker.reset_peak()
        with torch.autocast("cpu", torch.bfloat16):
            loss = linear_cross_entropy(hidden, weight, labels, chunk_size=n)
        peak = tracker.peak - before
    assert calls == []
    # the float32 gradients, the bf16 weight, the logits
    floor = n * h * 4 + v * h * 4 + v * h * 2 + n * v * 2
    assert floor <= peak <= floor + 96 * n + 6 * 4096
    assert 96 * n + 6 * 4096 < v * h * 2
    dh, dw = _grads(loss, (hidden, weight))
    with torch.autocast("cpu", torch.bfloat16):
        ref = F.cross_entropy(F.linear(hidden, weight).float(), labels)
    want = _grads(ref, (hidden, weight))
    assert dw.dtype == torch.float32
    assert _rel(dh, want[0]) <= 4 * torch.finfo(torch.bfloat16).eps
    assert _rel(dw, want[1]) <= 4 * torch.finfo(torch.bfloat16).eps
