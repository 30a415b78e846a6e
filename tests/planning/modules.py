"""Tiny LightningModules for the planner's tests (importable by class path: tests.planning.modules:Name)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class TinyLM(pl.LightningModule):
    """Embedding, ``layers`` MLP blocks, a head; AdamW (so optimizer state is counted)."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def training_step(self, batch, batch_idx):
        return self(batch)  # through forward: FSDP2's root hooks gather the root's parameters there

    def forward(self, batch):
        x = self.embed(batch)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class DataDependent(TinyLM):
    """Python control flow on a tensor's value inside a block: cannot run on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[1].forward = self._branchy

    def _branchy(self, x):
        if x.sum() > 0:  # reads a value
            return x * 2
        return x


class TinyGPT2(pl.LightningModule):
    """A Hugging Face GPT-2 (2 layers, float32, its head tied to the embedding); AdamW.

    ``chunked=True``: at its first training step it puts its own loss through the chunked head
    (``take_over_heads``), as ``AutoCheckpoint(head="chunked")`` would: a measurement independent of
    the planner's own take-over (``copy.deepcopy`` copies it before that step)."""

    def __init__(self, vocab: int = 99, width: int = 32, layers: int = 2, chunked: bool = False) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(
            vocab_size=vocab, n_embd=width, n_layer=layers, n_head=2, n_positions=64
        )
        self.model = transformers.GPT2LMHeadModel(config)
        self.chunked, self.undo = chunked, None

    def training_step(self, batch, batch_idx):
        if self.chunked and self.undo is None:
            from lightning_memopt.head.causal_lm import take_over_heads

            self.undo = take_over_heads(self.model, "chunked", note=print)
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
