import gc
import io
import logging
import os
import warnings
import weakref

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import BatchNormToGroupNorm
from lightning_memopt.norm import SwappedGroupNorm, convert_batchnorm
from tests.distributed import run_ranks


def _net():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 36, 6),
        nn.BatchNorm1d(6),
        nn.ReLU(),
        nn.Linear(6, 2),
    )


class BNNet(L.LightningModule):
    """A tiny BatchNorm CNN on a task GroupNorm can learn: which half of the image is brighter."""

    def __init__(self, lr: float = 0.2, probe_shape: tuple = (2, 3, 6, 6)):
        super().__init__()
        torch.manual_seed(0)
        self.net = _net()
        self.example_input_array = torch.zeros(*probe_shape) if probe_shape else None
        self.lr = lr
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        y = torch.randint(0, 2, (32,), generator=g)
        sign = (2 * y - 1).float().view(32, 1, 1, 1)
        x = torch.randn(32, 3, 6, 6, generator=g)
        x[:, :, :3] += sign
        x[:, :, 3:] -= sign
        return DataLoader(TensorDataset(x, y), batch_size=8)


class LateNet(BNNet):
    """Builds its layers in configure_model, after callbacks' setup."""

    def __init__(self):
        super().__init__()
        self.net = None

    def configure_model(self):
        if self.net is None:
            torch.manual_seed(0)
            self.net = _net()


class NoBNNet(BNNet):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(108, 2))


class Splitter(Callback):
    """Stands in for AutoAccumulation / OOMBackoff: the duck-typed interface the swap looks for."""

    splits_batches = True

    def __init__(self, micro_batch_size=None):
        self.micro_batch_size = micro_batch_size


def _trainer(tmp_path, callbacks, **kwargs):
    kwargs = {"max_epochs": 1, **kwargs}
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _swapped(model):
    return {name: m.num_groups for name, m in model.named_modules() if isinstance(m, SwappedGroupNorm)}


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------------- fit


def test_fit_trains_groupnorm_and_optimizer_holds_its_parameters(tmp_path, caplog):
    model = BNNet()
    weight = model.net[1].weight
    callback = BatchNormToGroupNorm()
    trainer = _trainer(tmp_path, [callback], max_epochs=3)
    with caplog.at_level(logging.INFO):
        trainer.fit(model)
    assert _swapped(model) == {"net.1": 8, "net.5": 1}
    assert model.net[1].weight is weight  # the same Parameter, trained
    optimized = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    assert len(optimized) == len(list(model.parameters()))
    assert all(any(p is q for q in optimized) for p in model.parameters())
    assert any(p is model.net[1].weight for p in optimized)
    assert sum(model.losses[-4:]) < 0.2 * sum(model.losses[:4])  # loss falls (measured: 3.10 -> 0.15)
    assert "BatchNormToGroupNorm (when='always')" in caplog.text
    assert "'net.1': BatchNorm2d(8) -> GroupNorm(8, 8), input (2, 8, 6, 6)" in caplog.text
    assert "'net.5': BatchNorm1d(6) -> GroupNorm(1, 6), input (2, 6)" in caplog.text
    assert callback.state_dict() == {"groups": {"net.1": 8, "net.5": 1}, "decided": True}
    assert "on_load_checkpoint" not in model.__dict__  # the wrapper is gone after teardown


def test_resume_continues_exactly(tmp_path):
    straight = BNNet()
    _trainer(tmp_path, [BatchNormToGroupNorm()], max_epochs=2).fit(straight)

    first = BNNet()
    trainer = _trainer(tmp_path, [BatchNormToGroupNorm()], max_epochs=1)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    ckpt = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
    assert ckpt["callbacks"]["BatchNormToGroupNorm"] == {"groups": {"net.1": 8, "net.5": 1}, "decided": True}
    assert [k for k in ckpt["state_dict"] if k.startswith("net.1.")] == [
        "net.1.weight",
        "net.1.bias",
        "net.1.running_mean",
        "net.1.running_var",
        "net.1.num_batches_tracked",
    ]  # the BatchNorm's keys, unchanged by the swap

    resumed = BNNet()
    trainer = _trainer(tmp_path, [BatchNormToGroupNorm()], max_epochs=2)
    trainer.fit(resumed, ckpt_path=tmp_path / "epoch1.ckpt")
    assert resumed.losses == straight.losses[4:]
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


