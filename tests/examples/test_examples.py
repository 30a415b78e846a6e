"""The examples and their YAML configs: each config parses, instantiates the callbacks with the YAML's
values, and runs ``fit`` for a few steps of a tiny model; the data and the baseline measurement are exact."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch.callbacks import Callback

import lightning_memopt
from lightning_memopt import (
    AutoAccumulation,
    AutoCheckpoint,
    BatchNormToGroupNorm,
    MemoryMonitor,
    OOMBackoff,
)
from lightning_memopt.memory import parse_bytes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _load(name: str, path: Path):
    """Import an example script under a unique module name (both examples have a ``train.py``)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpt_train():
    return _load("gpt_train", EXAMPLES / "gpt" / "train.py")


@pytest.fixture(scope="module")
def resnet_train():
    return _load("resnet_train", EXAMPLES / "resnet" / "train.py")


def _quiet(tmp_path: Path, steps: int = 3) -> list[str]:
    return [
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.max_steps={steps}",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
    ]


TINY_GPT = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.n_embd=32",
    "--data.block_size=32",
    "--data.batch_size=4",
    "--data.max_bytes=100000",
    "--data.samples_per_epoch=64",
    "--data.val_samples=8",
]
TINY_RESNET = [
    "--model.widths=[4, 8]",
    "--model.blocks_per_stage=1",
    "--data.batch_size=8",
    "--data.image_size=16",
    "--data.train_samples=64",
    "--data.val_samples=16",
]


def _callbacks(cli, kind):
    return [c for c in cli.trainer.callbacks if isinstance(c, kind)]


def _yaml_callbacks(path: Path) -> dict[str, dict]:
    """``class_path`` -> ``init_args`` of every callback a config lists."""
    config = yaml.safe_load(path.read_text())
    return {c["class_path"]: c.get("init_args", {}) for c in config["trainer"].get("callbacks", [])}


