"""Telling an out-of-memory error from every other error."""

from __future__ import annotations

import torch

__all__ = ["is_out_of_memory"]

# Messages of allocators that raise a plain RuntimeError (older torch, the CPU allocator, cuDNN/cuBLAS
# workspaces, ROCm, MPS, XPU), matched case-insensitively. Specific on purpose: a user's own
# "out of memory" text in an unrelated error must not start a retry, so bare "out of memory" alone
# counts only with a device word before it.
_MESSAGES = (
    "cuda out of memory",
    "hip out of memory",
    "xpu out of memory",
    "mps backend out of memory",
    "defaultcpuallocator: can't allocate memory",
    "defaultcpuallocator: not enough memory",
    "cudnn_status_alloc_failed",
    "cublas_status_alloc_failed",
    "cuda error: out of memory",
)


def is_out_of_memory(error: BaseException) -> bool:
    """True if ``error`` is an accelerator's or the CPU allocator's out-of-memory error; never for any other.

    Example::

        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_out_of_memory(RuntimeError("shape mismatch"))
        False
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if type(error) is not RuntimeError:  # subclasses (NotImplementedError, ...) are never allocator errors
        return False
    text = str(error).lower()
    return any(message in text for message in _MESSAGES)
