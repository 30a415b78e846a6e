import inspect

from lightning_memopt.batching.engine import LIGHTNING_SURFACE


def test_lightning_surface_the_engine_relies_on_exists():
    """Fails loudly if a Lightning upgrade renames or removes what batching/engine.py wraps."""
    for owner, name in LIGHTNING_SURFACE:
        assert hasattr(owner, name), (
            f"{owner.__name__}.{name} is gone: update lightning_memopt/batching/engine.py"
        )
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

    class DeepSpeedStrategy:
        pass

    trainer = types.SimpleNamespace(strategy=DeepSpeedStrategy(), accumulate_grad_batches=1)
    module = types.SimpleNamespace(automatic_optimization=True)
    with pytest.raises(MisconfigurationException, match="DeepSpeed owns gradient accumulation"):
        MicroBatchEngine().check(trainer, module)

    class Strategy:
        def training_step(self):
            pass

        backward = optimizer_step = validation_step = test_step = predict_step = training_step

    strategy = Strategy()
    strategy.training_step = lambda: None  # someone else replaced it on the instance already
    with pytest.raises(RuntimeError, match="strategy.training_step is already replaced"):
        MicroBatchEngine().install(types.SimpleNamespace(strategy=strategy))
    engine = MicroBatchEngine()
    engine.install(types.SimpleNamespace(strategy=Strategy()))
    with pytest.raises(RuntimeError, match="a MicroBatchEngine serves one Trainer"):
        engine.install(types.SimpleNamespace(strategy=Strategy()))
