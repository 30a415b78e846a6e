"""Plan a Llama-2-7B-shaped run (32 layers, hidden 4096, seq 4096) on fake tensors; print time and max RSS.

Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/plan.py            # H100 (80 GiB), 1 device, bf16-mixed
    PYTHONPATH=$PWD python benchmarks/plan.py --devices 8

The model is this file's ``Llama7B`` LightningModule (transformers' LlamaForCausalLM, built from a config:
nothing is downloaded); the config is written to a temporary YAML and passed to ``lightning-memopt plan``
as a user would. Also printed: the exact parameter count and bytes, to compare with the prediction.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

CONFIG = """\
trainer:
  precision: bf16-mixed
  devices: {devices}
model:
  class_path: benchmarks.plan.Llama7B
  init_args:
    layers: {layers}
"""


class Llama7B(pl.LightningModule):
    """Llama-2-7B's shapes (vocab 32000, hidden 4096, MLP 11008, 32 heads), AdamW."""

    def __init__(self, layers: int = 32, hidden: int = 4096) -> None:
        super().__init__()
        import transformers

        cfg = transformers.LlamaConfig(
            hidden_size=hidden,
            intermediate_size=11008 * hidden // 4096,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
            max_position_embeddings=4096,
            use_cache=False,
        )
        self.model = transformers.LlamaForCausalLM(cfg)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--device-memory", default="H100")
    args = parser.parse_args()
    from lightning_memopt.planning import plan

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "llama7b.yaml"
        cfg.write_text(CONFIG.format(devices=args.devices, layers=args.layers))
        start = time.perf_counter()
        result = plan(configs=[str(cfg)], batch=["1x4096"], device_memory=args.device_memory)
        seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    with torch.device("meta"):
        meta = Llama7B(args.layers)
    numel = sum(p.numel() for p in meta.parameters())
    buffers = sum(
        b.numel() * b.element_size() for b in meta.buffers()
    )  # rotary inv_freq: counted with parameters
    tensors = len(list(meta.parameters()))
    opt = result["phases"]["optimizer"]
    print(f"plan: {seconds:.1f} s, max RSS {rss / 2**30:.2f} GiB (the whole process)")
    print(
        f"parameters: {numel:,}; predicted parameter bytes {opt['parameters']:,}, exact {4 * numel + buffers:,}"
    )
    print(f"predicted gradients {opt['gradients']:,}, exact {4 * numel:,}")
    print(f"predicted optimizer state {opt['optimizer_state']:,}, exact (AdamW) {8 * numel + 4 * tensors:,}")
    print(json.dumps({k: result[k] for k in ("peak_bytes", "fits", "categories")}, indent=1))
    for o in result["options"]:
        print(f"  {o['name']:<26} peak {o['peak_bytes']} cost {o['cost']} fits {o['fits']}")
    print(result["cheapest"] and result["cheapest"]["yaml"])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
