"""Short callback names in a LightningCLI config (``class_path: AutoCheckpoint``), as Lightning's own.

Each run is a fresh interpreter: jsonargparse resolves a short name among the ``Callback`` subclasses
imported so far, and in the test process every callback has long been imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["AutoCheckpoint", "AutoAccumulation", "OOMBackoff", "BatchNormToGroupNorm", "MemoryMonitor"]
NAMES += ["DataLoaderMonitor"]

CONFIG = """\
trainer:
  accelerator: cpu
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  callbacks:
    - class_path: AutoCheckpoint
      init_args:
        mode: full
    - class_path: AutoAccumulation
      init_args:
        micro_batch_size: 2
    - class_path: OOMBackoff
    - class_path: BatchNormToGroupNorm
    - class_path: MemoryMonitor
      init_args:
        log_every_n_steps: 1
    - class_path: DataLoaderMonitor
    - class_path: LambdaCallback
"""

SCRIPT = """\
import json
import sys

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

{imports}


class Tiny(LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3)])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.blocks(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)


cli = LightningCLI(Tiny, args=sys.argv[1:], save_config_kwargs={{"overwrite": True}})
callbacks = {{type(c).__name__: c for c in cli.trainer.callbacks}}
print(json.dumps({{name: type(c).__module__ for name, c in callbacks.items()}}))
print(json.dumps({{"choices": callbacks["AutoCheckpoint"].plan.choices, "steps": cli.trainer.global_step}}))
"""


def _run(tmp_path: Path, imports: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(imports=imports))
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(root=tmp_path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, str(script), "fit", "--config", str(config)]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("imports", ["import lightning_memopt", "import lightning_memopt.callbacks"])
def test_short_names_resolve_once_the_package_is_imported(tmp_path, imports):
    done = _run(tmp_path, imports)
    assert done.returncode == 0, done.stderr[-3000:]
    modules_line, run_line = done.stdout.strip().splitlines()[-2:]
    modules = json.loads(modules_line)
    for name in NAMES:
        assert modules[name].startswith("lightning_memopt.callbacks."), modules
    assert modules["LambdaCallback"].startswith("lightning.pytorch.callbacks")  # Lightning's own, alongside
    run = json.loads(run_line)
    assert run["steps"] == 2
    assert run["choices"] == {f"blocks.{i}": "full" for i in range(3)}  # AutoCheckpoint(mode: full) ran


def test_without_the_import_jsonargparse_cannot_know_them(tmp_path):
    """Why the import is needed (documented in docs/index.md): nothing else tells jsonargparse the names."""
    done = _run(tmp_path, "")
    assert done.returncode != 0
    assert "Expected a dot import path string: AutoCheckpoint" in done.stderr
