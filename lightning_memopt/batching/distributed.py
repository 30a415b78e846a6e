"""Rank agreement for the micro-batch engine (plain ``torch.distributed``).

Every function here is a collective: every rank calls it the same number of times, in the same order,
in every code path (the error paths included), or one rank waits forever. Outside an initialized
process group of more than one rank they return the local answer without communicating.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_gradients",
    "any_rank",
    "is_distributed",
    "max_over_ranks",
    "max_over_ranks_each",
    "min_over_ranks",
]

_BUCKET_BYTES = 25 * 2**20  # the same bucket size DDP uses by default


def is_distributed() -> bool:
    """True inside an initialized process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce(values: list[int], op: dist.ReduceOp, device: torch.device) -> list[int]:
    """The one small collective of this module: ``values`` reduced elementwise over ranks (8 bytes each)."""
    if not is_distributed():
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op)
    return [int(v) for v in t.tolist()]


def _int_all_reduce(value: int, op: dist.ReduceOp, device: torch.device) -> int:
    return _all_reduce([value], op, device)[0]


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True on every rank if ``flag`` is true on any rank (one 8-byte all-reduce)."""
    return bool(_int_all_reduce(int(flag), dist.ReduceOp.MAX, torch.device(device)))


def min_over_ranks(value: int, device: torch.device | str = "cpu") -> int:
    """The smallest ``value`` over all ranks, on every rank (one 8-byte all-reduce)."""
    return _int_all_reduce(int(value), dist.ReduceOp.MIN, torch.device(device))


def max_over_ranks(value: int, device: torch.device | str = "cpu") -> int:
    """The largest ``value`` over all ranks, on every rank (one 8-byte all-reduce)."""
    return _int_all_reduce(int(value), dist.ReduceOp.MAX, torch.device(device))


def max_over_ranks_each(values: list[int], device: torch.device | str = "cpu") -> list[int]:
    """Each of ``values``' largest over all ranks, on every rank (one all-reduce of ``8 * len(values)`` bytes)."""
    return _all_reduce([int(v) for v in values], dist.ReduceOp.MAX, torch.device(device))


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], used: list[int] | None = None) -> None:
    """Average the ``.grad`` of ``params`` over all ranks, as DDP's backward would have, in buckets of
    :data:`_BUCKET_BYTES` per dtype and device. A missing gradient counts as zeros (as in DDP); with
    ``used`` (per parameter that requires grad, agreed over ranks), one no rank used keeps ``grad=None``.
    """
    if not is_distributed():
        return
    world = dist.get_world_size()
    grads: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    trained = [p for p in params if p.requires_grad]
    for i, p in enumerate(trained):
        if used is not None and not used[i]:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for group in grads.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for g in group:
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= _BUCKET_BYTES:
                _reduce_bucket(bucket, world)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket, world)


def _reduce_bucket(bucket: list[torch.Tensor], world: int) -> None:
    flat = torch.cat([g.reshape(-1) for g in bucket])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for g in bucket:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n
