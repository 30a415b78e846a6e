"""BatchNormToGroupNorm and MemoryMonitor on third-party architectures (tests/zoo/models.py).

BatchNormToGroupNorm, on every zoo model with BatchNorm: every BatchNorm becomes a GroupNorm sharing its
Parameters, with the documented group count (the largest divisor of ``C`` not above 32, or 1 group for
a layer that sees no spatial extent, such as the 1x1 maps at the end of a CNN on 32x32 images); a fit of
2 SGD steps runs; the state_dict keeps every key (the swapped layers' running statistics stay as
unused buffers), in the same order, and still loads a state_dict saved before the swap. Without an example input the swap cannot see the 1x1 maps: a layer
left with one value per group refuses to run instead of outputting a constant.

MemoryMonitor, on every zoo model: a fit of 2 SGD steps logs exactly its documented keys, ends with the
parameters of the same fit without it (it only measures), and writes its report.
"""

from __future__ import annotations

import csv
import io
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_memopt import BatchNormToGroupNorm, MemoryMonitor
from lightning_memopt.head.causal_lm import output_heads
from lightning_memopt.memory import CATEGORIES
from lightning_memopt.memory.report import PHASES
from lightning_memopt.norm import SwappedGroupNorm
from tests.batching.helpers import quiet_trainer
from tests.zoo.models import ZOO, ZooModule, image_batch, loader

BATCHNORM_MODELS = [name for name, entry in ZOO.items() if entry.has_batchnorm]
RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")
MONITOR_KEYS = (
    {f"memory/{phase}_peak_gib" for phase in PHASES}
    | {"memory/peak_gib"}
    | {f"memory/peak_{category}_gib" for category in CATEGORIES}
)


