"""The overlapped offload (checkpointing/offload.py) on CPU tensors playing the device's, against a faked
torch.cuda; and, marked ``cuda``, on a real device."""

import copy
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_memopt.checkpointing import (
    CostModel,
    apply_checkpointing,
    observe_saved,
    offload,
    remove_checkpointing,
)
from lightning_memopt.checkpointing.offload import Offloader, OffloadHooks, offloader_for
from tests.checkpointing.models import TinyGPT
from tests.memory.fake_cuda import CopyLog, install

N = 10  # rows of the input of `mlp()`
X_BYTES = N * 4 * 8  # its input, float64
H_BYTES = N * 64 * 8  # the tanh output, saved by tanh and again by the second linear: moved once


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 4)).double()


@pytest.fixture
def fake(monkeypatch):
    fake = install(monkeypatch)
    monkeypatch.setattr(offload, "OFFLOAD_DEVICE_TYPES", ("cpu",))
    yield fake
    offload.release_offloaders()


def step(model, x, hooks):
    with hooks:
        out = model(x)
    out.pow(2).sum().backward()


def test_parameters_after_a_step_equal_those_without_offload(fake):
    torch.manual_seed(0)
    ref = TinyGPT(n_layer=3, h=16).double()
    model = copy.deepcopy(ref)
    offloader = offloader_for("cpu", min_bytes=0)
    apply_checkpointing(model, {"h.0": "offload", "h.1": "offload", "h.2": "offload"})
    idx = torch.randint(0, 32, (2, 8))
    for m in (ref, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten()).backward()
            opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    assert offloader.offloaded_bytes > 0 and fake.pinned  # the overlapped path ran, not the plain copy
    remove_checkpointing(model)


def test_copies_go_out_on_one_side_stream_and_come_back_on_another(fake):
    model, x = mlp(), torch.randn(N, 4, dtype=torch.float64)
    offloader = Offloader("cpu", min_bytes=0)
    to_host, to_device = offloader.to_host.name, offloader.to_device.name
    with CopyLog(fake):
        step(model, x, OffloadHooks(offloader, model))
    # forward: per saved tensor, wait for compute, copy on the side stream, record its event
    forward = [(e[0], e[-1] if e[0] == "record" else e[1]) for e in fake.log[:6]]
    assert forward == [("wait_stream", to_host), ("copy", to_host), ("record", to_host)] * 2
    assert [e[2] for e in fake.log[:6] if e[0] == "copy"] == [X_BYTES, H_BYTES]
    backward = fake.log[6:]
    # backward: the first unpack waits for the two copies in flight, then both come back behind one event
    assert [e[0] for e in backward[:2]] == ["synchronize"] * 2
    assert backward[2] == ("wait_stream", to_device, "compute")
    copies_back = [e for e in backward if e[0] == "copy"]
    assert sorted(copies_back) == [("copy", to_device, n) for n in (X_BYTES, H_BYTES)]
    (arrived,) = [e[1] for e in backward if e[0] == "record"]
    assert backward.index(("record", arrived, to_device)) < backward.index(("wait_event", "compute", arrived))
    assert len([e for e in backward if e == ("wait_event", "compute", arrived)]) == 3  # one per unpack


def test_threshold_and_parameters_decide_what_moves(fake):
    model, x = mlp(), torch.randn(N, 4, dtype=torch.float64)
    everything = Offloader("cpu", min_bytes=0)
    step(model, x, OffloadHooks(everything, model))
    assert everything.offloaded_bytes == X_BYTES + H_BYTES  # weights (and weight.t()) stay
    large = Offloader("cpu", min_bytes=X_BYTES + 1)
    step(model, x, OffloadHooks(large, model))
    assert large.offloaded_bytes == H_BYTES
    assert Offloader("cpu", min_bytes="1MiB").min_bytes == 2**20
    # mul saves its mask for the gradient of the linear's output; the linear saves x
    mask = torch.ones(1, 64, dtype=torch.float64).expand(N, 64)
    for m, moved in ((mask, X_BYTES), (mask.contiguous(), X_BYTES + H_BYTES)):
        offloader = Offloader("cpu", min_bytes=0)
        with OffloadHooks(offloader):
            (model[0](x) * m).sum().backward()
        assert offloader.offloaded_bytes == moved  # the expanded mask (512 bytes) would come back as 5120


