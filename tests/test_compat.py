"""The private torch APIs behind lightning_memopt._compat still do what the package relies on."""

import torch

from lightning_memopt import _compat


def test_in_backward_and_queued_callbacks():
    seen = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad):
        seen.append(("hook", _compat.in_backward()))
        _compat.queue_backward_callback(lambda: seen.append(("callback", _compat.in_backward())))
        return grad

    y = x * 2
    y.register_hook(hook)
    assert not _compat.in_backward()
    y.sum().backward()
    assert seen == [("hook", True), ("callback", True)]  # the callback runs at the end of the same backward


def test_pytree_batchnorm_and_fsdp_names():
    leaves, spec = _compat.tree_flatten({"a": (1, 2), "b": 3})
    assert leaves == [1, 2, 3] and _compat.tree_unflatten(leaves, spec) == {"a": (1, 2), "b": 3}
    assert all(issubclass(c, _compat.BatchNormBase) for c in (torch.nn.BatchNorm1d, torch.nn.SyncBatchNorm))
    fsdp = _compat.fsdp_module_type()
    assert fsdp is None or fsdp.__name__ == "FSDPModule"
