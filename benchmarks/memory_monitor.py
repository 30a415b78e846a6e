"""What MemoryMonitor reports for a small transformer, and what measuring costs on CPU.

Run: python benchmarks/memory_monitor.py

Prints the exact peak bytes of each phase of the last training step (and the breakdown at the step's
peak), the summary MemoryMonitor prints at the end of fit, and the time of a fit with the monitor
divided by the time of the same fit without it (same process, same data; a ratio, not seconds).

Then the output head's line and time: a Hugging Face GPT-2 of 2 layers, width 128 and GPT-2's vocabulary
(50,257), float32, 4 x 256 tokens, SGD, 6 steps (2 threads), once with its own head and once with the
chunked head (``take_over_heads(model, "chunked")``): MemoryMonitor's summary lines, the head's bytes at
the step's peak and its time against the step's (``time a step ...``; on a CPU the whole step runs tracked).
"""

import tempfile
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import MemoryMonitor
from lightning_memopt.head.causal_lm import take_over_heads
from lightning_memopt.memory import CATEGORIES
from lightning_memopt.memory.report import PHASES, peak_phase, summary

STEPS, BATCH, SEQ, WIDTH = 8, 16, 64, 128


class Encoder(pl.LightningModule):
    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True)
        self.net = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()  # (B, T, C) -> scalar

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(callbacks, root, module=None, data=None, steps=STEPS):
    """Seconds of a fit of ``module`` (default: the encoder on random features) on ``data``."""
    torch.manual_seed(0)
    if data is None:
        data = DataLoader(TensorDataset(torch.randn(STEPS * BATCH, SEQ, WIDTH)), batch_size=BATCH)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
        logger=pl.loggers.CSVLogger(root, name="bench"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    start = time.perf_counter()
    trainer.fit(module if module is not None else Encoder(), data)
    return time.perf_counter() - start


def main() -> None:
    torch.set_num_threads(1)  # steadier timings on a shared machine
    root = tempfile.mkdtemp()
    fit([], root)  # warm-up: first-use costs of torch and Lightning are not the monitor's
    ratios = []
    for _ in range(3):  # alternate, so a burst of load on the machine hits both sides
        plain = fit([], root)
        monitor = MemoryMonitor(log_every_n_steps=1)
        ratios.append(fit([monitor], root) / plain)
    ratios.sort()

    last = monitor.history[-1]
    print(f"encoder: 2 layers, width {WIDTH}, batch {BATCH}x{SEQ}, AdamW; last of {STEPS} steps (bytes):")
    for phase in PHASES:
        print(f"  {phase:<10} peak {last[phase]:>10,d}")
    top = peak_phase(last)
    print(f"  at the step's peak ({top}):")
    for category in CATEGORIES:
        print(f"    {category:<16} {last[f'{top}_{category}']:>10,d}")
    print(
        f"fit time with MemoryMonitor / without: median {ratios[1]:.2f}x "
        f"(min {ratios[0]:.2f}x, max {ratios[2]:.2f}x; 3 pairs of {STEPS}-step fits, 1 thread)"
    )
    print(f"report: {', '.join(map(str, monitor.report_paths))}")
    head_time(root)


class GPT2(pl.LightningModule):
    def __init__(self, chunked: bool):
        import transformers

        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=2, n_positions=256)
        self.model = transformers.GPT2LMHeadModel(config)
        if chunked:
            take_over_heads(self.model, "chunked", note=lambda line: None)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def head_time(root) -> None:
    torch.set_num_threads(2)
    print("\nGPT-2, 2 layers, width 128, vocabulary 50,257, 4 x 256 tokens, float32, 6 steps:")
    for chunked in (False, True):
        monitor = MemoryMonitor(log=False, report=False)
        torch.manual_seed(0)
        data = DataLoader(list(torch.randint(0, 50257, (24, 256))), batch_size=4)
        fit([monitor], root, GPT2(chunked), data, steps=6)
        lines = summary(list(monitor.history)).splitlines()
        print(f"  {'chunked head' if chunked else 'its own head'}:")
        print("\n".join(f"    {line.strip()}" for line in lines[1:]))


if __name__ == "__main__":
    main()
