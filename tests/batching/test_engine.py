import inspect
import types

from lightning_memopt.batching.surface import LIGHTNING_SURFACE


class _Trainer(types.SimpleNamespace):
    """A stand-in Trainer; unlike SimpleNamespace, weakly referenceable (engines hold Trainers weakly)."""


def test_lightning_surface_the_engine_relies_on_exists():
    """Fails loudly if a Lightning upgrade renames or removes what batching/engine.py wraps."""
    for owner, name in LIGHTNING_SURFACE:
        # a class attribute, or an instance attribute its __init__ sets
        assert hasattr(owner, name) or f"self.{name} =" in inspect.getsource(owner.__init__), (
            f"{owner.__name__}.{name} is gone: update lightning_memopt/batching/surface.py"
        )
    from lightning.pytorch.trainer.connectors.logger_connector import _LoggerConnector

    assert "self.trainer.log_every_n_steps =" in inspect.getsource(_LoggerConnector.on_trainer_init)
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import Strategy
    from lightning.pytorch.trainer import call

    # the loops look the strategy's methods up by name on the instance, so instance attributes win
    assert "getattr(trainer.strategy, hook_name)" in inspect.getsource(call._call_strategy_hook)
    assert "getattr(pl_module, hook_name)" in inspect.getsource(call._call_lightning_module_hook)
    # zero_grad runs after training_step in the closure (why the engine zeroes first)
    closure = inspect.getsource(_AutomaticOptimization._make_zero_grad_fn)
    assert '"optimizer_zero_grad"' in inspect.getsource(_AutomaticOptimization._optimizer_zero_grad)
    assert "accumulate_grad_batches" in closure
    # Strategy.backward = strategy pre_backward + precision pre_backward/backward/post_backward
    backward = inspect.getsource(Strategy.backward)
    for call_name in ("self.pre_backward", "precision_plugin.pre_backward", "precision_plugin.post_backward"):
        assert call_name in backward
    assert "on_before_backward" in inspect.getsource(Precision.pre_backward)
    assert "on_after_backward" in inspect.getsource(Precision.post_backward)


def test_check_refuses_deepspeed_and_double_wrapping():
    import types

    import pytest
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_memopt.batching.engine import MicroBatchEngine
    from lightning_memopt.batching.sizes import MicroBatchSizes
    from lightning_memopt.batching.surface import check_setup

    class DeepSpeedStrategy:
        pass

    trainer = types.SimpleNamespace(strategy=DeepSpeedStrategy(), accumulate_grad_batches=1)
    module = types.SimpleNamespace(automatic_optimization=True)
    with pytest.raises(MisconfigurationException, match="DeepSpeed owns gradient accumulation"):
        check_setup(trainer, module)

    class Strategy:
        def training_step(self):
            pass

        backward = optimizer_step = validation_step = test_step = predict_step = training_step

    class Module:
        def optimizer_zero_grad(self):
            pass

    strategy = Strategy()
    strategy.training_step = lambda: None  # someone else replaced it on the instance already
    with pytest.raises(RuntimeError, match="strategy.training_step is already replaced"):
        MicroBatchEngine(MicroBatchSizes()).install(_Trainer(strategy=strategy, lightning_module=Module()))
    engine = MicroBatchEngine(MicroBatchSizes())
    trainer = _Trainer(strategy=Strategy(), lightning_module=Module())
    engine.install(trainer)
    with pytest.raises(RuntimeError, match="this MicroBatchEngine is installed already"):
        engine.install(_Trainer(strategy=Strategy(), lightning_module=Module()))
    engine.uninstall()
    assert vars(trainer.strategy) == {} and vars(trainer.lightning_module) == {}


def test_fsdp2_sync_points_come_before_every_fsdp_collective(monkeypatch):
    """The order the FSDP2 sync points rely on (torch 2.13): in one process (a 1-rank gloo group), every
    FSDP step that may communicate — forward all-gather, backward all-gather, reduce-scatter in the
    post-backward or in the final callback — comes right after one of the engine's sync points."""
    import os

    import pytest
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from lightning_memopt.batching.regime import PeerOutOfMemory, SyncInBackward, drop_attempt, find_sharding
    from tests.distributed import free_port

    log = []

    def record(cls, name, label):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            modules = getattr(self, "modules", None) or self._modules
            log.append(label if label == "final" else f"{label} {type(modules[0]).__name__}")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    record(FSDPParamGroup, "pre_forward", "all-gather")
    record(FSDPParamGroup, "pre_backward", "all-gather")
    record(FSDPParamGroup, "post_backward", "reduce-scatter")
    record(FSDPState, "_root_post_backward_final_callback", "final")
    monkeypatch.setitem(os.environ, "MASTER_ADDR", "127.0.0.1")
    monkeypatch.setitem(os.environ, "MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        first, last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        model = torch.nn.Sequential(first, torch.nn.ReLU(), last)
        for m in (first, last, model):  # the root has no parameters of its own: no sync points
            fully_shard(m)
        sharding = find_sharding(model)
        assert sharding.modules == [model, first, last] and sharding.owners == [first, last]
        sync = [lambda: log.append("sync")]
        x = torch.randn(3, 4)

        def step() -> list[torch.Tensor]:
            with sharding.armed(lambda: sync[0]()):
                loss = model(x).sum()
                (loss,) = SyncInBackward.apply(lambda: sync[0](), True, loss)  # as Sharded.wrap_loss does
                loss.backward()
            return [p.grad.full_tensor().clone() for p in model.parameters()]

        grads = step()
        # Another rank ran out of memory in the first layer's backward: this rank learns it at the last
        # sync point, queued ahead of FSDP's final callback; the error leaves backward, and after the
        # engine's recovery the next iteration computes the same gradients as before (dropping them after
        # FSDP's reset_iter_state instead would leave the first layer's doubled).
        order = list(log)
        calls = []

        def peer_failed_at_the_last_sync_point() -> None:
            calls.append(1)
            if len(calls) == order.count("sync"):
                raise PeerOutOfMemory

        sync[0] = peer_failed_at_the_last_sync_point
        with pytest.raises(PeerOutOfMemory):
            step()
        # the first layer computed its gradients and never reduce-scattered them: they sit on its
        # unsharded parameters, still registered on the module
        assert [p.grad is not None for p in first.parameters()] == [True, True]
        drop_attempt(model, sharding)  # the engine's recovery: drop gradients, then reset_iter_state
        sync[0] = lambda: None
        assert all(torch.equal(a, b) for a, b in zip(step(), grads))
    finally:
        dist.destroy_process_group()
    log = order
    assert log == [
        "sync",  # forward
        "all-gather FSDPLinear",
        "sync",
        "all-gather FSDPLinear",
        "sync",  # the loss, first node of the backward
        "sync",  # the last layer's output, before FSDP's pre-backward hook on it
        "all-gather FSDPLinear",
        "sync",  # the last layer's input, before FSDP's post-backward function
        "reduce-scatter FSDPLinear",
        "sync",  # the first layer's output
        "all-gather FSDPLinear",  # (prefetched by the last layer's: no collective left here)
        "sync",  # queued by the loss's sync point, ahead of FSDP's final callback
        "final",
        "reduce-scatter FSDPLinear",  # the first layer: its input needs no gradient
    ]
