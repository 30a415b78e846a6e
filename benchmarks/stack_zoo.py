"""What ``AutoCheckpoint()`` does on the zoo's causal LMs under ``bf16-mixed``, on the torch this runs on.

Run from the repository root with each stack (about a minute each on 2 CPU cores; never run by the test
suite)::

    PYTHONPATH=. python benchmarks/stack_zoo.py                      # the CI stack (torch 2.13)
    PYTHONPATH=. /work/venv211/bin/python benchmarks/stack_zoo.py    # a rented GPU's stack (torch 2.11)
    PYTHONPATH=. python benchmarks/stack_zoo.py --only llama mistral
    PYTHONPATH=. python benchmarks/stack_zoo.py --padded             # the zoo's padded batches instead

The rows are the ``causal_lm`` entries of :data:`tests.zoo.models.ZOO` (tiny Hugging Face configs; Llama,
Mistral, Qwen 2, Gemma 2, Phi-3 and Mixtral with grouped-query attention, GPT-2 without), float32
parameters, each trained two steps by Lightning on the CPU with ``precision="bf16-mixed"`` and zero-argument
``AutoCheckpoint()``, on packed batches of 2 (full-length sequences, no ``attention_mask``: transformers then
runs grouped-query attention inside SDPA, where torch 2.11's FLOP formula asserts; with a padding mask it
repeats the key/value heads first and the attention op never sees grouped-query shapes) (its plan is made after the first batch; with no memory limit known on a CPU it
checkpoints every block where that lowers the bytes held). A row says how many blocks the plan checkpoints
(``plan.choices`` not ``"keep"``) of the blocks ``find_blocks`` finds, whether the chunked output head computed the loss at
the second step (``yes``) or the model's own head did (``no``, with the note that said why), and every
other note ``AutoCheckpoint`` gave. The totals are the two rows of issue 33's numbers table:

- GQA causal LMs in the zoo with >= 1 block checkpointed (goal: all);
- causal LMs of the zoo taking the chunked head under bf16-mixed (goal: all that take it in float64).
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

import lightning.pytorch as pl
import torch
import transformers
from lightning.pytorch.callbacks import Callback

from lightning_memopt import AutoCheckpoint
from lightning_memopt.checkpointing import find_blocks
from lightning_memopt.head.causal_lm import causal_lms
from tests.batching.helpers import quiet_trainer
from tests.zoo.models import ZOO, ZooModule, loader, packed_causal_lm_batch

BATCH = 2
HEAD_NOTE = "the chunked output head (lightning_memopt.head) is not used: "


class _HeadSeen(Callback):
    """Whether the causal LM's forward is the chunked head's at the end of each training step (a declined
    head is undone at its first call)."""

    def __init__(self) -> None:
        self.taken: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.taken.append(all("forward" in vars(m) for m in causal_lms(pl_module)))


def grouped_query(model: torch.nn.Module) -> str:
    """``"kv/q"`` heads where the config has fewer key/value heads than query heads, else ``"no"``."""
    cfg = model.config
    kv, q = getattr(cfg, "num_key_value_heads", None), getattr(cfg, "num_attention_heads", None)
    return f"{kv}/{q}" if kv is not None and q is not None and kv < q else "no"


def run(name: str, padded: bool = False) -> dict:
    module = ZooModule(name)
    callback, seen = AutoCheckpoint(log=False), _HeadSeen()
    trainer = quiet_trainer([callback, seen], max_steps=2, precision="bf16-mixed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader(name, BATCH, batch=None if padded else packed_causal_lm_batch))
    notes = [
        str(w.message) for w in caught if "AutoCheckpoint" in str(w.message) or HEAD_NOTE in str(w.message)
    ]
    head_notes = [n.split(HEAD_NOTE, 1)[1] for n in notes if HEAD_NOTE in n]
    choices = callback.plan.choices if callback.plan is not None else {}
    return {
        "gqa": grouped_query(module.model),
        "checkpointed": sum(c != "keep" for c in choices.values()),
        "blocks": len(find_blocks(module)),  # found; a block left out of the plan is not checkpointed
        "head": seen.taken[-1],
        "head_reason": "; ".join(head_notes),
        "notes": [n for n in notes if HEAD_NOTE not in n],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="zoo names (default: every causal LM)")
    parser.add_argument("--padded", action="store_true", help="the zoo's right-padded batches, with a mask")
    args = parser.parse_args(argv)
    names = args.only or [n for n, e in ZOO.items() if e.kind == "causal_lm"]
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    pl.seed_everything(0, verbose=False)
    version = f"{torch.__version__} (transformers {transformers.__version__})"
    batches = "padded batches with attention_mask" if args.padded else "packed batches, no attention_mask"
    print(
        f"python {sys.version.split()[0]}, torch {version}, bf16-mixed on the CPU, AutoCheckpoint(), {batches}\n"
    )
    print("| model | GQA kv/q heads | torch | blocks checkpointed | chunked head | why not / notes |")
    print("|---|---|---|---|---|---|")
    rows = {}
    for name in names:
        try:
            row = rows[name] = run(name, args.padded)
        except Exception as err:  # noqa: BLE001 - a table row per failure
            print(
                f"| {name} | | {torch.__version__} | crash | crash | {type(err).__name__}: {str(err)[:120]} |"
            )
            continue
        why = (
            "; ".join(filter(None, [row["head_reason"], *row["notes"]])).replace("|", "/").replace("\n", " ")
        )
        print(
            f"| {name} | {row['gqa']} | {torch.__version__} | {row['checkpointed']} / {row['blocks']} | "
            f"{'yes' if row['head'] else 'no'} | {why} |"
        )
    gqa = [r for r in rows.values() if r["gqa"] != "no"]
    print(
        f"\nGQA causal LMs in the zoo with >= 1 block checkpointed, torch {torch.__version__}: "
        f"{sum(r['checkpointed'] >= 1 for r in gqa)} of {len(gqa)}"
    )
    print(
        f"causal LMs of the zoo taking the chunked head under bf16-mixed, torch {torch.__version__}: "
        f"{sum(r['head'] for r in rows.values())} of {len(rows)}"
    )


if __name__ == "__main__":
    main()
