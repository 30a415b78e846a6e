import pytest
import torch
from lightning.pytorch.utilities.memory import is_oom_error
from torch.utils.data import DataLoader

from lightning_memopt import OOMBackoff
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.memory.device import is_out_of_memory
from lightning_memopt.testing import InjectedOOM, MemoryCap
from tests.batching.helpers import Net, dataset, quiet_trainer

F32 = 4
PARAMS = (256 * 256 + 256) * F32  # Linear(256, 256)


def test_the_op_that_grows_past_the_capacity_raises_and_its_output_is_dropped():
    layer = torch.nn.Linear(256, 256)
    x = torch.ones(8, 256)  # outside: counted from its first use
    with MemoryCap(PARAMS + 3 * 8 * 256 * F32, modules=layer) as cap:
        assert cap.allocated() == PARAMS
        y = layer(x)  # x and y: 2 of the 3 rows of 8 samples the capacity leaves
        assert cap.allocated() == PARAMS + 2 * 8 * 256 * F32
        with pytest.raises(torch.OutOfMemoryError, match=r"MemoryCap in aten\.\w+.* \(forward\)") as info:
            layer(torch.ones(16, 256))  # torch.ones itself allocates past it
        assert cap.allocated() == PARAMS + 2 * 8 * 256 * F32  # the failed op's output is gone
        y2 = y * 2  # one more row fits exactly: equal to the capacity is not over it
        assert cap.allocated() == cap.capacity
    over = PARAMS + 2 * 8 * 256 * F32 + 16 * 256 * F32
    assert cap.raised == 1
    assert cap.events == [InjectedOOM("forward", None, over, None, 0)]
    assert cap.peak == over  # the failed op's output was live for a moment
    assert is_out_of_memory(info.value) and is_oom_error(info.value)
    assert f"of {8 * 256 * F32 // 1024 * 2}.00 KiB" not in str(info.value)
    assert "Tried to allocate 8.00 KiB" in str(info.value)  # the bytes over the capacity
    assert y2.shape == (8, 256)


def test_raises_inside_backward_when_gradients_do_not_fit():
    layer = torch.nn.Linear(256, 256)
    x = torch.ones(4, 256, requires_grad=True)
    with MemoryTracker(layer) as tracker:
        layer(x).sum().backward()
    after_forward_bytes = PARAMS + 2 * 4 * 256 * F32  # parameters, x, the output
    assert tracker.peak > after_forward_bytes + PARAMS  # backward needs the gradients on top
    layer.zero_grad(set_to_none=True)
    with MemoryCap(after_forward_bytes + 4 * 256 * F32, modules=layer) as cap:
        out = layer(x).sum()
        with pytest.raises(torch.OutOfMemoryError, match=r"\(backward\)"):
            out.backward()
    assert [e.phase for e in cap.events] == ["backward"]


def test_times_and_ranks_limit_what_raises():
    with MemoryCap(1024, times=1) as cap:
        with pytest.raises(torch.OutOfMemoryError):
            torch.ones(512)  # 2048 bytes
        big = torch.ones(512)  # the one error is spent
    assert (cap.raised, big.numel()) == (1, 512)
    with MemoryCap(1024, ranks={1}) as cap:
        torch.ones(512)  # rank 0 outside torch.distributed: not watched
    assert cap.raised == 0


def test_exit_removes_the_cap_and_entering_twice_is_refused():
    cap = MemoryCap(1024)
    with cap, pytest.raises(RuntimeError, match="already entered"):
        cap.__enter__()
    torch.ones(4096)  # after exit nothing raises
    assert cap.raised == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity": 0}, r"capacity"),
        ({"capacity": "lots"}, r"capacity.*'6GiB'"),
        ({"capacity": 1024, "times": 0}, r"times must be a positive int.*got 0"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryCap(**kwargs)


def test_oom_backoff_recovers_under_a_capped_device_to_the_same_parameters():
    """25 KiB: batches of 128 fail in forward, 64 in backward, 32 fit; the update is the batch's."""

    def run(callbacks, capacity=None):
        model = Net()
        loader = DataLoader(dataset(256), batch_size=128)
        trainer = quiet_trainer(callbacks, max_steps=2)
        if capacity is None:
            trainer.fit(model, loader)
            return model, None
        with MemoryCap(capacity, modules=model) as cap:
            trainer.fit(model, loader)
        return model, cap

    backoff = OOMBackoff()
    recovered, cap = run([backoff], "25KiB")
    plain, _ = run([])
    assert [e.phase for e in cap.events] == ["forward", "backward"]
    assert all(e.bytes > cap.capacity for e in cap.events)
    assert backoff.micro_batch_size == 32
    for (name, a), b in zip(recovered.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=name)


def test_testing_tools_are_plain_torch():
    import subprocess
    import sys

    code = (
        "import sys; import lightning_memopt.testing; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
