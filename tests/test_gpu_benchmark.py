"""benchmarks/gpu.py: imports and explains itself anywhere, refuses clearly without CUDA, runs with it."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("benchmarks_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_lists_the_tables(gpu, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--only {plans,sizing,backoff,offload,monitor}" in out and "--quick" in out


def test_without_cuda_it_says_so_and_exits_2(gpu, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--output", str(tmp_path / "r.md")]) == 2
    assert capsys.readouterr().err.strip() == gpu.NO_CUDA
    assert not (tmp_path / "r.md").exists()


@pytest.mark.cuda
def test_quick_offload_table_on_the_device(gpu, tmp_path):
    out = tmp_path / "RESULTS-gpu.md"
    assert gpu.main(["--quick", "--only", "offload", "--output", str(out)]) == 0
    text = out.read_text()
    assert text.startswith(f"# GPU results: {torch.cuda.get_device_name()}")
    assert "| offload, overlapped" in text and "| full + offload inputs" in text


def test_checkpointing_benchmark_on_cuda_refuses_clearly_without_it(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location(
        "benchmarks_checkpointing", SCRIPT.with_name("checkpointing.py")
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["checkpointing.py", "--device", "cuda"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    assert "--device cuda: no CUDA device is available here" in capsys.readouterr().err
    assert module.DEVICE.type == "cpu" and module.DEVICE.treatments == module.TREATMENTS
