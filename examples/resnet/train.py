"""Train a small BatchNorm ResNet on synthetic images with LightningCLI.

Run (from the repository root)::

    python examples/resnet/train.py fit --config examples/resnet/config.yaml

``--help`` after ``fit`` lists every option. As in the GPT example, one step of the same model without
the package is measured before training (``--baseline_step=false`` skips it) and compared with what
``MemoryMonitor`` measured during the run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/ holds the shared report code
sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline_step import BaselineStepCLI  # noqa: E402
from resnet import ImageClassifier, SyntheticImages  # noqa: E402


class ResNetCLI(BaselineStepCLI):
    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.link_arguments("data.num_classes", "model.num_classes")


def main(args: list[str] | None = None, *, run: bool = True) -> LightningCLI:
    return ResNetCLI(
        ImageClassifier,
        SyntheticImages,
        args=args,
        run=run,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