class ProbedZooModule(ZooModule):
    """A ZooModule with ``example_input_array`` (and the ``forward`` it needs): the swap probes shapes."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.example_input_array = {"pixel_values": image_batch(2, seed=5)["pixel_values"]}

    def forward(self, pixel_values: torch.Tensor):
        return self.model(pixel_values=pixel_values)


def _trainer(tmp_path, callbacks, logger=False) -> pl.Trainer:
    return quiet_trainer(
        callbacks,
        max_steps=2,
        logger=CSVLogger(tmp_path, name="logs") if logger else False,
        default_root_dir=tmp_path,
    )


def _input_shapes(module: ZooModule) -> dict[str, tuple[int, ...]]:
    """Each BatchNorm's input shape, recorded here independently of the package's probe."""
    shapes: dict[str, tuple[int, ...]] = {}

    def record(layer: nn.Module, args: tuple) -> None:
        shapes.setdefault(names[layer], tuple(args[0].shape))

    names = {sub: name for name, sub in module.named_modules() if isinstance(sub, _BatchNorm)}
    handles = [layer.register_forward_pre_hook(record) for layer in names]
    module.eval()
    with torch.no_grad():
        module.model(pixel_values=image_batch(2, seed=5)["pixel_values"])
    module.train()
    for handle in handles:
        handle.remove()
    return shapes


def _expected_groups(shape: tuple[int, ...]) -> int:
    """The documented rule: 1 group without spatial extent, else the largest divisor of C not above 32."""
    channels, spatial = shape[1], torch.Size(shape[2:]).numel()
    return 1 if spatial == 1 else max(d for d in range(1, 33) if channels % d == 0)


@pytest.mark.parametrize("name", BATCHNORM_MODELS)
def test_batchnorm_to_groupnorm_converts_every_batchnorm(tmp_path, name):
    module = ProbedZooModule(name)
    batchnorms = {n: m for n, m in module.named_modules() if isinstance(m, _BatchNorm)}
    params = {n: (m.weight, m.bias) for n, m in batchnorms.items()}
    shapes = _input_shapes(module)
    assert len(batchnorms) > 10 and set(shapes) == set(batchnorms)  # every BatchNorm runs in forward
    assert not any(isinstance(m, nn.GroupNorm) for m in module.modules())
    keys_before = list(module.state_dict())
    pre_swap = {k: v.clone() for k, v in module.state_dict().items()}

    callback = BatchNormToGroupNorm()
    trainer = _trainer(tmp_path, [callback])
    trainer.fit(module, loader(name, batch_size=2, batches=2))
    assert trainer.global_step == 2

    # Every BatchNorm converted, one GroupNorm each, sharing the BatchNorm's Parameter objects.
    assert not any(isinstance(m, _BatchNorm) for m in module.modules())
    swapped = {n: m for n, m in module.named_modules() if isinstance(m, nn.GroupNorm)}
    assert set(swapped) == set(batchnorms) and len(swapped) == len(batchnorms)
    assert all(type(m) is SwappedGroupNorm for m in swapped.values())
    assert all(swapped[n].weight is w and swapped[n].bias is b for n, (w, b) in params.items())
    # Group counts as documented, counts that 32 does not divide included; no group of a single value.
    assert {n: m.num_groups for n, m in swapped.items()} == {
        n: _expected_groups(s) for n, s in shapes.items()
    }
    assert any(shape[1] % 32 for shape in shapes.values())
    assert all(
        shape[1] // swapped[n].num_groups * torch.Size(shape[2:]).numel() >= 2 for n, shape in shapes.items()
    )
    # Trained: the shared weights moved.
    assert any(not torch.equal(w, pre_swap[f"{n}.weight"]) for n, (w, _) in params.items())

    # state_dict: the swap changes no key (the statistics stay as unused buffers), in the same order.
    assert {f"{n}.{stat}" for n in batchnorms for stat in RUNNING_STATS} <= set(keys_before)
    assert list(module.state_dict()) == keys_before
    assert str(module.load_state_dict(pre_swap)) == "<All keys matched successfully>"  # a pre-swap checkpoint
    torch.save(module, io.BytesIO())  # nothing of the callback stays attached
    odd = sorted({(s[1], swapped[n].num_groups) for n, s in shapes.items() if s[1] % 32})
    print(
        f"\n{name}: {len(batchnorms)} BatchNorm -> {len(swapped)} GroupNorm; C -> groups where 32 does not divide C: {odd}"
    )


def test_batchnorm_to_groupnorm_without_example_input_refuses_a_layer_it_would_erase(tmp_path):
    """resnet_bottleneck's BatchNorm2d(32) sees 1x1 maps: without the input shape it gets 32 groups of one
    value each, which would output its bias whatever the input. The first forward says so."""
    module = ZooModule("resnet_bottleneck")
    with pytest.raises(
        ValueError,
        match=r"'model.resnet.encoder.stages.3.layers.0.layer.1.normalization': GroupNorm\(32, 32\) swapped for a "
        r"BatchNorm got input of shape \(2, 32, 1, 1\): each group holds a single value per sample.*set "
        r"example_input_array on the LightningModule",
    ):
        _trainer(tmp_path, [BatchNormToGroupNorm()]).fit(module, loader("resnet_bottleneck", batch_size=2))


@pytest.mark.parametrize("name", list(ZOO))
def test_memory_monitor_logs_its_keys_and_changes_no_parameter(tmp_path, name):
    runs = {}
    for monitored in (False, True):
        pl.seed_everything(0, verbose=False)
        module = ZooModule(name)
        monitor = MemoryMonitor(log_every_n_steps=1) if monitored else None
        trainer = _trainer(tmp_path / str(monitored), [monitor] if monitored else [], logger=monitored)
        pl.seed_everything(1, verbose=False)  # the same dropout masks in both runs
        trainer.fit(module, loader(name, batch_size=2, batches=2))
        runs[monitored] = (module, trainer, monitor)

    (plain, _, _), (measured, trainer, monitor) = runs[False], runs[True]
    worst = max(
        ((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item()
        for p, q in zip(measured.parameters(), plain.parameters(), strict=True)
    )
    assert worst <= 1e-6, f"{name}: parameters differ by {worst:.2e} (relative) with MemoryMonitor"
    peak = max(monitor.history[1][phase] for phase in PHASES)
    print(f"\n{name}: MemoryMonitor: parameters differ by {worst:.1e} (relative); step 2 peak {peak} B")

    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2]
    heads = output_heads(measured)  # a causal LM's output embeddings: its own line, and its time
    head_keys = {"memory/peak_head_gib", "memory/step_seconds", "memory/head_seconds"}
    assert set(rows[0]) == MONITOR_KEYS | {"step"} | (head_keys if heads else set())
    assert all(float(r["memory/peak_gib"]) > 0 for r in rows)
    if heads:
        assert all(float(r["memory/peak_head_gib"]) > 0 for r in rows)
        assert all(0 < float(r["memory/head_seconds"]) < float(r["memory/step_seconds"]) for r in rows)
    assert len(monitor.history) == 2
    report = monitor.report_paths[0]
    assert report == tmp_path / "True" / "logs" / "version_0" / "memory_report.md"
    assert "## forward" in report.read_text()