# ------------------------------------------------------------------------------------- parsing only
def test_gpt_baseline_config_has_no_package_callbacks(gpt_train):
    cli = gpt_train.main(["--config", str(EXAMPLES / "gpt" / "baseline.yaml")], run=False)
    assert not [c for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_memopt")]
    assert cli.model.hparams.n_layer == 4 and cli.model.hparams.block_size == 128
    assert cli.datamodule.hparams.batch_size == 16
    assert cli.trainer.max_steps == 200
    assert cli.trainer.precision == "32-true"  # train.py's default on a machine without CUDA


def test_gpt_memopt_config_instantiates_callbacks_with_yaml_values(gpt_train):
    path = EXAMPLES / "gpt" / "memopt.yaml"
    cli = gpt_train.main(["--config", str(path)], run=False)
    listed = _yaml_callbacks(path)
    assert list(listed) == [
        "lightning_memopt.AutoCheckpoint",
        "lightning_memopt.AutoAccumulation",
        "lightning_memopt.OOMBackoff",
        "lightning_memopt.MemoryMonitor",
    ]
    (checkpoint,) = _callbacks(cli, AutoCheckpoint)
    (accumulation,) = _callbacks(cli, AutoAccumulation)
    (backoff,) = _callbacks(cli, OOMBackoff)
    (monitor,) = _callbacks(cli, MemoryMonitor)
    # Byte strings from the YAML arrive as bytes.
    assert listed["lightning_memopt.AutoCheckpoint"]["max_memory"] == "40MiB"
    assert parse_bytes(checkpoint.max_memory) == 40 * 2**20  # AutoCheckpoint parses it when it plans
    assert checkpoint.headroom == listed["lightning_memopt.AutoCheckpoint"]["headroom"] == 0.0
    assert (
        accumulation.micro_batch_size == listed["lightning_memopt.AutoAccumulation"]["micro_batch_size"] == 8
    )
    assert backoff.grow_after is None
    assert monitor.log_every_n_steps == listed["lightning_memopt.MemoryMonitor"]["log_every_n_steps"] == 10
    # Same job as baseline.yaml except for the callbacks.
    baseline = yaml.safe_load((EXAMPLES / "gpt" / "baseline.yaml").read_text())
    memopt = yaml.safe_load(path.read_text())
    assert memopt["model"] == baseline["model"] and memopt["data"] == baseline["data"]
    memopt["trainer"].pop("callbacks")
    memopt["trainer"].pop("default_root_dir"), baseline["trainer"].pop("default_root_dir")
    assert memopt["trainer"] == baseline["trainer"]


def test_resnet_config_instantiates_callbacks_with_yaml_values(resnet_train):
    path = EXAMPLES / "resnet" / "config.yaml"
    cli = resnet_train.main(["--config", str(path)], run=False)
    (swap,) = _callbacks(cli, BatchNormToGroupNorm)
    (accumulation,) = _callbacks(cli, AutoAccumulation)
    (monitor,) = _callbacks(cli, MemoryMonitor)
    assert (swap.num_groups, swap.when) == (8, "micro_batching")
    assert accumulation.micro_batch_size == 8
    assert monitor.log_every_n_steps == 10
    assert cli.model.hparams.num_classes == cli.datamodule.hparams.num_classes == 10  # linked


def test_every_public_callback_is_configurable_from_yaml(tmp_path, gpt_train):
    """Every callback the package exports, from YAML: with zero arguments in a LightningCLI config, and
    with typical init_args (byte strings included) through jsonargparse, as LightningCLI parses them
    (the Trainer refuses two stateful callbacks of one type, so the variants are parsed on their own)."""
    exported = {
        name
        for name in lightning_memopt.__all__
        if isinstance(getattr(lightning_memopt, name), type)
        and issubclass(getattr(lightning_memopt, name), Callback)
    }  # the callbacks (MicroBatchOOMError is exported too, for users to catch)
    assert exported == {
        "AutoAccumulation",
        "AutoCheckpoint",
        "BatchNormToGroupNorm",
        "DataLoaderMonitor",
        "MemoryMonitor",
        "OOMBackoff",
    }
    config = tmp_path / "callbacks.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n"
        + "".join(f"    - class_path: lightning_memopt.{name}\n" for name in sorted(exported))
    )
    cli = gpt_train.main(["--config", str(config)], run=False)
    ours = [
        type(c).__name__ for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_memopt")
    ]
    assert ours == sorted(exported)

    variants = tmp_path / "variants.yaml"
    variants.write_text(
        """callbacks:
  - class_path: lightning_memopt.AutoCheckpoint
    init_args: {max_memory: 6GiB, headroom: 0.2}
  - class_path: lightning_memopt.AutoCheckpoint
    init_args: {max_memory: 0.5}
  - class_path: lightning_memopt.AutoCheckpoint
    init_args: {mode: every_n, every_n: 3}
  - class_path: lightning_memopt.AutoAccumulation
    init_args: {max_memory: 1.5 GB, headroom: 0.05, eval_micro_batch_size: 64}
  - class_path: lightning_memopt.OOMBackoff
    init_args: {grow_after: 100}
  - class_path: lightning_memopt.BatchNormToGroupNorm
    init_args: {group_size: 4, when: micro_batching, micro_batch_size_below: 16}
  - class_path: lightning_memopt.MemoryMonitor
    init_args: {breakdown: never, report: false, max_history: 64}
  - class_path: lightning_memopt.DataLoaderMonitor
    init_args: {threshold: 0.25, window: 8, tune: true, tune_batches: 4}
"""
    )
    parser = ArgumentParser()
    parser.add_argument("--config", action="config")
    parser.add_argument("--callbacks", type=list[Callback])
    callbacks = parser.instantiate_classes(parser.parse_args(["--config", str(variants)])).callbacks
    ckpt_gib, ckpt_fraction, ckpt_every, accumulation, backoff, swap, monitor, data = callbacks
    assert (parse_bytes(ckpt_gib.max_memory), ckpt_gib.headroom) == (6 * 2**30, 0.2)
    assert ckpt_fraction.max_memory == 0.5
    assert (ckpt_every.mode, ckpt_every.every_n) == ("every_n", 3)
    assert (accumulation.max_memory, accumulation.headroom) == (1_500_000_000, 0.05)
    assert accumulation.eval_micro_batch_size == 64
    assert backoff.grow_after == 100
    assert (swap.group_size, swap.when, swap.micro_batch_size_below) == (4, "micro_batching", 16)
    assert (monitor.breakdown, monitor.report, monitor.max_history) == ("never", False, 64)
    assert (data.threshold, data.window, data.tune, data.tune_batches) == (0.25, 8, True, 4)


def test_bad_yaml_value_is_reported_with_the_callbacks_message(tmp_path, gpt_train):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning_memopt.AutoCheckpoint\n      init_args: {max_memory: banana}\n"
    )
    with pytest.raises(ValueError, match="banana"):
        gpt_train.main(["--config", str(config)], run=False)


# ------------------------------------------------------------------------------------- a few steps
def test_gpt_memopt_fit_prints_the_comparison(gpt_train, tmp_path, capsys):
    cli = gpt_train.main(
        ["fit", "--config", str(EXAMPLES / "gpt" / "memopt.yaml"), *TINY_GPT, *_quiet(tmp_path)]
    )
    assert cli.trainer.global_step == 3
    (monitor,) = _callbacks(cli, MemoryMonitor)
    out = capsys.readouterr().out
    assert "baseline" in out and "memopt" in out and "step peak:" in out
    for path in monitor.report_paths:
        assert path.exists() and str(path) in out
    assert {p.name for p in monitor.report_paths} == {"memory_report.md", "memory_report.png"}


