"""Count what a recomputation costs: compute-heavy FLOPs and the bytes every other op moves.

:class:`OpCounter` is a dispatch mode: matrix products take ``FlopCounterMode``'s formulas, attention takes
this module's (:func:`attention_flops`), and every other non-view op counts the bytes it reads and writes
(pointwise ops are memory-bound: they cost bytes, not FLOPs).

Attention has its own formula because torch's rejects shapes users run: before torch 2.12,
``sdpa_flop_count`` asserts when key and value have fewer heads than the query (grouped- and multi-query
attention: Llama 3, Mistral, Qwen 2, Gemma, Phi-3), and the CPU kernels are missing from its registry. A
count only prices a plan, so it must never fail: an op whose formula raises is counted as its bytes.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ["OpCounter", "attention_flops"]

_aten = torch.ops.aten


def _ops(*names: str) -> dict:
    # An overload packet per name this torch has (the CUDA and cuDNN kernels exist on every build).
    return {getattr(_aten, n): n for n in names if hasattr(_aten, n)}


# Scaled dot-product attention kernels taking (query, key, value, ...), each (batch, heads, seq, dim).
_FORWARD = _ops(
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
# Their backward kernels take (grad_out, query, key, value, ...).
_BACKWARD = _ops(
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
)


def attention_flops(query: torch.Size, key: torch.Size, value: torch.Size, *, backward: bool = False) -> int:
    """FLOPs of scaled dot-product attention on ``(batch, heads, seq, dim)`` shapes, forward or backward.

    Key and value may have fewer heads than the query (grouped-query attention): each query head still
    multiplies a full ``(L, E) x (E, S)`` and ``(L, S) x (S, Ev)``, so the work is counted per query head.
    With equal heads the figures are torch's (``sdpa_flop_count``, ``sdpa_backward_flop_count``): two
    matrix products forward; backward recomputes the scores, then the gradients of scores, value, query
    and key (five products).
    """
    *lead, length, dim = query
    source, value_dim = key[-2], value[-1]
    rows = math.prod(lead)  # batch x query heads
    if backward:
        return 2 * rows * length * source * (3 * dim + 2 * value_dim)
    return 2 * rows * length * source * (dim + value_dim)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class OpCounter(TorchDispatchMode):
    """Count compute-heavy FLOPs (``flops``) and the bytes moved by every other non-view op (``bytes``).

    Example::

        >>> with OpCounter() as counter:
        ...     _ = torch.randn(4, 8) @ torch.randn(8, 2)
        >>> counter.flops
        128
    """

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _FORWARD:
            self.flops += attention_flops(args[0].shape, args[1].shape, args[2].shape)
        elif packet in _BACKWARD:
            self.flops += attention_flops(args[1].shape, args[2].shape, args[3].shape, backward=True)
        elif packet in flop_registry and self._count(packet, args, kwargs, out):
            pass
        elif not func.is_view and func.namespace != "prim":  # prim: metadata queries (fake tensors)
            self.bytes += _nbytes(tree_flatten((args, kwargs, out))[0])
        return out

    def _count(self, packet, args, kwargs, out) -> bool:
        """Add torch's FLOP formula for ``packet``; False where the formula rejects these arguments."""
        try:
            self.flops += flop_registry[packet](*args, **kwargs, out_val=out)
        except Exception:  # a formula that asserts on a shape it does not know: priced by its bytes
            return False
        return True
