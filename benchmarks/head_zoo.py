"""Is the chunked head taken, or declined with a reason, on every causal LM of the zoo? A sweep.

Run from the repository root (about a minute on 2 CPU cores; never run by the test suite)::

    PYTHONPATH=. python benchmarks/head_zoo.py                  # every causal LM row of the zoo
    PYTHONPATH=. python benchmarks/head_zoo.py --only gpt2 trocr

The rows are the ``causal_lm`` architectures of :mod:`benchmarks.micro_batching_zoo` (Hugging Face
classes built from tiny configs in code, float64, dropout off), each trained one step on a right-padded
batch of 8 (``labels`` -100 at padding): once with the model's own head, once after
``take_over_heads(model, "auto")`` (what ``AutoCheckpoint()`` does). Each row is one of:

- ``taken``: the chunked head computed the loss (the output has no logits), no note, and the loss and
  every parameter's gradient equal those of a float64 cross-entropy over the logits the model's head
  computes (at most 1e-10 of the largest gradient), shifted by one position or not, whichever the
  model's own loss is, and the model's own loss (at most 1e-5: most transformers losses upcast the
  logits with ``.float()``, to float32 in a float64 model);
- ``declined``: the model's own head computed the loss and one note said why;
- ``WRONG``: the chunked head computed the loss and it or a gradient differs (never allowed);
- ``SILENT``: the model's own head computed the loss and no note said why (never allowed);
- ``crash``: the run with ``take_over_heads`` raised (the own head's trained).

An architecture that cannot be built or trained with its own head is ``skipped``. It prints a Markdown
table and the totals.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.micro_batching_zoo import ARCHS, Arch, sweep_table
from lightning_memopt.head.causal_lm import output_head, take_over_heads
from tests.zoo.models import causal_lm_batch

BATCH = 8
BAR = 1e-10
OWN_LOSS_BAR = 1e-5


def _step(model: torch.nn.Module, batch: dict, float64_loss: bool = False) -> tuple:
    """The own loss, the loss differentiated, the gradients by parameter name and the output of one
    forward and backward. ``float64_loss``: differentiate the reference instead, a cross-entropy over the
    head's logits as the head computed them (float64; some models cast their logits to float32 after),
    scaled and soft-capped where the model says so (Cohere, Granite, Gemma 2), shifted by one position or not, whichever is closer to the
    model's own loss."""
    model.zero_grad(set_to_none=True)
    logits: list[torch.Tensor] = []
    handle = output_head(model).register_forward_hook(lambda module, args, out: logits.append(out))
    try:
        out = model(**batch)
    finally:
        handle.remove()
    loss = out.loss
    if float64_loss:  # shifted, or not: whichever the model's own loss is (TrOCR's, XLNet's are not)
        labels, z = batch["labels"], logits[-1]
        z = z * getattr(model, "logit_scale", 1.0) / getattr(model.config, "logits_scaling", 1.0)
        if cap := getattr(model.config, "final_logit_softcapping", None):  # Gemma 2's, after the head
            z = cap * torch.tanh(z / cap)
        shifted = F.cross_entropy(z[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        unshifted = F.cross_entropy(z.flatten(0, 1), labels.flatten())
        loss = min((shifted, unshifted), key=lambda ref: abs(float(ref.detach() - out.loss.detach())))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), loss.detach(), grads, out


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _gradient_gap(grads: dict, reference: dict) -> float:
    """The largest difference over all gradients, relative to the largest reference gradient (a gradient
    that is zero in exact arithmetic, such as an attention key's bias, carries rounding only)."""
    largest = max(float(g.abs().max()) for g in reference.values())
    return max(float((grads[n] - g).abs().max()) for n, g in reference.items()) / largest


def sweep_one(arch: Arch) -> tuple[str, str]:
    """(outcome, detail) for one architecture."""
    batch = causal_lm_batch(BATCH)
    try:
        model = arch.build().train()
        if output_head(model) is None:
            return "skipped", "no nn.Linear output embeddings to compare logits from"
        own_loss, reference_loss, own_grads, _ = _step(model, batch, float64_loss=True)
    except Exception as error:  # noqa: BLE001 - the row says why
        return "skipped", f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"
    notes: list[str] = []
    try:
        undo = take_over_heads(model, "auto", note=notes.append)
        try:
            _, loss, grads, out = _step(model, batch)
        finally:
            undo()
    except Exception as error:  # noqa: BLE001
        return "crash", f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"
    taken = "logits not computed" in repr(out)
    if not taken:
        return ("declined", notes[0]) if notes else ("SILENT", "own head, no note")
    if notes:
        return "WRONG", f"taken, yet noted: {notes[0]}"
    if grads.keys() != own_grads.keys():
        return "WRONG", f"gradients of other parameters: {sorted(grads.keys() ^ own_grads.keys())[:3]}"
    gap, own_gap = max(_gap(loss, reference_loss), _gradient_gap(grads, own_grads)), _gap(loss, own_loss)
    if gap > BAR or own_gap > OWN_LOSS_BAR:
        return "WRONG", f"differs: {gap:.2g} from the float64 reference, {own_gap:.2g} from its own loss"
    return "taken", f"{gap:.1e} (float64 reference), {own_gap:.1e} (own loss)"


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="architecture names (the zoo's rows)")
    args = parser.parse_args(argv)
    archs = [a for a in ARCHS if a.task == "causal_lm" and (not args.only or a.name in args.only)]

    def row(arch: Arch) -> tuple[str, list[str]]:
        outcome, detail = sweep_one(arch)
        return outcome, [arch.model_class().__name__, outcome, detail]

    return sweep_table(archs, row, ["class", "outcome", "detail"])


if __name__ == "__main__":
    main()