def test_in_flight_bytes_are_bounded(fake):
    model, x = mlp(), torch.randn(N, 4, dtype=torch.float64)
    offloader = Offloader("cpu", min_bytes=0, max_in_flight=H_BYTES)
    seen = []
    pack = offloader.pack
    offloader.pack = lambda t, g: (pack(t, g), seen.append(offloader.in_flight_bytes))[0]
    step(model, x, OffloadHooks(offloader, model))
    # x (320 B) + tanh output (5120 B) is over the bound: the forward waits for x's copy; the tanh output's
    # second save moves nothing
    assert seen == [X_BYTES, H_BYTES, H_BYTES]
    assert offloader.waits == 1 and offloader.in_flight_bytes == 0


def test_finished_copies_leave_the_queue_without_waiting(fake):
    fake.complete_on_record = True
    model, x = mlp(), torch.randn(N, 4, dtype=torch.float64)
    offloader = Offloader("cpu", min_bytes=0, max_in_flight=1)
    step(model, x, OffloadHooks(offloader, model))
    assert offloader.waits == 0 and fake.entries("synchronize") == []


def test_device_tensors_are_freed_once_copied(fake):
    model, x = mlp(), torch.randn(N, 4, dtype=torch.float64)
    offloader = Offloader("cpu", min_bytes=0)
    refs = []
    pack = offloader.pack
    offloader.pack = lambda t, g: (refs.append(weakref.ref(t)), pack(t, g))[1]
    with OffloadHooks(offloader, model):
        out = model(x)
    # copies still in flight keep the tanh output alive (x is the test's own)
    assert [r() is not None for r in refs] == [True, True, True]
    offloader._retire(bound=-1)
    assert [r() is not None for r in refs] == [True, False, False]
    out.sum().backward()


def test_pool_reuses_pinned_buffers_across_steps(fake):
    model, x = mlp(), torch.randn(N, 4, dtype=torch.float64)
    offloader = Offloader("cpu", min_bytes=0)
    step(model, x, OffloadHooks(offloader, model))
    assert sorted(fake.pinned) == [X_BYTES, H_BYTES]
    assert offloader.pool.pinned_bytes == offloader.pool.free_bytes == X_BYTES + H_BYTES
    last_reads = {e[1] for e in fake.entries("record") if e[2] == offloader.to_device.name}
    fake.log.clear()
    step(model, x, OffloadHooks(offloader, model))
    assert len(fake.pinned) == 2 and offloader.pool.allocations == 2  # nothing new pinned
    # a reused buffer is written only after the copy back out of it is done
    waits = {e[2] for e in fake.entries("wait_event") if e[1] == offloader.to_host.name}
    assert waits == last_reads
    offloader.release()
    assert offloader.pool.pinned_bytes == 0 and offloader.pool.free_bytes == 0


def test_backward_prefetches_the_block_before(fake):
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)).double()
    offloader = Offloader("cpu", min_bytes=0)
    x = torch.randn(N, 4, dtype=torch.float64, requires_grad=True)
    h = x
    for block in blocks:
        with OffloadHooks(offloader, block):
            h = block(h)
    fake.log.clear()
    with CopyLog(fake):
        h.sum().backward()
    to_device = offloader.to_device.name
    events = [e for e in fake.log if e[0] in ("copy", "record") and e[1:2] != ("compute",)]
    back = [e for e in events if to_device in e]
    # block 3 starts: blocks 3 and 2 come back (2 tensors each: linear input, tanh output); block 2
    # starts: block 1 comes back; block 1 starts: nothing left to bring
    assert [e[0] for e in back] == ["copy"] * 4 + ["record"] + ["copy"] * 2 + ["record"]
    first, second = back[4][1], back[7][1]
    waits = [e[2] for e in fake.log if e[0] == "wait_event" and e[1] == "compute"]
    assert waits == [first] * 4 + [second] * 2
    # block 1's copies were queued before the compute stream waited for anything of block 2
    assert (
        fake.log.index(back[7])
        < [i for i, e in enumerate(fake.log) if e == ("wait_event", "compute", first)][2]
    )


