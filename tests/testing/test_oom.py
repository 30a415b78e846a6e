import json
import os

import pytest
import torch
import torch.optim.optimizer as torch_optimizer
from lightning.pytorch.utilities.memory import is_oom_error

from lightning_memopt.memory import MemoryTracker
from lightning_memopt.memory.device import is_out_of_memory
from lightning_memopt.testing import InjectedOOM, OOMInjector
from tests.distributed import run_ranks

F32 = 4


def _hooks_left(module, optimizer=None):
    n = len(module._forward_pre_hooks) + len(module._forward_hooks)
    if optimizer is not None:
        n += len(optimizer._optimizer_step_pre_hooks)
    return n + len(torch_optimizer._global_optimizer_pre_hooks)


def test_forward_size_cap_raises_above_only():
    model = torch.nn.Linear(4, 2)
    with OOMInjector(model, max_size=8) as injector:
        model(torch.ones(8, 4))
        model(torch.ones(1, 4))
        with pytest.raises(torch.OutOfMemoryError, match=r"micro-batch size 9 > max_size 8") as info:
            model(torch.ones(9, 4))
        assert injector.calls == 3
        assert injector.raised == 1
        assert injector.events == [InjectedOOM("forward", 9, None, None, 0)]
    # Every OOM detector takes it for a real one: ours and Lightning's (BatchSizeFinder uses it).
    assert is_out_of_memory(info.value)
    assert is_oom_error(info.value)
    assert str(info.value).startswith("CUDA out of memory. Tried to allocate")
    assert _hooks_left(model) == 0
    model(torch.ones(9, 4))  # removed: nothing raises


def test_forward_size_from_kwargs_and_eval_mode_skipped():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, *, x):
            return self.lin(x)

    net = Net()
    with OOMInjector(net, max_size=2) as injector:
        with pytest.raises(torch.OutOfMemoryError):
            net(x=torch.ones(3, 4))
        net.eval()
        net(x=torch.ones(3, 4))  # validation runs untouched
        assert injector.calls == 1
    with OOMInjector(net, max_size=2, training_only=False):
        with pytest.raises(torch.OutOfMemoryError):
            net(x=torch.ones(3, 4))


def test_forward_bytes_cap_reads_tracker_after_the_module_ran():
    model = torch.nn.Linear(4, 8)
    params = (4 * 8 + 8) * F32

    def live(n):  # parameters, the input and the output are alive right after the forward
        return params + n * 4 * F32 + n * 8 * F32

    with MemoryTracker(model) as tracker, OOMInjector(model, max_bytes=live(5), memory=tracker) as injector:
        out = model(torch.ones(5, 4))
        assert tracker.current == live(5)
        del out
        with pytest.raises(torch.OutOfMemoryError, match=rf"live bytes {live(6)} > max_bytes {live(5)}"):
            model(torch.ones(6, 4))
    assert injector.events == [InjectedOOM("forward", 6, live(6), None, 0)]


def test_backward_raises_in_backward_not_forward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    x = torch.randn(6, 4)
    model(x).sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with OOMInjector(model[0], phase="backward", max_size=5) as injector:
        small = model(x[:5])
        small.sum().backward()  # fits
        model.zero_grad()
        loss = model(x).sum()  # forward of 6 samples passes
        assert injector.calls == 1  # only the backward above was checked
        with pytest.raises(torch.OutOfMemoryError, match=r"in backward of Linear: micro-batch size 6"):
            loss.backward()
        assert injector.raised == 1
        assert all(p.grad is None for p in model[0].parameters())  # the error came before model[0]'s grads
        model.zero_grad()
        with torch.no_grad():
            model(x)  # no graph, nothing inserted
        model.eval()
        model(x).sum().backward()  # not training: nothing inserted
        model.train()
        assert injector.calls == 2
    # The identity inserted in the graph changes no gradient.
    model.zero_grad()
    with OOMInjector(model[0], phase="backward", max_size=100):
        model(x).sum().backward()
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), reference))
    assert _hooks_left(model[0]) == 0


