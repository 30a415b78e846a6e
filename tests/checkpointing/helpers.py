"""Helpers the checkpointing tests share."""

import gc

import torch


def live_tensors() -> int:
    """How many tensors are alive now, after a collection: a step that leaves any behind (held by a cycle
    through autograd's C++ nodes, which no collector frees) makes it grow."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