def test_retained_graph_brings_tensors_back_again(fake):
    model, x = mlp(), torch.randn(N, 4, dtype=torch.float64)
    with OffloadHooks(Offloader("cpu", min_bytes=0), model):
        loss = model(x).sum()
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_with_full_checkpointing_only_the_inputs_move(fake):
    model, x = mlp(), torch.randn(N, 4, dtype=torch.float64, requires_grad=True)
    ref = copy.deepcopy(model)
    offloader = Offloader("cpu", min_bytes=0)
    with OffloadHooks(offloader, model):
        out = checkpoint(model, x, use_reentrant=False)
    out.pow(2).sum().backward()
    assert offloader.offloaded_bytes == X_BYTES
    ref(x.detach()).pow(2).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))


def test_apply_reports_the_pinned_copies_to_observers(fake):
    model, x = mlp(), torch.randn(N, 4, dtype=torch.float64)
    offloader = offloader_for("cpu", min_bytes=0)
    wrapper = nn.Sequential(model)
    apply_checkpointing(wrapper, {"0": "offload"})
    seen = []
    with observe_saved(lambda kind, t: seen.append((kind, t.untyped_storage().nbytes()))):
        wrapper(x).sum().backward()
    assert sorted(seen) == [("offloaded", X_BYTES), ("offloaded", H_BYTES)]
    assert offloader.offloaded_bytes == X_BYTES + H_BYTES
    remove_checkpointing(wrapper)


def test_off_the_offload_devices_apply_keeps_the_plain_copy(fake, monkeypatch):
    monkeypatch.setattr(offload, "OFFLOAD_DEVICE_TYPES", ("cuda",))
    wrapper = nn.Sequential(mlp())
    apply_checkpointing(wrapper, {"0": "offload"})
    wrapper(torch.randn(N, 4, dtype=torch.float64)).sum().backward()
    assert fake.pinned == [] and offload._OFFLOADERS == {}


def test_measured_cost_model(fake, monkeypatch):
    from lightning_memopt.checkpointing import planner

    calls = []
    monkeypatch.setattr(planner, "_MEASURED", {})
    monkeypatch.setattr(planner, "measure_transfer_rate", lambda d: calls.append(d) or 2e10)
    monkeypatch.setattr(planner, "measure_matmul_rate", lambda d: 4e14)
    base = CostModel(pointwise_flops_per_byte=7.0)
    assert planner.measured_cost_model("cpu", base) is base  # offload stays out of CPU plans
    for _ in range(2):
        model = planner.measured_cost_model("cuda:0", base)
        assert model == CostModel(pointwise_flops_per_byte=7.0, offload_flops_per_byte=4e14 / 2e10)
    assert planner.measured_cost_model("cuda", base) == model  # "cuda" is cuda:0 here
    assert calls == [torch.device("cuda:0")]  # timed once per device


def test_bad_options():
    with pytest.raises(ValueError, match="min_bytes"):
        Offloader("cpu", min_bytes=-1)
    with pytest.raises(ValueError, match="max_in_flight"):
        Offloader("cpu", max_in_flight="lots")
    with pytest.raises(ValueError, match="bytes_per_second must be a positive measured rate, got 0"):
        CostModel().with_transfer_rate(0, flops_per_second=1e12)
    with pytest.raises(ValueError, match="flops_per_second must be a positive measured rate, got -1"):
        CostModel().with_transfer_rate(1e9, flops_per_second=-1)


@pytest.mark.cuda
def test_real_device_offload_is_exact_and_frees_device_memory():
    torch.manual_seed(0)
    ref = TinyGPT(n_layer=4, h=256, vocab=64).cuda()
    model = copy.deepcopy(ref)
    idx = torch.randint(0, 64, (8, 512), device="cuda")
    offloader = offloader_for("cuda", min_bytes=2**16)
    try:
        apply_checkpointing(model, {f"h.{i}": "offload" for i in range(4)})
        held = {}
        for name, m in (("keep", ref), ("offload", model)):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            loss = m(idx).float().logsumexp(-1).mean()
            offloader._retire(bound=-1)
            held[name] = torch.cuda.memory_allocated() - before
            loss.backward()
        assert held["keep"] - held["offload"] >= 0.9 * offloader.offloaded_bytes
        for p, q in zip(model.parameters(), ref.parameters()):
            # the copies are exact; the tolerance is for CUDA's non-deterministic embedding backward
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)
    finally:
        remove_checkpointing(model)
        offload.release_offloaders()


