"""Tiny models shared by the checkpointing tests."""

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm transformer block (attention written out with matmuls, as in nanoGPT's slow path)."""

    def __init__(self, h: int = 16, heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(h)
        self.attn = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h)
        self.fc_proj = nn.Linear(4 * h, h)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (
            t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v)
        )  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / (C // self.heads) ** 0.5)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc_proj(torch.nn.functional.gelu(self.fc(self.ln_2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, n_layer: int = 3, h: int = 16, vocab: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.h = nn.ModuleList(Block(h, dropout=dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))
