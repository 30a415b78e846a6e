"""FLOP counting: attention by the package's own formula (grouped-query too), and no formula ever fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from lightning_memopt.checkpointing import find_blocks, profile_blocks
from lightning_memopt.checkpointing.flops import OpCounter, attention_flops

Q, KV = (2, 8, 16, 4), (2, 8, 24, 4)


def test_attention_flops_are_torchs_for_equal_heads():
    assert attention_flops(Q, KV, KV) == sdpa_flop_count(Q, KV, KV) == 2 * 2 * 8 * 16 * 24 * (4 + 4)
    backward = sdpa_backward_flop_count(Q, Q, KV, KV)
    assert attention_flops(Q, KV, KV, backward=True) == backward == 2 * 2 * 8 * 16 * 24 * (3 * 4 + 2 * 4)


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def test_grouped_query_attention_counts_as_its_repeated_heads():
    # Key and value with 2 heads for 8 query heads cost what the same attention with the heads repeated does.
    q = torch.randn(2, 8, 16, 4, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 4, requires_grad=True) for _ in range(2))
    with OpCounter() as grouped:
        _attention(q, k, v).sum().backward()
    with OpCounter() as repeated:
        _attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)).sum().backward()
    heads = (2, 8, 16, 4)
    expected = attention_flops(q.shape, heads, heads) + attention_flops(q.shape, heads, heads, backward=True)
    assert grouped.flops == repeated.flops == expected


def test_a_formula_that_raises_counts_bytes_instead(monkeypatch):
    # torch 2.11's sdpa formulas assert on grouped-query shapes; any formula that fails only prices by bytes.
    def rejects(*args, **kwargs):
        raise AssertionError("query/key/value shapes are incompatible")

    monkeypatch.setitem(flop_registry, torch.ops.aten.mm, rejects)
    a, b = torch.randn(4, 8), torch.randn(8, 2)
    with OpCounter() as counter:
        a @ b
    assert counter.flops == 0
    assert counter.bytes == (4 * 8 + 8 * 2 + 4 * 2) * 4


def test_a_failing_estimate_never_keeps_a_block(monkeypatch):
    """A block whose FLOP formula fails is still profiled (and so planned), never 'kept' for it."""
    transformers = pytest.importorskip("transformers")

    def rejects(*args, **kwargs):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    for packet in list(flop_registry):  # every formula fails: attention and the matmuls alike
        monkeypatch.setitem(flop_registry, packet, rejects)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    blocks = find_blocks(model)
    assert [n for n, _ in blocks] == ["model.layers.0", "model.layers.1"]
    profiles = profile_blocks(model, blocks, ids, labels=ids, choices=("keep", "full"))
    assert [p.name for p in profiles] == ["model.layers.0", "model.layers.1"]
    assert all(p.note is None for p in profiles)
    # attention is the package's own formula: still counted with every registry formula failing
    assert all(p.forward_flops > 0 for p in profiles)