def test_offloading_around_fully_checkpointed_blocks_moves_their_inputs(fake):
    torch.manual_seed(0)
    ref = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3))).double()
    model = copy.deepcopy(ref)
    apply_checkpointing(model, {"0": "full", "1": "full", "2": "full"})
    offloader = Offloader("cpu", min_bytes=0)
    x = torch.randn(N, 4, dtype=torch.float64, requires_grad=True)
    with offload.offloading(list(model), offloader):
        out = model(x)
    assert offloader.offloaded_bytes == 3 * X_BYTES  # each block's input, nothing else
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model)
    out.pow(2).sum().backward()
    ref(x.detach()).pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    remove_checkpointing(model)


def test_a_tensor_saved_twice_moves_once_and_comes_back_once(fake):
    model, x = mlp(), torch.randn(N, 4, dtype=torch.float64)
    offloader = Offloader("cpu", min_bytes=0)
    handles = []
    hooks = OffloadHooks(offloader, model)
    pack, unpack, unpacked = hooks.pack_hook, hooks.unpack_hook, []
    hooks.pack_hook = lambda t: (lambda h: (handles.append(h), h)[1])(pack(t))
    hooks.unpack_hook = lambda h: (lambda t: (unpacked.append((h, t)), t)[1])(unpack(h))
    with hooks:
        out = model(x)
    x_saved, tanh_saved, again = [h for h in handles if isinstance(h, offload._Saved)]
    assert again is tanh_saved and tanh_saved.uses == 2 and x_saved.uses == 1
    out.sum().backward()
    tanh_back = [t for h, t in unpacked if h is tanh_saved]
    assert len(tanh_back) == 2 and tanh_back[0] is tanh_back[1]  # one device copy serves both uses
    assert tanh_saved.on_device is None and tanh_saved.pending == 2  # released, ready for a retained graph


class _SoftmaxThenView(nn.Module):
    """Attention's pattern: softmax saves its (B, h, T, T) output, and the matmul that follows saves a
    (B * h, T, T) view of it: two saved tensors, one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(3, 2, 6, 5, dtype=torch.float64).flatten(0, 1))

    def forward(self, scores):
        weights = scores.softmax(-1)  # (3, 2, 6, 6)
        return torch.bmm(weights.view(6, 6, 6), self.v)


def test_two_views_of_one_storage_move_once_and_come_back_as_both(fake):
    """Attention weights saved as (B, h, T, T) by softmax and as (B * h, T, T) by the matmul were copied to
    the host twice (on an H100 a 4-block GPT offloaded 403.7 MB and freed 337.6 MB): now the storage moves
    once, the view comes back as a view of it, and the gradients are those without offload."""
    model = _SoftmaxThenView()
    scores = torch.randn(3, 2, 6, 6, dtype=torch.float64, requires_grad=True)
    offloader = Offloader("cpu", min_bytes=0)
    hooks = OffloadHooks(offloader, model)
    pack, unpack, handles, unpacked = hooks.pack_hook, hooks.unpack_hook, [], []
    hooks.pack_hook = lambda t: (lambda h: (handles.append(h), h)[1])(pack(t))
    hooks.unpack_hook = lambda h: (lambda t: (unpacked.append((h, t)), t)[1])(unpack(h))
    with hooks:
        out = model(scores)
    assert offloader.offloaded_bytes == 3 * 2 * 6 * 6 * 8  # the weights' storage, once
    (saved,) = [h for h in handles if isinstance(h, offload._Saved)]
    (view,) = [h for h in handles if isinstance(h, offload._View)]
    assert view.base is saved and saved.uses == 2 and tuple(view.shape) == (6, 6, 6)
    grad = torch.autograd.grad(out.pow(2).sum(), (scores, model.v))
    want = torch.autograd.grad(_SoftmaxThenView.forward(model, scores).pow(2).sum(), (scores, model.v))
    for a, b in zip(grad, want, strict=True):
        assert torch.equal(a, b)
    back = {type(h).__name__: t for h, t in unpacked}
    assert back["_View"].shape == (6, 6, 6) and back["_Saved"].shape == (3, 2, 6, 6)
    assert back["_View"].untyped_storage().data_ptr() == back["_Saved"].untyped_storage().data_ptr()
