"""A character-level GPT trained on the source code of Python's own standard library.

The model follows nanoGPT: token and position embeddings, ``n_layer`` pre-norm transformer blocks
(causal self-attention, then an MLP), a final LayerNorm and a head that shares the embedding matrix.
The corpus needs no download: it is the ``.py`` files of the standard library of the interpreter that
runs this file, read in sorted order, as bytes (ASCII source code: one byte is one character, so the
vocabulary is the 256 byte values).

The blocks live in ``model.blocks`` (an ``nn.ModuleList``), which is what ``AutoCheckpoint`` discovers
on its own; nothing in this file knows about lightning_memopt.
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB_SIZE = 256  # byte values
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


# ----------------------------------------------------------------------------------------- the model
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)  # query, key and value for all heads in one matmul
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, n_head, T, head_size): attention runs per head
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again: (B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """One transformer block; pre-norm, so the residual stream is never normalized in place."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    def __init__(self, *, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(VOCAB_SIZE, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"sequence length {T} is longer than block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


class CharGPT(L.LightningModule):
    """A character-level GPT as a LightningModule.

    Args:
        block_size: Context length in characters (linked to the data module's ``block_size``).
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block.
        n_embd: Width of the residual stream.
        dropout: Dropout probability everywhere.
        lr: AdamW learning rate (cosine-free, constant after a short linear warm-up).
        weight_decay: AdamW weight decay for matrices (not for biases, norms and embeddings).
        warmup_steps: Linear warm-up length in optimizer steps.
    """

    def __init__(
        self,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        lr: float = 2e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(
            block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=dropout
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean next-character cross-entropy of a batch ``(x, y)``, both ``(B, T)``."""
        x, y = batch
        logits = self(x)  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True)

    def configure_optimizers(self):
        # Decay matrices only (nanoGPT's rule: parameters with 2 or more dims).
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
            betas=(0.9, 0.99),
        )
        warmup = max(1, self.hparams.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ------------------------------------------------------------------------------------------ the data
def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the standard library's ``.py`` files, in sorted path order.

    Returns a 1-D ``uint8`` tensor. Test and site-packages directories are left out, so the corpus is the
    library itself and is the same for every installation of the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for directory, subdirectories, files in os.walk(root):
        # Walk in sorted order, and never into installed packages or the test suites.
        subdirectories[:] = sorted(d for d in subdirectories if d not in _SKIP_DIRS)
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                data = (Path(directory) / name).read_bytes()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"found no Python source files under {root}; is the standard library installed?")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


class RandomWindows(Dataset):
    """``num_samples`` windows of ``block_size + 1`` bytes at random (seeded) offsets of ``data``."""

    def __init__(self, data: torch.Tensor, block_size: int, num_samples: int, seed: int) -> None:
        if len(data) <= block_size + 1:
            raise ValueError(
                f"the corpus ({len(data)} bytes) is shorter than block_size + 1 ({block_size + 1})"
            )
        self.data, self.block_size = data, block_size
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, len(data) - block_size - 1, (num_samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[i])
        chunk = self.data[start : start + self.block_size + 1].long()  # (T + 1,)
        return chunk[:-1], chunk[1:]  # input and the next character at every position: (T,), (T,)


class StdlibText(L.LightningDataModule):
    """Random windows of Python standard-library source code; the last ``val_fraction`` is held out.

    Args:
        block_size: Characters per sample (the model's context length).
        batch_size: Samples per optimizer step (micro-batching, if any, happens inside the step).
        max_bytes: How much of the standard library to read.
        val_fraction: Share of the corpus (its end) used for validation.
        samples_per_epoch: Training windows per epoch.
        val_samples: Validation windows.
        seed: Seed of the window offsets.
    """

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 32,
        max_bytes: int = 4_000_000,
        val_fraction: float = 0.05,
        samples_per_epoch: int = 32_000,
        val_samples: int = 256,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction!r}")
        self.save_hyperparameters()
        self.train_set: RandomWindows | None = None
        self.val_set: RandomWindows | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        data = stdlib_corpus(hp.max_bytes)
        split = int(len(data) * (1 - hp.val_fraction))
        self.train_set = RandomWindows(data[:split], hp.block_size, hp.samples_per_epoch, hp.seed)
        self.val_set = RandomWindows(data[split:], hp.block_size, hp.val_samples, hp.seed + 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, shuffle=False)