def test_gpt_baseline_step_equals_monitor_record_without_package_transforms(gpt_train, tmp_path):
    """With only MemoryMonitor (nothing that changes memory), the baseline step measured before fit and
    the monitor's record of step 1 in the run agree byte for byte on parameters, gradients, optimizer
    state and activations in every phase: the comparison the examples print measures both sides the
    same way. (Bytes depend on shapes only, so the run's second batch is as good as the first.)"""
    cli = gpt_train.main(
        [
            "fit",
            "--config",
            str(EXAMPLES / "gpt" / "baseline.yaml"),
            "--trainer.callbacks+=lightning_memopt.MemoryMonitor",
            *TINY_GPT,
            *_quiet(tmp_path, steps=2),
        ]
    )
    (monitor,) = _callbacks(cli, MemoryMonitor)
    step1 = next(r for r in monitor.history if r["step"] == 1)
    for phase in ("forward", "backward", "optimizer"):
        for category in ("parameters", "gradients", "optimizer_state", "activations"):
            key = f"{phase}_{category}"
            assert cli.baseline[key] == step1[key], key
        # Lightning's loop keeps a few scalar tensors of its own (logged values, the closure's result).
        assert 0 <= step1[phase] - cli.baseline[phase] <= 64, phase
    assert cli.baseline["forward_activations"] > 0 and cli.baseline["forward_gradients"] > 0


def test_resnet_fit(resnet_train, tmp_path, capsys):
    cli = resnet_train.main(
        ["fit", "--config", str(EXAMPLES / "resnet" / "config.yaml"), *TINY_RESNET, *_quiet(tmp_path)]
    )
    assert cli.trainer.global_step == 3
    assert "step peak:" in capsys.readouterr().out


def test_baseline_step_can_be_skipped(resnet_train, tmp_path, capsys):
    cli = resnet_train.main(
        [
            "fit",
            "--config",
            str(EXAMPLES / "resnet" / "config.yaml"),
            "--baseline_step=false",
            *TINY_RESNET,
            *_quiet(tmp_path, steps=1),
        ]
    )
    assert cli.baseline is None
    assert "step peak:" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------- data and model
def test_stdlib_corpus_is_python_source_and_windows_shift_by_one(gpt_train):
    gpt = sys.modules["gpt"]
    corpus = gpt.stdlib_corpus(50_000)
    assert corpus.dtype == torch.uint8 and corpus.shape == (50_000,)
    assert torch.equal(corpus, gpt.stdlib_corpus(50_000))  # sorted files: the same every time
    assert b"def " in bytes(corpus.tolist()) and b"import " in bytes(corpus.tolist())
    windows = gpt.RandomWindows(corpus, block_size=16, num_samples=5, seed=0)
    x, y = windows[3]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])
    start = int(windows.offsets[3])
    assert torch.equal(x, corpus[start : start + 16].long())


def test_gpt_shapes_and_errors(gpt_train):
    gpt = sys.modules["gpt"]
    model = gpt.GPT(block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    assert model(torch.zeros(3, 8, dtype=torch.long)).shape == (3, 8, gpt.VOCAB_SIZE)
    assert model.lm_head.weight is model.wte.weight
    with pytest.raises(ValueError, match="sequence length 9 is longer than block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"n_embd \(10\) must be a multiple of n_head \(3\)"):
        gpt.CausalSelfAttention(10, 3, 0.0)
    with pytest.raises(ValueError, match=r"shorter than block_size \+ 1"):
        gpt.RandomWindows(torch.zeros(5, dtype=torch.uint8), block_size=8, num_samples=1, seed=0)
    with pytest.raises(ValueError, match="val_fraction must be between 0 and 1, got 1.5"):
        gpt.StdlibText(val_fraction=1.5)


def test_synthetic_images_are_deterministic_and_learnable_by_class(resnet_train):
    resnet = sys.modules["resnet"]
    x, y = resnet.synthetic_images(200, num_classes=4, image_size=16, noise=0.0, seed=0)
    x2, y2 = resnet.synthetic_images(200, num_classes=4, image_size=16, noise=0.0, seed=0)
    assert x.shape == (200, 3, 16, 16) and torch.equal(x, x2) and torch.equal(y, y2)
    assert set(y.tolist()) == {0, 1, 2, 3}
    # The class is in the image: the nearest class mean recovers it for almost every noisy sample,
    # and chance would be 1 in 4.
    x, y = resnet.synthetic_images(200, num_classes=4, image_size=16, noise=0.5, seed=0)
    means = torch.stack([x[y == k].mean(0) for k in range(4)])  # (K, 3, S, S)
    distance = (x[:, None] - means[None]).pow(2).flatten(2).sum(-1)  # (N, K)
    assert (distance.argmin(1) == y).float().mean() > 0.9