class Snapshot(Callback):
    def on_train_start(self, trainer, pl_module):
        self.state = _state(pl_module)


def test_pre_swap_batchnorm_checkpoint_loads(tmp_path):
    plain = BNNet()
    trainer = _trainer(tmp_path, [], max_epochs=1)
    trainer.fit(plain)
    trainer.save_checkpoint(tmp_path / "bn.ckpt")
    saved = torch.load(tmp_path / "bn.ckpt", weights_only=False)["state_dict"]
    assert "net.1.running_mean" in saved

    model, snapshot = BNNet(), Snapshot()
    _trainer(tmp_path, [BatchNormToGroupNorm(), snapshot], max_epochs=2).fit(
        model, ckpt_path=tmp_path / "bn.ckpt"
    )
    assert _swapped(model) == {"net.1": 8, "net.5": 1}
    # every key came from the BatchNorm checkpoint, the running statistics included (unused by GroupNorm)
    assert set(snapshot.state) == set(saved)
    assert all(torch.equal(v, saved[k]) for k, v in snapshot.state.items())
    assert len(model.losses) == 4 and all(torch.isfinite(torch.tensor(model.losses)))


def test_resume_swaps_like_the_checkpoint_even_when_the_new_run_would_not(tmp_path):
    model = BNNet()
    trainer = _trainer(tmp_path, [BatchNormToGroupNorm(when="micro_batching"), Splitter()])
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "swapped.ckpt")

    # No splitter now: on its own the callback would keep BatchNorm, and BatchNorm cannot load this checkpoint.
    resumed = BNNet()
    callback = BatchNormToGroupNorm(when="micro_batching")
    _trainer(tmp_path, [callback], max_epochs=2).fit(resumed, ckpt_path=tmp_path / "swapped.ckpt")
    assert _swapped(resumed) == {"net.1": 8, "net.5": 1}
    assert callback.state_dict() == {"groups": {"net.1": 8, "net.5": 1}, "decided": True}
    assert len(resumed.losses) == 4


def test_resume_keeps_batchnorm_when_the_checkpoint_did(tmp_path):
    model = BNNet()
    trainer = _trainer(tmp_path, [BatchNormToGroupNorm(when="micro_batching")])
    trainer.fit(model)
    assert _swapped(model) == {}
    trainer.save_checkpoint(tmp_path / "kept.ckpt")
    saved = torch.load(tmp_path / "kept.ckpt", weights_only=False)["state_dict"]

    resumed, snapshot = BNNet(), Snapshot()
    _trainer(tmp_path, [BatchNormToGroupNorm(), snapshot], max_epochs=2).fit(
        resumed, ckpt_path=tmp_path / "kept.ckpt"
    )
    assert _swapped(resumed) == {} and type(resumed.net[1]) is nn.BatchNorm2d
    assert set(snapshot.state) == set(saved) and torch.equal(
        snapshot.state["net.1.running_mean"], saved["net.1.running_mean"]
    )


def test_layers_built_in_configure_model_are_swapped(tmp_path):
    model = LateNet()
    trainer = _trainer(tmp_path, [BatchNormToGroupNorm()])
    trainer.fit(model)
    assert _swapped(model) == {"net.1": 8, "net.5": 1}
    assert any(p is model.net[1].weight for p in trainer.optimizers[0].param_groups[0]["params"])
    assert "configure_model" not in model.__dict__ and "on_load_checkpoint" not in model.__dict__


class FailingBNNet(BNNet):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("injected failure")
        return super().training_step(batch, batch_idx)


