"""The output head without its logits: GPT-2 small's step peak, the head's bytes, exactness and time.

Run: python benchmarks/head.py            # GPT2Config() (12 layers, h=768, vocab 50,257), batch 2 x 1,024
     python benchmarks/head.py --small    # 2 layers, h=128, GPT-2's vocabulary, 2 x 512: about 2 minutes
     python benchmarks/head.py --shapes   # the head alone at GPT-2, Llama 3 and Gemma 2 shapes (below)
     python benchmarks/head.py --shapes --device cuda   # the same on a GPU, bf16, 16,384 tokens
     python benchmarks/head.py --shapes --backends  # and the other backend (compiled on a CPU, eager on CUDA)
     python benchmarks/head.py --shapes --dtype bf16-mixed   # float32 weights under bf16 autocast
     python benchmarks/head.py --bound    # Llama 3's head at 16,384 tokens, bf16: peak bytes, accuracy

``--shapes`` prints, for the heads of GPT-2 (50,257 x 768), Llama 3 (128,256 x 2,048 and x 4,096) and
Gemma 2 (256,000 x 2,304): the plain head (``F.cross_entropy(F.linear(hidden, weight).float(), labels)``,
what a Hugging Face model computes) and ``linear_cross_entropy``, forward + backward: milliseconds (median
of ``--reps`` rounds, the two alternated in one process), their ratio (median of the per-round ratios),
the peak above the inputs (MemoryTracker's live bytes on a CPU; ``torch.cuda.max_memory_allocated`` on
CUDA) and each loss's relative difference from a float64 cross-entropy of the same inputs. On a CPU the
token counts are small (a few seconds a round) and the inputs float32; on CUDA 16,384 tokens (8,192 for
Gemma 2) in bf16 (``--dtype`` to change; ``--dtype bf16-mixed``: float32 inputs, every head under bf16
autocast, as ``precision="bf16-mixed"`` runs it).

``--bound`` prints the peak above the inputs of the Llama-3 head (128,256 x 2,048, 16,384 tokens, bf16
weight and features, the CUDA chunk: 523 tokens) for the plain head and ``linear_cross_entropy``, as
MemoryTracker's live bytes on ``meta`` tensors (every storage counted, nothing computed: the plain head's
8 GiB logits would take a 2-core CPU minutes), with the bound of 1,024 MiB; then both heads' loss and
gradients against a float64 computation of the same inputs, on real bf16 tensors at 16,384 tokens in 32
chunks of a narrower head (4,096 x 128).

Prints, for a random-init fp32 GPT-2 on CPU (train mode, forward + backward of ``model(input_ids,
labels=labels).loss``, no optimizer):

1. the step's peak live tensor bytes (MemoryTracker: parameters, gradients, everything autograd and the
   step hold) with the model's own head, with every block checkpointed (what ``AutoCheckpoint`` does on a
   CPU), and with the blocks checkpointed and the chunked head (``AutoCheckpoint(head="auto")``);
2. the head's own bytes: the peak of the head alone (own: ``cross_entropy(hidden @ W.T)``; chunked:
   ``linear_cross_entropy``) above its inputs, split for the chunked head into the gradients it hands
   back (hidden- and weight-sized, held from forward to backward) and its transient chunk of logits;
3. loss and gradient relative differences of the chunked head against the model's own logits with a
   float64 cross-entropy, in float64 on a small config (largest over all parameters);
4. the step time with the chunked head divided by the step time with the model's own head (both with
   checkpointed blocks), alternated in one process, median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers

from lightning_memopt.checkpointing import apply_checkpointing, find_blocks
from lightning_memopt.head import default_chunk_size, linear_cross_entropy
from lightning_memopt.head.causal_lm import take_over_heads
from lightning_memopt.head.loss import COMPILES_BY_DEFAULT
from lightning_memopt.memory import MemoryTracker

MiB = 2**20


def build(config: transformers.GPT2Config, dtype=torch.float32, blocks=False, head=False):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(dtype).train()
    if blocks:
        apply_checkpointing(model, {name: "full" for name, _ in find_blocks(model)})
    if head:
        take_over_heads(model, "chunked", note=print)
    return model


def batch(config, size, seq):
    ids = torch.randint(0, config.vocab_size, (size, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def step(model, inputs) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach()


def step_peak(model, inputs) -> tuple[int, dict[str, int]]:
    """The step's peak and its breakdown (MemoryTracker's categories at that moment)."""
    step(model, inputs)  # the first call verifies the chunked head: measure the second
    model.zero_grad(set_to_none=True)
    with MemoryTracker(model) as tracker:
        step(model, inputs)
    return tracker.peak, tracker.peak_breakdown


def head_bytes(config, size, seq) -> dict[str, int]:
    """The head alone, above its inputs (hidden, weight, labels): own vs chunked."""
    torch.manual_seed(0)
    hidden = torch.randn(size * (seq - 1), config.n_embd, requires_grad=True)
    weight = torch.randn(config.vocab_size, config.n_embd, requires_grad=True)
    labels = torch.randint(0, config.vocab_size, (size * (seq - 1),))
    out = {}
    for name, fn in (
        ("own", lambda: F.cross_entropy(hidden @ weight.t(), labels)),
        ("chunked", lambda: linear_cross_entropy(hidden, weight, labels)),
    ):
        with MemoryTracker() as tracker:
            (hidden.sum(), weight.sum(), labels.sum())  # the inputs are counted before
            before = tracker.current
            tracker.reset_peak()
            loss = fn()
            held = tracker.current - before
            forward_peak = tracker.peak - before
            loss.backward()
            out[name], out[name + "_held"] = max(forward_peak, tracker.peak - before), held
        hidden.grad = weight.grad = None
    out["logits"] = size * (seq - 1) * config.vocab_size * 4
    out["gradients"] = hidden.numel() * 4 + weight.numel() * 4
    return out


def exactness() -> tuple[float, float]:
    """Relative loss and gradient differences, float64, chunked head vs own logits + float64 CE."""
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)
    inputs = batch(config, 2, 64)
    inputs["labels"] = inputs["labels"].clone()
    inputs["labels"][0, 40:] = -100  # padding
    results = []
    for head in (False, True):
        model = build(config, torch.float64, head=head).eval()  # no dropout: the same function
        if head:
            loss = model(**inputs).loss
        else:
            logits = model(input_ids=inputs["input_ids"]).logits[:, :-1]
            loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), inputs["labels"][:, 1:].reshape(-1))
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (own, own_grads), (mine, my_grads) = results
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    return rel(mine, own), max(rel(a, b) for a, b in zip(my_grads, own_grads))


def tied_sum_in_place() -> tuple[bool, bool]:
    """Whether autograd sums the tied embedding's two gradients (the chunked head's, the embedding's) into
    the chunked head's buffer, without and with MemoryTracker: (without, with). Under any dispatch mode
    torch sums out of place (it treats every tensor as a subclass), so the tracker sees one more
    weight-sized tensor at that moment than a run without it has."""
    from lightning_memopt.head import loss as head_loss

    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)
    model, inputs, buffers = build(config, head=True), batch(config, 2, 64), []
    backward = head_loss._LinearCrossEntropy.backward

    def recording(ctx, grad):
        grads = backward(ctx, grad)
        buffers.append(grads[1].data_ptr())
        return grads

    head_loss._LinearCrossEntropy.backward = staticmethod(recording)
    try:
        out = []
        for tracked in (False, True):
            step(model, inputs)  # the first verifies
            with MemoryTracker(model) if tracked else contextlib.nullcontext():
                step(model, inputs)
            out.append(model.transformer.wte.weight.grad.data_ptr() == buffers[-1])
    finally:
        head_loss._LinearCrossEntropy.backward = backward
    return out[0], out[1]


def time_ratio(config, inputs, reps: int) -> tuple[float, list[float]]:
    own, chunked = build(config, blocks=True), build(config, blocks=True, head=True)
    step(own, inputs), step(chunked, inputs)  # warm-up (and the chunked head's first-batch check)
    ratios = []
    for _ in range(reps):  # alternate, so a burst of load on the machine hits both sides
        times = []
        for model in (own, chunked):
            start = time.perf_counter()
            step(model, inputs)
            times.append(time.perf_counter() - start)
        ratios.append(times[1] / times[0])
    return statistics.median(ratios), ratios


# (name, vocabulary, hidden, tokens on a CPU, tokens on CUDA)
SHAPES = [
    ("GPT-2", 50_257, 768, 2_048, 16_384),
    ("Llama 3 (1B, 3B)", 128_256, 2_048, 128, 16_384),
    ("Llama 3 (8B)", 128_256, 4_096, 64, 16_384),
    ("Gemma 2 (2B)", 256_000, 2_304, 64, 8_192),
]


def _plain(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float(), labels)


def _chunked(hidden, weight, labels):
    return linear_cross_entropy(hidden, weight, labels)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _head_step(fn, hidden, weight, labels) -> torch.Tensor:
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, labels)
    loss.backward()
    return loss.detach()


def _peak_above_inputs(fn, hidden, weight, labels) -> int:
    """The most bytes alive at once above the inputs during forward + backward (the gradients included)."""
    hidden.grad = weight.grad = None
    if hidden.device.type == "cuda":
        _sync(hidden.device)
        torch.cuda.reset_peak_memory_stats(hidden.device)
        before = torch.cuda.memory_allocated(hidden.device)
        _head_step(fn, hidden, weight, labels)
        _sync(hidden.device)
        return torch.cuda.max_memory_allocated(hidden.device) - before
    with MemoryTracker() as tracker:
        (hidden.sum(), weight.sum(), labels.sum())  # the inputs are counted before the head runs
        before = tracker.current
        tracker.reset_peak()
        _head_step(fn, hidden, weight, labels)
    return tracker.peak - before


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def bound() -> None:
    """``--bound`` (module docstring)."""
    tokens, vocab, width = 16_384, 128_256, 2_048
    chunk = default_chunk_size(tokens, vocab, width, "cuda")
    print(
        f"Llama 3 head, {vocab:,} x {width:,}, {tokens:,} tokens, bf16 weight and features, chunk {chunk} "
        "(CUDA's default); meta tensors, MemoryTracker's live bytes\n"
    )
    print("| head | peak above the inputs | bound |\n|---|---:|---:|")

    def meta_peak(fn) -> int:
        hidden = torch.empty(tokens, width, device="meta", dtype=torch.bfloat16, requires_grad=True)
        weight = torch.empty(vocab, width, device="meta", dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(tokens, device="meta", dtype=torch.long)
        return _peak_above_inputs(fn, hidden, weight, labels)

    print(f"| plain | {meta_peak(_plain) / MiB:,.1f} MiB | |")
    print(f"| chunked | {meta_peak(_chunked) / MiB:,.1f} MiB | 1,024 MiB |")

    vocab, width, chunk = 4_096, 128, 512
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, generator=g) * width**-0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    print(
        f"\n{vocab:,} x {width:,}, {tokens:,} tokens in {tokens // chunk} chunks of {chunk}, bf16, real "
        "tensors; relative to the largest float64 value (max |a - b| / max |b|)\n"
    )
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    ref_loss = linear_cross_entropy(h64, w64, labels)
    ref_dh, ref_dw = torch.autograd.grad(ref_loss, (h64, w64))
    print("| head | loss vs float64 | d hidden vs float64 | d weight vs float64 |\n|---|---:|---:|---:|")
    for name, fn in (
        ("plain (autograd, bf16 logits)", _plain),
        ("chunked", lambda *a: linear_cross_entropy(*a, chunk_size=chunk)),
    ):
        loss = fn(hidden, weight, labels)
        dh, dw = torch.autograd.grad(loss, (hidden, weight))
        print(
            f"| {name} | {_rel(loss.detach(), ref_loss.detach()):.1e} "
            f"| {_rel(dh, ref_dh):.2e} | {_rel(dw, ref_dw):.2e} |"
        )


def _other_backend(device: torch.device) -> tuple[str, Callable]:
    """The backend ``linear_cross_entropy`` does not take by default on ``device``, and the head through it."""
    other = "eager" if device.type in COMPILES_BY_DEFAULT else "compiled"
    return other, lambda hidden, weight, labels: linear_cross_entropy(hidden, weight, labels, backend=other)


def _under_bf16_autocast(fn, device: torch.device):
    """``fn`` called under bf16 autocast on ``device`` (``bf16-mixed``: float32 weights, bf16 matmuls)."""

    def run(*args):
        with torch.autocast(device.type, torch.bfloat16):
            return fn(*args)

    return run


def head_shapes(
    device: torch.device, dtype: torch.dtype, reps: int, backends: bool = False, mixed: bool = False
) -> None:
    """The table of ``--shapes`` (module docstring); with ``backends``, the backend not taken by default
    on ``device`` (compiled on a CPU, eager on CUDA) timed too, its ratio to the plain head in the last
    column (on CUDA: whether compiling the chunks is what makes them fast or slow); with ``mixed``,
    every head under bf16 autocast (``dtype`` float32: ``bf16-mixed``)."""
    inputs = f"{dtype} inputs under bf16 autocast" if mixed else f"{dtype} inputs"
    print(f"the head alone, forward + backward, {inputs} on {device}, median of {reps} rounds\n")
    other, other_head = _other_backend(device)
    print(
        "| head | tokens | chunk | plain ms | chunked ms | chunked / plain | plain peak | chunked peak "
        "| plain loss vs float64 | chunked loss vs float64 |" + (f" {other} / plain |" if backends else "")
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if backends else ""))
    for name, vocab, width, cpu_tokens, cuda_tokens in SHAPES:
        tokens = cuda_tokens if device.type == "cuda" else cpu_tokens
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(tokens, width, generator=g).to(device, dtype).requires_grad_()
        weight = (torch.randn(vocab, width, generator=g) * width**-0.5).to(device, dtype).requires_grad_()
        labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
        with torch.no_grad():  # the same (rounded) inputs in float64 (chunked: exact to 1e-12 there, tested)
            reference = float(linear_cross_entropy(hidden.double(), weight.double(), labels))
        ways = {"plain": _plain, "chunked": _chunked} | ({other: other_head} if backends else {})
        if mixed:
            ways = {k: _under_bf16_autocast(fn, device) for k, fn in ways.items()}
        losses = {k: float(_head_step(fn, hidden, weight, labels)) for k, fn in ways.items()}  # warm-up
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(reps):  # alternated: a burst of load on the machine hits both
            for key, fn in ways.items():
                _sync(device)
                start = time.perf_counter()
                _head_step(fn, hidden, weight, labels)
                _sync(device)
                times[key].append(time.perf_counter() - start)
        ratio = statistics.median(c / p for c, p in zip(times["chunked"], times["plain"]))
        peaks = {k: _peak_above_inputs(ways[k], hidden, weight, labels) for k in ("plain", "chunked")}
        rel = {k: abs(v - reference) / abs(reference) for k, v in losses.items()}
        chunk = default_chunk_size(tokens, vocab, width, device)
        print(
            f"| {name}, {vocab:,} x {width:,} | {tokens:,} | {chunk:,} "
            f"| {statistics.median(times['plain']) * 1e3:,.1f} | {statistics.median(times['chunked']) * 1e3:,.1f} "
            f"| {ratio:.3f} | {peaks['plain'] / MiB:,.1f} MiB | {peaks['chunked'] / MiB:,.1f} MiB "
            f"| {rel['plain']:.1e} | {rel['chunked']:.1e} |"
            + (
                f" {statistics.median(c / p for c, p in zip(times[other], times['plain'])):.3f} |"
                if backends
                else ""
            ),
            flush=True,
        )
        del hidden, weight, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="2 layers, h=128, GPT-2's vocabulary, 2 x 512")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    parser.add_argument("--reps", type=int, default=5, help="timed rounds (each: one step of each head)")
    parser.add_argument("--shapes", action="store_true", help="the head alone at four models' shapes")
    parser.add_argument(
        "--bound", action="store_true", help="Llama 3's head at 16,384 tokens: bytes, accuracy"
    )
    parser.add_argument("--device", default="cpu", help="for --shapes: cpu (default) or cuda")
    parser.add_argument(
        "--backends",
        action="store_true",
        help="for --shapes: time the other backend too (compiled on a CPU, eager on CUDA)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="for --shapes: float32 (CPU default), bfloat16 (CUDA default) or bf16-mixed (float32, autocast)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.bound:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        bound()
        return
    if args.shapes:
        device = torch.device(args.device)
        mixed = args.dtype == "bf16-mixed"
        default = "bfloat16" if device.type == "cuda" else "float32"
        dtype = getattr(torch, "float32" if mixed else args.dtype or default)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        head_shapes(device, dtype, args.reps, args.backends, mixed)
        return
    if args.small:
        config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=512)
        size, seq = 2, 512
    else:
        config, size, seq = transformers.GPT2Config(), 2, 1024
    inputs = batch(config, size, seq)
    print(
        f"GPT-2 {config.n_layer} layers, h={config.n_embd}, vocab {config.vocab_size:,}, batch {size} x {seq:,}"
    )
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"chunk size (default): {default_chunk_size(size * (seq - 1))} tokens\n")
    print("| step (forward + backward, fp32) | peak live bytes | at the peak (MiB) |")
    print("|---|---:|---|")
    # GPT-2's attention dropout (0.1) sends CPU's scaled_dot_product_attention to its math kernel, which
    # holds batch x heads x sequence^2 tensors; without it (Llama-style configs) the fused kernel runs
    no_attention_dropout = transformers.GPT2Config(**{**config.to_dict(), "attn_pdrop": 0.0})
    for name, cfg, options in (
        ("own head, no checkpointing", config, {}),
        ("own head, every block checkpointed", config, dict(blocks=True)),
        ("chunked head, every block checkpointed", config, dict(blocks=True, head=True)),
        ("own head, every block checkpointed, attention dropout 0", no_attention_dropout, dict(blocks=True)),
        (
            "chunked head, every block checkpointed, attention dropout 0",
            no_attention_dropout,
            dict(blocks=True, head=True),
        ),
    ):
        peak, at = step_peak(build(cfg, **options), inputs)
        parts = ", ".join(f"{k} {v / MiB:,.0f}" for k, v in at.items() if v)
        print(f"| {name} | {peak / MiB:,.0f} MiB | {parts} |")
    b = head_bytes(config, size, seq)
    print("\n| the head alone, above its inputs | bytes |")
    print("|---|---:|")
    print(f"| one logits tensor | {b['logits'] / MiB:,.1f} MiB |")
    print(f"| own head's peak | {b['own'] / MiB:,.1f} MiB |")
    print(f"| chunked head's peak | {b['chunked'] / MiB:,.1f} MiB |")
    print(
        f"| of which the gradients it computes in forward (hidden, weight) | {b['gradients'] / MiB:,.1f} MiB |"
    )
    print(
        f"| of which the rest (one chunk of logits, per-token vectors) | {(b['chunked'] - b['gradients']) / MiB:,.1f} MiB |"
    )
    untracked, tracked = tied_sum_in_place()
    print(
        f"\ntied embedding's gradients summed in place (no new weight-sized tensor): without MemoryTracker "
        f"{untracked}, under it {tracked}"
    )
    loss_rel, grad_rel = exactness()
    print(
        f"\nfloat64, 2-layer GPT-2: loss rel diff {loss_rel:.1e}, largest parameter-gradient rel diff {grad_rel:.1e}"
    )
    median, ratios = time_ratio(config, inputs, args.reps)
    print(
        f"step time chunked / own head (blocks checkpointed): {median:.3f} (median of {args.reps}: "
        f"{', '.join(f'{r:.3f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
