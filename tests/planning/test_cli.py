"""``lightning-memopt plan``: JSON keys, exact parameter/gradient/optimizer bytes, errors, --help."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_memopt.planning.build import FakeBuildError, build_fake, fake_mode, parse_batch_spec
from lightning_memopt.planning.cli import device_memory_bytes, main, plan
from tests.planning.modules import TinyLM

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tests.planning.modules:TinyLM"


def _adamw_bytes(shapes):
    # AdamW on CPU: exp_avg and exp_avg_sq like the parameter, plus a float32 scalar ``step``
    return sum(2 * n * 4 + 4 for n in shapes)


def test_json_has_exact_model_state_bytes(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                MODEL,
                "--model.width=16",
                "--batch",
                "4x8",
                "--device-memory",
                "1GiB",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    for key in ("peak_bytes", "phases", "categories", "fits", "options", "cheapest", "usable_bytes"):
        assert key in out
    numels = [64 * 16, *[n for _ in range(3) for n in (16 * 64, 64, 64 * 16, 16)], 16 * 64, 64]
    assert out["parameters"] == sum(numels)
    opt = out["phases"]["optimizer"]
    assert opt["parameters"] == 4 * sum(numels)
    assert opt["gradients"] == 4 * sum(numels)
    assert opt["optimizer_state"] == _adamw_bytes(numels)
    assert out["fits"] is True and out["cheapest"]["config"]["precision"] == "32-true"
    assert out["peak_bytes"] == max(p["peak"] for p in out["phases"].values())
    assert out["usable_bytes"] == int(2**30 * 0.9)


def test_config_with_datamodule_and_yaml_block(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "trainer:\n  precision: 32-true\n  devices: 2\nmodel:\n  n_layer: 2\n  n_embd: 32\n  n_head: 2\n"
        "data:\n  block_size: 32\n  batch_size: 8\n  max_bytes: 20000\n  samples_per_epoch: 16\n"
    )
    gpt = "examples.gpt.gpt"
    result = plan(
        configs=[str(cfg)],
        model=f"{gpt}:CharGPT",
        data=f"{gpt}:StdlibText",
        device_memory="1MiB",
        overrides=["--model.block_size=32"],
    )
    assert result["devices"] == 2 and result["fits"] is False
    best = result["cheapest"]
    assert best is not None and best["peak_bytes"] <= result["usable_bytes"]
    assert best["yaml"].startswith("trainer:\n")
    names = [o["name"] for o in result["options"]]
    assert names[0] == "as configured" and "fsdp over 2" in names and "AutoCheckpoint" in names

    # The same step measured for real on the DataModule's first batch (one rank), plus DDP's buckets.
    sys.path[:0] = [str(ROOT / "examples")]
    from baseline_step import measure_baseline_step

    from examples.gpt.gpt import CharGPT, StdlibText

    dm = StdlibText(block_size=32, batch_size=8, max_bytes=20000, samples_per_epoch=16)
    dm.setup("fit")
    model = CharGPT(block_size=32, n_layer=2, n_embd=32, n_head=2)
    measured = measure_baseline_step(model, next(iter(dm.train_dataloader())))
    buckets = 4 * sum(p.numel() for p in model.parameters())
    for phase, row in result["phases"].items():
        assert row["peak"] == measured[phase] + buckets
        assert row["parameters"] == measured[f"{phase}_parameters"]
        assert row["activations"] == measured[f"{phase}_activations"]


def test_errors_name_the_value_and_the_fix(capsys):
    with pytest.raises(ValueError, match=r"--device-memory.*or a GPU name: T4"):
        device_memory_bytes("eighty")
    assert device_memory_bytes("h100") == 80 * 2**30
    with pytest.raises(ValueError, match="give --config .* or --model"):
        plan()
    with pytest.raises(ValueError, match="no DataModule in the config .* --batch 8x512"):
        plan(model=MODEL)
    with pytest.raises(ValueError, match=r"batch spec '8y4' is not"):
        parse_batch_spec(["8y4"], fake_mode())
    with pytest.raises(ValueError, match="unknown dtype 'int7'"):
        parse_batch_spec(["8x4:int7"], fake_mode())
    with pytest.raises(ValueError, match="mix named and unnamed"):
        parse_batch_spec(["x=8x4", "8x4"], fake_mode())
    with pytest.raises(ValueError, match="cannot import 'nowhere:Nothing'"):
        plan(model="nowhere:Nothing", batch=["2x2"])
    assert main(["plan", "--model", MODEL, "--batch", "2x4", "--headroom", "1.5"]) == 1
    assert "--headroom must be a number in [0, 1)" in capsys.readouterr().err


def test_data_dependent_control_flow_names_the_module():
    with pytest.raises(FakeBuildError, match=r"module 'blocks.1' \(Block\).*--batch"):
        plan(model="tests.planning.modules:DataDependent", batch=["2x4"])


def test_batch_spec_forms():
    mode = fake_mode()
    named = parse_batch_spec(["input_ids=2x5", "pixels=2x3x4x4:float32"], mode)
    assert named["input_ids"].shape == (2, 5) and named["pixels"].dtype.is_floating_point
    assert parse_batch_spec(["3x2"], mode).shape == (3, 2)
    assert len(parse_batch_spec(["3x2", "3x2:int32"], mode)) == 2


def test_console_help_in_a_subprocess():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_memopt.planning", "plan", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=True,
    ).stdout
    for flag in (
        "--config",
        "--model",
        "--batch",
        "--device-memory",
        "--devices",
        "--precision",
        "--strategy",
        "--json",
        "--plot",
    ):
        assert flag in out


def test_yaml_block_builds_the_callbacks_it_names():
    import yaml

    import lightning_memopt
    from lightning_memopt.planning.search import Config, Evaluated
    from lightning_memopt.planning.yaml_block import trainer_yaml

    text = trainer_yaml(
        Evaluated(Config("bf16-true", 2, "fsdp", "offload"), None, 0.3, True), 4, 80 * 2**30, 0.1, 8
    )
    trainer = yaml.safe_load(text)["trainer"]
    assert trainer["precision"] == "bf16-true" and trainer["devices"] == 4
    assert trainer["strategy"]["class_path"] == "lightning.pytorch.strategies.ModelParallelStrategy"
    assert trainer["strategy"]["init_args"]["data_parallel_size"] == 4
    built = [
        getattr(lightning_memopt, c["class_path"].split(".")[-1])(**c["init_args"])
        for c in trainer["callbacks"]
    ]
    assert [type(c).__name__ for c in built] == ["AutoAccumulation", "AutoCheckpoint"]
    plain = yaml.safe_load(
        trainer_yaml(Evaluated(Config("32-true", 8, "ddp"), None, 0.0, True), 1, 2**30, 0.1, 8)
    )
    assert plain == {"trainer": {"precision": "32-true", "devices": 1}}


def test_causal_lm_gets_the_chunked_head_as_an_option_and_the_cheapest_fit(capsys):
    """A tiny GPT-2 whose own head does not fit where the chunked one does: the plan counts the head on its
    own line, offers the chunked head with its peak (a real step with the head taken: equal) and no cost,
    and picks it, with AutoCheckpoint(head: chunked) in the YAML."""
    import torch

    sys.path[:0] = [str(ROOT / "examples")]
    from baseline_step import measure_baseline_step

    from tests.planning.modules import TinyGPT2

    x = torch.randint(0, 99, (4, 32))
    peaks = {}
    for chunked in (False, True):
        torch.manual_seed(0)
        measured = measure_baseline_step(TinyGPT2(chunked=chunked), x)
        peaks[chunked] = max(measured[p] for p in ("forward", "backward", "optimizer"))
    assert peaks[True] < peaks[False]
    gpt2 = "tests.planning.modules:TinyGPT2"
    between = (peaks[True] + peaks[False]) // 2
    result = plan(model=gpt2, batch=["4x32"], device_memory=between, headroom=0.0)
    assert result["fits"] is False and result["peak_bytes"] == peaks[False]
    assert result["head_bytes"] == result["phases"][result["peak_phase"]]["head"] > 0
    option = next(o for o in result["options"] if o["name"] == "chunked head")
    assert option["config"]["head"] == "chunked" and option["peak_bytes"] == peaks[True]
    assert option["fits"] is True and option["cost"] == 0.0 and option["recompute_flops"] == 0
    assert option["head_bytes"] < result["head_bytes"]
    best = result["cheapest"]
    assert best["config"] == {**option["config"]} and "        head: chunked" in best["yaml"]

    assert (
        main(["plan", "--model", gpt2, "--batch", "4x32", "--device-memory", str(between), "--headroom", "0"])
        == 0
    )
    text = capsys.readouterr().out
    assert "of which head" in text and "chunked head" in text

    no_lm = plan(model=MODEL, batch=["4x8"], device_memory="1GiB")
    assert no_lm["head_bytes"] is None and "chunked head" not in [o["name"] for o in no_lm["options"]]
    assert all(o["config"]["head"] == "own" for o in no_lm["options"])


def test_the_report_says_when_plain_accumulation_is_the_way():
    from lightning_memopt.planning.cli import _accumulation_line

    plain = {"micro_batch_size": 8, "checkpoint": "none"}
    assert _accumulation_line(plain, 32) == [
        "plain accumulation is the fastest way that fits: 4 micro-batches of 8 without recompute "
        "(AutoCheckpoint beside AutoAccumulation times recompute against it at the first batch and "
        "recomputes only where larger micro-batches make the step faster)"
    ]
    assert _accumulation_line(plain, 8) == []  # the whole batch: nothing to accumulate
    chunked = _accumulation_line({**plain, "head": "chunked"}, 32)  # where only the chunked head fits
    assert chunked[0].startswith("accumulation with the chunked head is the fastest way that fits: 4 micro")
    assert _accumulation_line({**plain, "checkpoint": "recompute"}, 32) == []


def test_the_micro_batch_sizes_are_those_the_callbacks_search():
    """A batch of 48 where 16 samples fit and 24 do not: the plan runs 3 micro-batches of 16, as
    ``AutoAccumulation``'s search does (it probes ``ceil(48 / n)``), not 4 of 12 (halving 48, 24, 12, ...);
    the options list the sizes down to the first that fits."""
    from lightning_memopt.planning.search import Config, Planner

    mode = fake_mode()
    module = build_fake(mode, lambda: TinyLM(), what="TinyLM")
    planner = Planner(module, parse_batch_spec(["48x8"], mode), usable=10**9, precision="bf16-true")
    assert planner.micro_batch_grid() == [48, 24, 16, 12, 10, 8, 7, 6, 5, 4, 3, 2, 1]
    with mode:
        peaks = {m: planner.predict(Config("bf16-true", m, "ddp")).peak_bytes for m in (24, 16)}
    between = (peaks[16] + peaks[24]) // 2
    result = plan(model=MODEL, batch=["48x8"], device_memory=between, headroom=0.0, precision="bf16-true")
    assert result["cheapest"]["config"]["micro_batch_size"] == 16
    assert result["cheapest"]["config"]["checkpoint"] == "none"
    rows = [(o["name"], o["fits"]) for o in result["options"] if o["name"].startswith("micro-batch")]
    assert rows == [("micro-batch 24", False), ("micro-batch 16", True)]