def test_backward_with_tuple_output_and_memory_object():
    class Pair(torch.nn.Module):
        def forward(self, x):
            return {"a": x * 2, "b": (x.detach(), x * 3)}

    class Fake:
        value = 100

        def allocated(self):
            return self.value

    fake, pair = Fake(), Pair()
    x = torch.ones(2, 3, requires_grad=True)
    with OOMInjector(pair, phase="backward", max_bytes=150, memory=fake) as injector:
        out = pair(x)
        (out["a"].sum() + out["b"][1].sum()).backward()
        assert torch.equal(x.grad, torch.full((2, 3), 5.0))
        fake.value = 151
        out = pair(x)
        with pytest.raises(
            torch.OutOfMemoryError, match=r"Tried to allocate 1 B\..*live bytes 151 > max_bytes 150"
        ):
            out["a"].sum().backward()
    assert injector.events == [InjectedOOM("backward", 2, 151, None, 0)]


def test_step_on_given_optimizer_with_size_of_last_input():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with OOMInjector(model, phase="step", optimizer=opt, max_size=4) as injector:
        model(torch.ones(4, 4)).sum().backward()
        opt.step()
        model(torch.ones(5, 4)).sum().backward()
        before = model.weight.detach().clone()
        with pytest.raises(
            torch.OutOfMemoryError, match=r"in optimizer step: micro-batch size 5 > max_size 4"
        ):
            opt.step()
        assert torch.equal(model.weight, before)  # raised before the update
        other.step()  # another optimizer is not watched
        assert (injector.calls, injector.raised) == (2, 1)
    assert _hooks_left(model, opt) == 0


def test_step_without_optimizer_reaches_optimizers_created_later():
    model = torch.nn.Linear(2, 2)
    with OOMInjector(phase="step", times=2) as injector:
        opt = torch.optim.Adam(model.parameters())  # created after install, as Lightning does
        for _ in range(2):
            with pytest.raises(torch.OutOfMemoryError, match="unconditional"):
                opt.step()
        opt.step()  # times=2 reached
        assert (injector.calls, injector.raised) == (3, 2)
        injector.reset()
        with pytest.raises(torch.OutOfMemoryError):
            opt.step()
    assert _hooks_left(model, opt) == 0
    opt.step()


def test_steps_and_times_filters():
    model = torch.nn.Linear(2, 2)
    step = {"now": 0}
    with OOMInjector(model, steps={1, 3}, step_fn=lambda: step["now"], times=2) as injector:
        raised_at = []
        for now in range(5):
            step["now"] = now
            for _attempt in range(2):  # a retry of the same step
                try:
                    model(torch.ones(1, 2))
                except torch.OutOfMemoryError:
                    raised_at.append(now)
        assert raised_at == [1, 1]  # step 1 raised twice, then times=2 was used up: step 3 passes
        assert [e.step for e in injector.events] == [1, 1]
        assert injector.calls == 10


def test_ranks_filter_outside_distributed_is_rank_zero():
    model = torch.nn.Linear(2, 2)
    with OOMInjector(model, ranks=[1]) as injector:
        model(torch.ones(3, 2))
    assert (injector.calls, injector.raised) == (1, 0)
    with OOMInjector(model, ranks=[0]), pytest.raises(torch.OutOfMemoryError, match="GPU 0"):
        model(torch.ones(3, 2))


def _rank_worker(out_dir):
    rank = int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    model = torch.nn.Linear(2, 2)
    messages = []
    with OOMInjector(model, ranks={1}, max_size=2) as injector:
        for n in (2, 3):
            try:
                model(torch.ones(n, 2))
            except torch.OutOfMemoryError as error:
                messages.append(str(error))
    flag = torch.tensor([injector.raised])
    torch.distributed.all_reduce(flag)  # both ranks are alive and in step afterwards
    result = [rank, injector.raised, int(flag), ["GPU 1 " in m for m in messages]]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


@pytest.mark.timeout(120)
def test_ranks_filter_with_two_gloo_processes(tmp_path):
    run_ranks(f"{__name__}:_rank_worker", tmp_path, timeout=100)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results == [[0, 0, 1, []], [1, 1, 1, [True]]]


