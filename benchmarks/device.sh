#!/usr/bin/env bash
# One call on a lent GPU, in the order the open issues need it: issue 30's whole job
# (fastest_step.py --device cuda), where the defaults' first step spends its time (startup_profile.py), the
# head (head.py --shapes --device cuda), then the `cuda` tests.
# Each part runs under its own time limit (a lent machine's time is counted in minutes, its start included),
# writes its output and errors to $OUT/<part>.txt and .err, and the next part runs whatever the last did.
#
#   bash benchmarks/device.sh             # from the repository root; $OUT: where the results go (./device-out)
#
# The manual ways' micro-batches are those an H100 80GB measured (benchmarks/RESULTS-gpu.md: plain 2, Hugging
# Face checkpointing 4): `--micro 2 4` skips their out-of-memory search, and `--cap-gib 79.18` holds a larger card
# (the H200's 139 GiB) to the H100's memory, so those micro-batches and the issue's table still apply. To
# use the whole card, set CAP="" MICRO="" (the manual ways are then searched by out-of-memory errors).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-device-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
micro="${MICRO---micro 2 4}"
cap="${CAP---cap-gib 79.18}"

part() { # part NAME SECONDS COMMAND...: COMMAND under a time limit, its output in $out/NAME.txt
    local name=$1 seconds=$2
    shift 2
    echo "== $name (at most ${seconds} s): $*"
    local began=$SECONDS
    timeout "$seconds" "$@" >"$out/$name.txt" 2>"$out/$name.err"
    local rc=$?
    echo "exit $rc after $((SECONDS - began)) s"
    tail -n 30 "$out/$name.txt"
    if [ "$rc" -ne 0 ]; then # cut short or failed: what it said on the way (progress, decisions, the error)
        tail -n 15 "$out/$name.err"
    fi
}

{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c \
    "import torch, lightning, transformers; print(torch.__version__, lightning.__version__, transformers.__version__)"; \
    git rev-parse --short HEAD; } >"$out/stack.txt" 2>&1
cat "$out/stack.txt"
# shellcheck disable=SC2086  # $micro and $cap are words or none
part fastest_step 290 python3 benchmarks/fastest_step.py --device cuda $micro $cap
# shellcheck disable=SC2086
part startup_profile 100 python3 benchmarks/startup_profile.py --device cuda $cap --steps 3 --top 40
part head 70 python3 benchmarks/head.py --shapes --device cuda --reps 5
part cuda_tests 100 python3 -m pytest -q -m cuda tests/head/test_loss.py tests/checkpointing/test_offload.py \
    tests/memory/test_device_cuda_fakes.py tests/memory/test_head_time.py tests/test_gpu_benchmark.py \
    tests/callbacks/test_auto_accumulation.py tests/batching/test_check.py
