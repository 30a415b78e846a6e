"""The private torch APIs behind lightning_memopt._compat still do what the package relies on."""

import pytest
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


def test_saved_tensors_hooks_below_is_the_pair_in_effect():
    assert _compat.saved_tensors_hooks_below() is None
    pack, unpack = (lambda t: t), (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert _compat.saved_tensors_hooks_below() == (pack, unpack)
        with torch.autograd.graph.saved_tensors_hooks(unpack, pack):
            assert _compat.saved_tensors_hooks_below() == (unpack, pack)
    with (
        torch.autograd.graph.disable_saved_tensors_hooks("off"),
        pytest.raises(RuntimeError, match="disabled"),
    ):
        _compat.saved_tensors_hooks_below()


def test_mark_dynamic_compiles_one_graph_for_every_size():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    double = torch.compile(lambda t: t * 2, backend="eager")
    for n in (5, 7, 9):
        x = torch.ones(n, 3)
        _compat.mark_dynamic(x, 0)
        assert torch.equal(double(x), x * 2)
    assert counters["stats"]["unique_graphs"] == 1


def test_view_base_and_saved_by():
    x = torch.randn(4, 6, requires_grad=True)
    y = torch.nn.functional.gelu(x, approximate="tanh")
    v = y.view(2, 12)
    assert _compat.view_base(v) is y and _compat.view_base(y) is y
    node = y.grad_fn
    assert _compat.saved_by(node, "approximate") == "tanh" and torch.equal(_compat.saved_by(node, "self"), x)


@pytest.mark.parametrize("sees_output", [True, False], ids=["policy-sees-output", "torch-before-2.12"])
def test_selective_checkpoint_contexts_report_what_the_forward_cached(monkeypatch, sees_output):
    # torch 2.11 calls the policy before the op (no ctx.op_output): the tensors are read from the cache
    # as the forward's context exits instead; both ways report the same tensors, once, and no others
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint

    if sees_output and not _compat.SAC_POLICY_SEES_OUTPUT:
        pytest.skip("this torch does not hand the policy the op's output")
    monkeypatch.setattr(_compat, "SAC_POLICY_SEES_OUTPUT", sees_output)
    w1, w2 = torch.randn(6, 8, requires_grad=True), torch.randn(8, 6, requires_grad=True)
    outputs, cached = [], []

    def fn(x):
        h = x @ w1
        outputs.append(h)
        return torch.relu(h) @ w2

    def policy(ctx, op, *args, **kwargs):  # cache the first matmul's output only
        save = op is torch.ops.aten.mm.default and args[1] is w1
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    contexts = lambda: _compat.selective_checkpoint_contexts(policy, cached.append)  # noqa: E731
    x = torch.randn(4, 6, requires_grad=True)
    checkpoint(fn, x, use_reentrant=False, context_fn=contexts).sum().backward()
    assert len(cached) == 1 and torch.equal(cached[0], outputs[0])
    assert cached[0].untyped_storage().data_ptr() == outputs[0].untyped_storage().data_ptr()
    expected = torch.relu(x.detach() @ w1.detach()).sum(0)
    assert torch.allclose(w2.grad, expected[:, None].expand(8, 6))


def test_fake_tensor_mode_in_threads_one_after_another_after_the_package_is_imported():
    """torch 2.11's CUDA build without a GPU crashed (a segmentation fault) where ``FakeTensorMode`` was
    entered from a second thread after the first had ended, as a fit's first step does (the optimizer state
    to come) in fits run one after another in threads. Importing the package installs the device guard
    from the main thread first. In a subprocess: a crash there fails this test, not the suite. (On a CPU
    build of torch there is no guard to install, and it passes either way.)"""
    import subprocess
    import sys

    code = """
import threading, torch
import lightning_memopt
from lightning_memopt.memory.tracker import optimizer_state_to_come

def first_step():
    model = torch.nn.Linear(4, 3)
    assert optimizer_state_to_come([torch.optim.AdamW(model.parameters())]) == 128

for _ in range(3):
    thread = threading.Thread(target=first_step)
    thread.start()
    thread.join()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
    guard = _compat.install_device_guard()
    assert guard is (torch.version.cuda is not None and not torch.cuda.is_available())
