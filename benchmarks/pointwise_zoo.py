"""Is the ``pointwise`` treatment exact on transformers architectures this project did not write? A sweep.

Run from the repository root (a few minutes on 2 CPU cores; never run by the test suite)::

    PYTHONPATH=. python benchmarks/pointwise_zoo.py                  # every architecture of the zoo
    PYTHONPATH=. python benchmarks/pointwise_zoo.py --only gpt2 llama
    PYTHONPATH=. python benchmarks/pointwise_zoo.py --bf16-mixed     # float32, under bf16 autocast

The rows are the architectures of :mod:`benchmarks.micro_batching_zoo` (Hugging Face classes built from
tiny configs in code, float64, dropout off), each run one forward and backward on its task's batch of 8
(``model(**batch).loss``): once as built, once with ``pointwise`` on every block ``find_blocks`` finds.
Each row is one of:

- ``exact``: every parameter's gradient equals the plain run's within 1e-12 of the largest gradient (the
  same ops on the same values; what is left is the order autograd sums a parameter's gradients in), and
  the blocks hold no more activation bytes than under keep (``ActivationMeter``);

With ``--bf16-mixed`` the models are float32 and both runs go under CPU bf16 autocast, as Lightning's
``precision="bf16-mixed"`` runs them (what autocast casts is dropped too: its copies of a norm's
output); the bar is 1e-6 of the largest gradient.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.micro_batching_zoo import ARCHS, TASKS, Arch, sweep_table
from lightning_memopt.checkpointing import ActivationMeter, apply_checkpointing, find_blocks
from lightning_memopt.checkpointing.written import treatment_state

BATCH = 8
BAR = 1e-12
BAR_MIXED = 1e-6
MIXED = False  # --bf16-mixed


def _step(model: torch.nn.Module, batch: dict, blocks: list) -> tuple[dict, int]:
    """Gradients by parameter name, and the blocks' activation bytes, of one forward and backward."""
    model.zero_grad(set_to_none=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=MIXED)
    with ActivationMeter(model, blocks) as meter, autocast:
        loss = model(**batch).loss
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, meter.total


def _recomputed(blocks: list) -> str:
    """The sub-modules the dry runs chose, over all blocks (block prefixes left out)."""
    names: dict[str, bool] = {}
    for _, block in blocks:
        for found in treatment_state(block).pointwise.values():
            names.update((n, n in found.rerun) for n in found.names)
    return ", ".join(f"{n} (rerun)" if rerun else n for n, rerun in names.items()) or "no sub-module"


def sweep_one(arch: Arch) -> tuple[str, str, str]:
    """(outcome, dropped, detail) for one architecture."""
    batch = TASKS[arch.task][1](BATCH) if arch.batch is None else arch.batch(BATCH)
    dtype = torch.float32 if MIXED else torch.float64
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}  # pixels, audio
    try:
        model = arch.build(dtype).train()
        blocks = find_blocks(model)
        if not blocks:
            return "skipped", "", "no blocks found"
        reference, kept = _step(model, batch, blocks)
    except Exception as error:  # noqa: BLE001 - the row says why
        return "skipped", "", f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"
    if not all(g.isfinite().all() for g in reference.values()):  # LED, ProphetNet in float64 here
        return "skipped", "", "the plain run's gradients are not finite"
    try:
        apply_checkpointing(model, {name: "pointwise" for name, _ in blocks})
        grads, held = _step(model, batch, blocks)
    except Exception as error:  # noqa: BLE001
        return "crash", "", f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"
    dropped = f"{1 - held / kept:.0%}" if kept else "-"
    if grads.keys() != reference.keys():
        return (
            "DIFFERENT",
            dropped,
            f"gradients of other parameters: {sorted(grads.keys() ^ reference.keys())[:3]}",
        )
    largest = max((float(g.abs().max()) for g in reference.values() if g.numel()), default=0.0) or 1.0
    gap = max(float((grads[n] - g).abs().max()) for n, g in reference.items() if g.numel()) / largest
    if held > kept or gap > (BAR_MIXED if MIXED else BAR):
        return "DIFFERENT", dropped, f"gradient gap {gap:.2g}, held {held} of keep's {kept} bytes"
    return "exact", dropped, f"{gap:.1e}; {_recomputed(blocks)}"


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="architecture names (the zoo's rows)")
    parser.add_argument("--bf16-mixed", action="store_true", help="float32 models under CPU bf16 autocast")
    args = parser.parse_args(argv)
    global MIXED
    MIXED = args.bf16_mixed
    archs = [a for a in ARCHS if not args.only or a.name in args.only]

    def row(arch: Arch) -> tuple[str, list[str]]:
        outcome, dropped, detail = sweep_one(arch)
        return outcome, [arch.task, outcome, dropped, detail]

    return sweep_table(archs, row, ["task", "outcome", "dropped", "detail"])


if __name__ == "__main__":
    main()