def test_removal_on_error_and_reinstall():
    model = torch.nn.Linear(2, 2)
    injector = OOMInjector(model, phase="backward", max_size=0)
    with pytest.raises(torch.OutOfMemoryError), injector:
        model(torch.ones(1, 2)).sum().backward()
    assert not injector.installed
    assert _hooks_left(model) == 0
    injector.install()
    assert injector.installed
    with pytest.raises(RuntimeError, match="already installed; call remove"):
        injector.install()
    injector.remove()
    injector.remove()  # harmless
    model(torch.ones(1, 2)).sum().backward()
    assert injector.raised == 1


def test_lightning_fit_sees_injected_step_oom():
    from lightning import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    model = BoringModel()
    trainer = Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with OOMInjector(phase="step", steps={2}, step_fn=lambda: trainer.global_step) as injector:
        with pytest.raises(torch.OutOfMemoryError):
            trainer.fit(model)
    assert trainer.global_step == 2
    assert [e.step for e in injector.events] == [2]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"phase": "middle"}, r"phase must be one of \('forward', 'backward', 'step'\), got 'middle'"),
        ({"module": "layer"}, "module must be a torch.nn.Module, got str"),
        ({"module": None}, r"phase='forward' needs the module to watch; pass module="),
        ({"module": None, "phase": "step", "max_size": 2}, "max_size needs a module"),
        ({"optimizer": object()}, "optimizer must be a torch.optim.Optimizer, got object"),
        ({"optimizer": "SGD"}, "optimizer is only used with phase='step', got phase='forward'"),
        ({"max_size": -1}, r"max_size must be an int >= 0 .*got -1"),
        ({"max_size": 2.5}, r"max_size must be an int >= 0 .*got 2.5"),
        ({"max_bytes": "lots", "memory": MemoryTracker()}, "max_bytes must be a byte size, got 'lots'"),
        ({"max_bytes": "1MiB"}, r"max_bytes needs somewhere to read live bytes from; pass memory="),
        ({"memory": 5}, "memory must be a MemoryTracker or have an allocated\\(\\) method, got int"),
        ({"steps": [1]}, "steps needs step_fn"),
        ({"times": 0}, r"times must be a positive int .*got 0"),
    ],
)
def test_bad_arguments(kwargs, match):
    kwargs = dict(kwargs)
    module = kwargs.pop("module", torch.nn.Linear(1, 1))
    if kwargs.get("optimizer") == "SGD":
        kwargs["optimizer"] = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        OOMInjector(module, **kwargs)


def test_the_pre_release_locations_are_gone():
    """No release ever had them (issue 20): the testing tools live in lightning_memopt.testing only."""
    import importlib

    import lightning_memopt.batching as batching

    assert not hasattr(batching, "OOMInjector") and not hasattr(batching, "InjectedOOM")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lightning_memopt.batching.inject")


def test_docs_recipe_oom_backoff_recovers_to_the_same_parameters():
    """The recipe on docs/testing.md: a "device" that fits 8 samples, batches of 32, OOMBackoff."""
    from torch.utils.data import DataLoader

    from lightning_memopt import OOMBackoff
    from tests.batching.helpers import Net, dataset, quiet_trainer

    def run(callbacks, injector_cap=None):
        model = Net()
        loader = DataLoader(dataset(64), batch_size=32)
        trainer = quiet_trainer(callbacks, max_steps=2)
        if injector_cap is None:
            trainer.fit(model, loader)
            return model, None
        with OOMInjector(model.net[-1], max_size=injector_cap) as injector:
            trainer.fit(model, loader)
        return model, injector

    backoff = OOMBackoff()
    recovered, injector = run([backoff], injector_cap=8)
    plain, _ = run([])
    assert injector.raised == 2  # 32 and 16 ran out of memory, 8 fits
    assert [e.size for e in injector.events] == [32, 16]
    assert backoff.micro_batch_size == 8
    for (name, a), b in zip(recovered.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=name)
