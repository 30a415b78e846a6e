"""Train the character-level GPT with LightningCLI, then print where the memory went.

Run (from the repository root)::

    python examples/gpt/train.py fit --config examples/gpt/memopt.yaml     # with lightning_memopt
    python examples/gpt/train.py fit --config examples/gpt/baseline.yaml   # the same job without it

Any option can be changed on the command line, e.g. ``--trainer.max_steps=50`` or
``--model.n_layer=8``; ``python examples/gpt/train.py fit --help`` lists them all.

Before training, one training step of the same model on the same batch is run WITHOUT the package's
callbacks under a ``MemoryTracker`` (``--baseline_step=false`` skips it). After training, its peak memory
per phase and category is printed next to what ``MemoryMonitor`` measured during the run (when the config
has one), with the ratio: the saving, measured in the same process, on the same batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ holds the shared report code
sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline_step import BaselineStepCLI  # noqa: E402
from gpt import CharGPT, StdlibText  # noqa: E402


class GPTCLI(BaselineStepCLI):
    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        # One context length for the data and the position embedding.
        parser.link_arguments("data.block_size", "model.block_size")


def main(args: list[str] | None = None, *, run: bool = True) -> LightningCLI:
    torch.set_float32_matmul_precision("high")
    return GPTCLI(
        CharGPT,
        StdlibText,
        args=args,
        run=run,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