class FailingLateNet(LateNet):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("injected failure")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("fail", [False, True], ids=["finished", "raised"])
@pytest.mark.parametrize("late", [False, True], ids=["swap_in_setup", "swap_after_configure_model"])
def test_after_fit_nothing_stays_attached_or_holds_the_model(tmp_path, fail, late):
    """A fit that raised inside training_step used to leave an on_load_checkpoint wrapper on the model:
    torch.save(model) failed with "Can't pickle local object 'wrap_instance_hook.<locals>.wrapper'"."""
    model = (FailingLateNet if late else FailingBNNet)() if fail else (LateNet if late else BNNet)()
    callback = BatchNormToGroupNorm()
    trainer = _trainer(tmp_path, [callback], max_steps=3)
    if fail:
        with pytest.raises(RuntimeError, match="injected failure"):
            trainer.fit(model)
    else:
        trainer.fit(model)
    assert _swapped(model) == {"net.1": 8, "net.5": 1}  # the swap stays: it is the model now
    assert not {"configure_model", "on_load_checkpoint"} & set(vars(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert _swapped(torch.load(buffer, weights_only=False)) == {"net.1": 8, "net.5": 1}
    assert callback.report.module is None and len(callback.report.converted) == 2
    model_ref, trainer_ref = weakref.ref(model), weakref.ref(trainer)
    del model, trainer
    gc.collect()
    # The test still holds the callback: it keeps neither the model nor the Trainer alive.
    assert model_ref() is None and trainer_ref() is None


# ---------------------------------------------------------------------------------------- warnings


def test_warns_when_nothing_to_swap(tmp_path):
    with pytest.warns(
        UserWarning, match=r"BatchNormToGroupNorm found no BatchNorm layer to swap in NoBNNet\. Remove"
    ):
        _trainer(tmp_path, [BatchNormToGroupNorm()], max_steps=1).fit(NoBNNet())


def test_warns_about_frozen_only_model(tmp_path):
    model = BNNet()
    for bn in (model.net[1], model.net[5]):
        bn.requires_grad_(False)
    callback = BatchNormToGroupNorm()
    with pytest.warns(
        UserWarning, match=r"no BatchNorm layer to swap in BNNet; net.1 skipped: frozen: requires_grad=False"
    ):
        callback.setup(_trainer(tmp_path, [callback]), model, "fit")


def test_warns_that_sync_batchnorm_no_longer_applies(tmp_path):
    callback = BatchNormToGroupNorm()
    trainer = _trainer(tmp_path, [callback], strategy="ddp", sync_batchnorm=True)
    with pytest.warns(UserWarning, match=r"Trainer\(sync_batchnorm=True\) no longer applies"):
        callback.setup(trainer, BNNet(), "fit")


def test_warns_for_batchnorm1d_without_example_input(tmp_path):
    callback, model = BatchNormToGroupNorm(), BNNet(probe_shape=None)
    with pytest.warns(UserWarning, match=r"BatchNorm1d layer\(s\) 'net.5' became GroupNorm\(1, C\)"):
        callback.setup(_trainer(tmp_path, [callback]), model, "fit")
    assert callback.report.unprobed == ["'net.5'"]


def test_probe_false_skips_example_input(tmp_path):
    callback, model = BatchNormToGroupNorm(probe=False), BNNet()
    with pytest.warns(UserWarning, match="BatchNorm1d layer"):
        callback.setup(_trainer(tmp_path, [callback]), model, "fit")
    assert [layer.input_shape for layer in callback.report.converted] == [None, None]


def test_failed_probe_raises(tmp_path):
    callback, model = BatchNormToGroupNorm(), BNNet(probe_shape=(2, 5, 6, 6))
    with pytest.raises(
        MisconfigurationException,
        match=r"could not probe BatchNorm input shapes with BNNet.example_input_array.*probe=False",
    ):
        callback.setup(_trainer(tmp_path, [callback]), model, "fit")


class BatchNormReLU(nn.BatchNorm1d):
    def forward(self, x):
        return torch.relu(super().forward(x))


def test_unconvertible_layer_raises(tmp_path):
    callback, model = BatchNormToGroupNorm(), BNNet()
    model.net[5] = BatchNormReLU(6)
    with pytest.raises(
        MisconfigurationException,
        match=r"cannot swap the BatchNorm layers of BNNet: 'net.5' is a tests.callbacks.test_batchnorm_swap.BatchNormReLU, a BatchNorm subclass that overrides forward",
    ):
        callback.setup(_trainer(tmp_path, [callback]), model, "fit")


# ------------------------------------------------------------------------------------------- when


@pytest.mark.parametrize(
    ("kwargs", "splitters", "swapped"),
    [
        ({}, [], True),
        ({"when": "micro_batching"}, [], False),
        ({"when": "micro_batching"}, [Splitter(32)], True),
        ({"when": "micro_batching", "micro_batch_size_below": 16}, [Splitter(8)], True),
        ({"when": "micro_batching", "micro_batch_size_below": 16}, [Splitter(16)], False),
        ({"when": "micro_batching", "micro_batch_size_below": 16}, [Splitter(32), Splitter(4)], True),
        (
            {"when": "micro_batching", "micro_batch_size_below": 16},
            [Splitter(None)],
            True,
        ),  # unknown: could be small
    ],
)
def test_when(tmp_path, kwargs, splitters, swapped):
    callback, model = BatchNormToGroupNorm(**kwargs), BNNet()
    callback.setup(_trainer(tmp_path, [callback, *splitters]), model, "fit")
    assert _swapped(model) == ({"net.1": 8, "net.5": 1} if swapped else {})
    assert callback.state_dict() == {"groups": _swapped(model), "decided": True}


def test_splitting_is_detected_by_class_attribute_only(tmp_path):
    not_a_splitter = Callback()
    not_a_splitter.splits_batches = True  # an instance attribute does not count
    callback, model = BatchNormToGroupNorm(when="micro_batching"), BNNet()
    callback.setup(_trainer(tmp_path, [callback, not_a_splitter]), model, "fit")
    assert _swapped(model) == {}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_groups": 0}, "num_groups must be a positive int, got 0"),
        ({"group_size": 2.5}, "group_size must be a positive int, got 2.5"),
        ({"when": "sometimes"}, r"when must be one of \('always', 'micro_batching'\), got 'sometimes'"),
        (
            {"when": "micro_batching", "micro_batch_size_below": 0},
            "micro_batch_size_below must be a positive int, got 0",
        ),
        (
            {"when": "micro_batching", "micro_batch_size_below": "8"},
            "micro_batch_size_below must be a positive int, got '8'",
        ),
        (
            {"micro_batch_size_below": 8},
            r"micro_batch_size_below=8 only applies with when='micro_batching', got when='always'",
        ),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchNormToGroupNorm(**kwargs)


def test_num_groups_and_group_size_together_raise():
    """Both given used to let group_size win silently."""
    with pytest.raises(
        ValueError,
        match=r"pass num_groups or group_size, not both \(got num_groups=4, group_size=2\): num_groups caps",
    ):
        BatchNormToGroupNorm(num_groups=4, group_size=2)


@pytest.mark.parametrize("probe", ["no", 1, None])
def test_probe_must_be_a_bool(probe):
    """'no' is truthy: it used to probe silently."""
    with pytest.raises(
        TypeError, match=rf"probe must be True or False, got {probe!r}; pass a bool, e.g. probe=False"
    ):
        BatchNormToGroupNorm(probe=probe)


def test_group_size_that_does_not_divide_an_unprobed_layer_raises_in_setup(tmp_path):
    """group_size=3 on BatchNorm1d(16) without an example input used to become 1 group silently."""
    model = BNNet(probe_shape=None)
    model.net = nn.Sequential(nn.Flatten(), nn.Linear(108, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))
    callback = BatchNormToGroupNorm(group_size=3)
    with pytest.raises(
        MisconfigurationException,
        match=r"cannot swap the BatchNorm layers of BNNet: group_size=3 does not divide the 16 channels of "
        r"'net.2'; valid group sizes: \[1, 2, 4, 8, 16\]",
    ):
        callback.setup(_trainer(tmp_path, [callback]), model, "fit")
    assert _swapped(model) == {}


def test_group_size_is_passed_through(tmp_path):
    callback, model = BatchNormToGroupNorm(group_size=2), BNNet()
    callback.setup(_trainer(tmp_path, [callback]), model, "fit")
    assert _swapped(model) == {"net.1": 4, "net.5": 1}


# --------------------------------------------------------------------------------------------- CLI


def test_lightning_cli_yaml(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {tmp_path}
  callbacks:
    - class_path: lightning_memopt.BatchNormToGroupNorm
      init_args:
        num_groups: 4
"""
    )
    from lightning.pytorch.cli import (
        LightningCLI,  # imported here: the distributed workers need not import it
    )

    cli = LightningCLI(BNNet, args=["fit", "--config", str(config)], save_config_callback=None)
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, BatchNormToGroupNorm)]
    assert callback.num_groups == 4
    assert _swapped(cli.model) == {"net.1": 4, "net.5": 1}
    assert len(cli.model.losses) == 2


def test_lightning_cli_zero_arguments(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        BNNet,
        args=[
            "fit",
            "--trainer.callbacks=lightning_memopt.BatchNormToGroupNorm",
            "--trainer.max_steps=1",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        save_config_callback=None,
    )
    assert _swapped(cli.model) == {"net.1": 8, "net.5": 1}


# ----------------------------------------------------------------------------------------- distributed


def _ddp_worker(out_dir):
    rank = int(os.environ["RANK"])
    model = BNNet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=DDPStrategy(),
            sync_batchnorm=True,
            callbacks=[BatchNormToGroupNorm()],
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=out_dir,
        )
        trainer.fit(model)
    optimized = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    torch.save(
        {
            "swapped": _swapped(model),
            "params": [p.detach() for p in model.parameters()],
            "optimizer_holds_gn": any(p is model.net[1].weight for p in optimized),
            "warnings": [str(w.message) for w in caught if "sync_batchnorm" in str(w.message)],
            "losses": model.losses,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


@pytest.mark.timeout(200)
def test_ddp_two_processes(tmp_path):
    run_ranks(f"{__name__}:_ddp_worker", tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["swapped"] == r1["swapped"] == {"net.1": 8, "net.5": 1}
    assert r0["optimizer_holds_gn"] and r1["optimizer_holds_gn"]
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))  # DDP kept the ranks in step
    assert r0["losses"] != r1["losses"] and len(r0["losses"]) == 2  # each rank saw its own half of the data
    assert len(r0["warnings"]) == 1 and "Trainer(sync_batchnorm=True) no longer applies" in r0["warnings"][0]
    assert r1["warnings"] == []  # rank zero only


class ShardedNet(BNNet):
    """FSDP2 via ModelParallelStrategy: layers are built and sharded in configure_model."""

    def __init__(self, convert_first):
        super().__init__()
        self.net, self.convert_first = None, convert_first

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        if self.net is not None:
            return
        torch.manual_seed(0)
        self.net = _net()
        if self.convert_first:  # what the README advises: convert, then shard
            convert_batchnorm(self.net, example_input=torch.zeros(2, 3, 6, 6))
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def _fsdp2_worker(out_dir):
    rank = int(os.environ["RANK"])
    result = {}
    for convert_first in (True, False):
        model = ShardedNet(convert_first)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            callbacks=[BatchNormToGroupNorm()],
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=out_dir,
        )
        try:
            trainer.fit(model)
            result[convert_first] = {"swapped": _swapped(model), "losses": model.losses}
        except MisconfigurationException as err:
            result[convert_first] = {"error": str(err)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.timeout(200)
def test_fsdp2_convert_before_sharding(tmp_path):
    run_ranks(f"{__name__}:_fsdp2_worker", tmp_path)
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result[True]["swapped"] == {"net.1": 8, "net.5": 1} and len(result[True]["losses"]) == 2
        assert (
            "'net.1' has sharded (DTensor) parameters; convert BatchNorm layers before sharding"
            in (result[False]["error"])
        )
