"""Run every benchmark script, time each, and collect what they print into benchmarks/RESULTS.md.

    python benchmarks/run_all.py            # everything (about 20 minutes on an idle 2-core CPU machine)
    python benchmarks/run_all.py --quick    # the scripts' quick modes where they have one

Each script runs in its own process (so one's compiled kernels, threads or memory do not affect the
next) from the repository root with the repository on ``PYTHONPATH``; its standard output is copied
verbatim under a heading with the command and the wall time. A script that fails or times out is
reported as such, with the end of its error output, and the others still run. The test suite never runs
this file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# (script, title, extra arguments, extra arguments in --quick mode, timeout in seconds)
BENCHMARKS = [
    # checkpointing.py: 7 models, each plan timed in 5 alternated rounds (~15 minutes on a 2-core machine).
    ("checkpointing.py", "Activation checkpointing (AutoCheckpoint's planner)", [], ["--quick"], 2400),
    ("compile_selective.py", "torch.compile and op-level selective checkpointing", [], [], 900),
    ("anchors.py", "Anchors: torch apply_activation_checkpointing, torch.compile memory budget", [], [], 150),
    ("batching.py", "Micro-batch sizing vs Lightning's BatchSizeFinder", [], [], 150),
    ("engine_overhead.py", "Micro-batch engine step-time overhead at k=1", [], [], 90),
    (
        "exactness.py",
        "Exactness by verification: the loss observer, learned weights, the one-time check",
        [],
        [],
        300,
    ),
    # micro_batching_zoo.py: ~170 transformers architectures, unsplit and split twice each (~2 minutes).
    (
        "micro_batching_zoo.py",
        "Micro-batching exactness on transformers architectures (tiny configs, float64)",
        [],
        ["--sizes", "2"],
        900,
    ),
    # pointwise_zoo.py: the same architectures, pointwise on every block against the plain run (~5 minutes).
    (
        "pointwise_zoo.py",
        "The pointwise treatment's exactness on transformers architectures (tiny configs, float64)",
        [],
        ["--only", "gpt2", "llama", "t5", "vit"],
        900,
    ),
    ("memory_monitor.py", "MemoryMonitor: what it reports and what measuring costs", [], [], 90),
    ("batchnorm_swap.py", "BatchNorm -> GroupNorm swap", [], [], 60),
    ("distributed_oom.py", "Out of memory on one of two ranks (DDP, FSDP2)", [], [], 300),
    ("dataloader.py", "DataLoaderMonitor: input stalls and the named fix", [], [], 180),
    ("plan.py", "lightning-memopt plan on a Llama-2-7B-shaped config (time, resident memory)", [], [], 300),
    # head.py: GPT-2 small at 2 x 1,024 on CPU, 5 timed rounds (~15 minutes on a 2-core machine).
    (
        "head.py",
        "The output head without its logits (GPT-2 small: step peak, head bytes, exactness, time)",
        [],
        ["--small"],
        2400,
    ),
    # The full run trains on variable-length batches for a few minutes; --quick prints the padding table.
    (
        "variable_length.py",
        "Variable-length data: token-budget batching, per-batch sizing, AutoCheckpoint per shape",
        [],
        ["--padding"],
        1800,
    ),
]  # timeouts are caps for a loaded machine; on an idle 2-core one each takes far less


def run(script: str, args: list[str], timeout: float) -> tuple[str, float, str]:
    """(status, seconds, output) of one benchmark script."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / script), *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as error:
        out = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
        return f"timed out after {timeout:.0f} s", time.perf_counter() - start, out
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return f"failed (exit code {proc.returncode})", seconds, proc.stdout + "\n" + tail
    return "ok", seconds, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="pass each script its quick option, if any")
    parser.add_argument("--only", nargs="*", help="run only these scripts (file names)")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = parser.parse_args()

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmark results",
        "",
        f"Produced by `python benchmarks/run_all.py{' --quick' if args.quick else ''}` on {now}: "
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, CUDA {'available' if torch.cuda.is_available() else 'not available'}. "
        "Memory is live tensor bytes (exact), compute is FLOPs, time is a ratio of two runs in one process.",
        "",
    ]
    summary = []
    total_start = time.perf_counter()
    for script, title, extra, quick_extra, timeout in BENCHMARKS:
        if args.only and script not in args.only:
            continue
        command = (
            f"python benchmarks/{script} {' '.join(extra + (quick_extra if args.quick else []))}".strip()
        )
        if not (ROOT / "benchmarks" / script).exists():
            status, seconds, out = "missing", 0.0, ""
        else:
            print(f"running {command} ...", file=sys.stderr, flush=True)
            status, seconds, out = run(script, extra + (quick_extra if args.quick else []), timeout)
        summary.append(f"| `{command}` | {status} | {seconds:.0f} |")
        lines += [f"## {title}", "", f"`{command}` — {status}, {seconds:.0f} s", ""]
        if out.strip():
            # Markdown tables go in as they are; anything else as a code block.
            fenced = "|---" not in out and "|:--" not in out
            lines += (["```", out.rstrip(), "```"] if fenced else [out.rstrip()]) + [""]
    total = time.perf_counter() - total_start
    header = 4  # the summary table goes right after the title and the set-up line
    lines[header:header] = [
        "| script | status | seconds |",
        "|---|---|---:|",
        *summary,
        f"| total | | {total:.0f} |",
        "",
    ]
    text = "\n".join(lines).replace("\n\n\n", "\n\n")
    args.output.write_text(text + "\n")
    print(text)
    print(f"\nwritten to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
