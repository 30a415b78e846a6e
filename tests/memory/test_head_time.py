"""HeadTimer: a step's seconds and its output heads', on a fake clock that the model's ops advance."""

import time

import pytest
import torch

from lightning_memopt.head import linear_cross_entropy
from lightning_memopt.memory import tracker
from lightning_memopt.memory.head_time import HeadTimer
from tests.data.helpers import FakeClock


class Takes(torch.autograd.Function):
    """The identity, whose forward takes ``forward`` seconds of ``clock`` and backward ``backward``."""

    @staticmethod
    def forward(ctx, x, clock, forward, backward):
        clock.advance(forward)
        ctx.clock, ctx.backward = clock, backward
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.advance(ctx.backward)
        return grad, None, None, None


class Body(torch.nn.Module):
    def __init__(self, clock):
        super().__init__()
        self.clock, self.linear = clock, torch.nn.Linear(4, 4)

    def forward(self, x):  # 5 s forward, 4 s backward
        return Takes.apply(self.linear(x), self.clock, 5.0, 4.0)


class Head(torch.nn.Module):
    def __init__(self, clock, chunked=False):
        super().__init__()
        self.clock, self.linear, self.chunked = clock, torch.nn.Linear(4, 6), chunked

    def forward(self, x, labels):  # 3 s forward, 2 s backward, with the loss
        x = Takes.apply(x, self.clock, 3.0, 2.0)
        if self.chunked:  # opens the head a second time: counted once
            return linear_cross_entropy(x, self.linear.weight, labels, bias=self.linear.bias)
        return torch.nn.functional.cross_entropy(self.linear(x), labels)


def _timer(chunked=False):
    clock = FakeClock()
    body, head = Body(clock), Head(clock, chunked)
    timer = HeadTimer("cpu", [head], clock=clock)

    def micro_batch(grad=True):
        with torch.set_grad_enabled(grad):
            loss = head(body(torch.ones(2, 4)), torch.tensor([1, 5]))
        if grad:
            loss.backward()

    return clock, timer, head, micro_batch


@pytest.mark.parametrize("chunked", [False, True], ids=["own", "chunked"])
def test_a_step_and_its_heads_are_timed_head_by_head(chunked):
    clock, timer, head, micro_batch = _timer(chunked)
    timer.step_start()
    micro_batch()
    timer.step_end()
    timer.step_start()
    micro_batch()
    micro_batch()  # two micro-batches, two heads
    clock.advance(1.0)  # the optimizer
    timer.step_end()
    assert clock.settles == 0  # nothing waits for the device at a step's end
    # The head: its forward (3 s), the loss, its backward (2 s) up to its input's gradient; the body's 5 + 4
    # are outside it.
    assert timer.read() == [(14.0, 5.0), (29.0, 10.0)]
    assert clock.settles == 1 and timer.read() == []  # read once, together
    timer.stop()


def test_nothing_is_timed_outside_a_step_nor_without_a_backward():
    clock, timer, head, micro_batch = _timer()
    micro_batch()  # before any step: no hook yet
    assert head._forward_pre_hooks == {}
    timer.step_start()
    micro_batch(grad=False)  # validation-like: no backward closes the head
    timer.step_end()
    assert timer.read() == [(8.0, 0.0)]
    micro_batch()  # between steps: the hook is on, but no step is timed
    timer.step_start()
    micro_batch()
    timer.drop()  # a step skipped before its end
    with pytest.raises(RuntimeError, match="call step_start first"):
        timer.step_end()
    assert tracker.TIMING == []
    timer.stop()
    assert head._forward_pre_hooks == {} and tracker.TIMING == []
    timer.stop()  # safe twice


def test_a_loss_that_opens_the_head_itself_is_timed_without_head_modules():
    clock = FakeClock()
    body, linear = Body(clock), torch.nn.Linear(4, 6)
    timer = HeadTimer("cpu", clock=clock)  # no head modules

    def own_loss(x, labels):  # a loss of one's own that replaces the logits calls open_head
        tracker.open_head(x)
        x = Takes.apply(x, clock, 3.0, 2.0)
        return torch.nn.functional.cross_entropy(linear(x), labels)

    timer.step_start()
    own_loss(body(torch.ones(2, 4)), torch.tensor([1, 5])).backward()
    timer.step_end()
    assert timer.read() == [(14.0, 5.0)]
    timer.stop()


def test_a_head_whose_forward_failed_before_its_backward_gives_way_to_the_next():
    clock, timer, head, micro_batch = _timer()
    timer.step_start()
    loss = head(torch.nn.Linear(4, 4)(torch.ones(2, 4)), torch.tensor([1, 5]))  # its backward never runs
    timer.step_end()
    timer.step_start()
    loss = head(torch.nn.Linear(4, 4)(torch.ones(2, 4)), torch.tensor([1, 5]))  # open, never closed
    micro_batch()  # its forward is over: this head is a new one
    timer.step_end()
    assert timer.read() == [(3.0, 0.0), (3.0 + 14.0, 5.0)]
    assert loss.requires_grad
    timer.step_start()
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):  # predictions: not timed
        head(torch.ones(2, 4, requires_grad=True), torch.tensor([1, 5]))
    assert timer._open is None
    tracker.open_head(torch.ones(2, 4, requires_grad=True, device="meta"))
    assert timer._open is None
    head(torch.ones(2, 4, requires_grad=True), torch.tensor([1, 5]))
    assert timer._open is not None  # the same call on real tensors opens it
    timer.stop()


@pytest.mark.cuda
def test_on_cuda_the_head_is_timed_on_the_device_clock():
    """The head's forward keeps the device busy for a while the host does not wait: CUDA events see it."""
    cycles = 200_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    busy = start.elapsed_time(end) / 1000.0

    class SleepyHead(torch.nn.Linear):
        def forward(self, x):
            torch.cuda._sleep(cycles)
            return super().forward(x)

    body, head = torch.nn.Linear(4, 4).cuda(), SleepyHead(4, 6).cuda()
    # made before the clock starts: copying the targets from the host would wait for the sleeping head
    features, targets = torch.ones(2, 4, device="cuda"), torch.tensor([1, 5], device="cuda")
    # the libraries' first-call set-up (kernels loaded), the same calls as timed
    torch.nn.functional.cross_entropy(head(body(features)), targets).backward()
    torch.cuda.synchronize()
    timer = HeadTimer("cuda", [head])
    timer.step_start()
    host = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(head(body(features)), targets)
    loss.backward()
    host = time.perf_counter() - host
    timer.step_end()
    [(step, in_head)] = timer.read()
    timer.stop()
    assert 0.8 * busy <= in_head <= step
    assert host < 0.5 * busy  # the host did not wait: a host clock would have missed the head


def test_the_module_examples_run():
    import doctest

    from lightning_memopt.memory import head_time

    assert doctest.testmod(head_time, raise_on_error=True).attempted == 8
