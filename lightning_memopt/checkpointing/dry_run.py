"""Run a block's forward once on fake tensors: what a treatment learns about a block before it runs it.

Selective checkpointing learns which compute ops' outputs are worth caching (``apply.py``), the
``pointwise`` treatment which sub-modules it can recompute (``pointwise.py``). Both learn it from one
:func:`dry_run`: the block's forward on fake tensors, watched by a saved-tensor pack hook and a dispatch
mode; no memory, no FLOPs, no RNG or buffer change, and modes the caller entered (memory trackers, FLOP
counters) do not see it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_memopt._tree import tensors
from lightning_memopt.checkpointing.written import Snapshot

__all__ = ["dry_run", "fake_call"]


@contextlib.contextmanager
def fake_call(block: nn.Module, args: tuple, kwargs: dict) -> Iterator[tuple[tuple, dict]]:
    """Yield fake copies of ``(args, kwargs)`` (same shapes, dtypes, devices and ``requires_grad``), inside
    a fake-tensor mode with every mode the caller entered switched off, for one dry run of ``block``.

    Afterwards the global RNG state, the autocast cache and ``block``'s buffers and attributes are as
    before. Errors of
    the dry run (an op fake tensors do not support, a data-dependent op) propagate: callers fall back to
    what is always correct.
    """
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    buffers = [(b, b._version, b.detach().clone()) for b in block.buffers()]
    attributes = Snapshot(block)  # a forward that keeps state must not keep fake tensors (written.py)
    # Autocast caches the casts of parameters while its region lasts: a cast made on fake tensors must
    # not be found by the real forward (nor change which casts the real forward and its recomputation run).
    autocast_cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    # An op without a fake kernel (e.g. grouped matmul) is an expected outcome here, not an error to log.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        with _disable_current_modes(), torch.random.fork_rng(devices=[]):
            mode = detect_fake_mode(tensors((args, kwargs))) or FakeTensorMode(allow_non_fake_inputs=True)
            with mode:

                def fake(v):
                    if not isinstance(v, torch.Tensor):
                        return v
                    f = v.detach() if mode.is_our_fake(v) else mode.from_tensor(v.detach())
                    return f.requires_grad_(v.requires_grad)

                yield tree_map(fake, (args, kwargs))
    finally:
        fake_log.setLevel(fake_level)
        torch.set_autocast_cache_enabled(autocast_cache)
        attributes.restore()
        with torch.no_grad():
            for b, version, saved in buffers:
                if b._version != version:  # untouched buffers keep their version: no state seen written
                    b.copy_(saved)


def dry_run(block: nn.Module, fn: Callable, args: tuple, kwargs: dict, *, pack: Callable, mode) -> bool:
    """Run ``fn(*args, **kwargs)`` (``block``'s forward) once on fake copies of its inputs
    (:func:`fake_call`), with gradients on, ``pack`` as the saved-tensor pack hook (what the forward saves
    for backward) and the dispatch ``mode`` entered (the ops it runs).

    Returns False where the block does not run on fake tensors (a data-dependent op, an op without a fake
    kernel): the caller then falls back to what is always correct.
    """
    try:
        with (
            fake_call(block, args, kwargs) as (fargs, fkwargs),
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None),
            mode,
        ):
            fn(*fargs, **fkwargs)
    except Exception:
        return False
    return True
