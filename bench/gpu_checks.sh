#!/usr/bin/env bash
# The GPU checks to run first when a GPU is at hand, in one go, from the repository root
# (about 12 minutes on an H200): umrt doctor, the copy probe (copy engines and umrt's SM copy kernel), the remote-write probe, the GPU tests, an
# example loop with evaluations under umrt against plain PyTorch (issue 24), and GPT-2 with
# umrt beside activation checkpointing at checkpointing's peak (issue 20). Each writes its
# output to $OUT (default gpu-out/) and one line to $OUT/summary.txt; none stops the others.
# umrt is taken from this checkout (PYTHONPATH), so nothing needs installing.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

check() {  # check NAME SECONDS COMMAND...
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
    echo "$name: rc=$? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}

check doctor 90 "$PY" -m umrt doctor
check copy_wait 120 env OUT="$OUT" "$PY" -m bench.copy_wait
check remote_write 90 env OUT="$OUT" "$PY" -m bench.remote_write
check pytest_gpu 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider
# Issue 24: the loop that evaluates every 6 steps, plain and under umrt with a budget below
# its footprint (umrt's own limit: the card's memory is not taken away); the losses must be
# equal line for line, and the step times before and after each evaluation are in the logs.
check loop_plain 150 "$PY" examples/train_gpt_eval.py --device cuda --max-iters 18
check loop_umrt 240 "$PY" -m umrt run --gpu-memory 150MB examples/train_gpt_eval.py --device cuda --max-iters 18
if diff <(grep -o 'loss [0-9.]*' "$OUT/loop_plain.txt") <(grep -o 'loss [0-9.]*' "$OUT/loop_umrt.txt") \
        > "$OUT/loop_losses.diff"; then
    echo "loop losses: equal" | tee -a "$OUT/summary.txt"
else
    echo "loop losses: DIFFER (see loop_losses.diff)" | tee -a "$OUT/summary.txt"
fi
# Issue 20: umrt at activation checkpointing's peak, beside checkpointing, in one run (umrt
# copying with its SM copy kernel, the default), then umrt on the copy engines at the same peak.
check bench_gpu 300 "$PY" -m bench.gpu --model gpt2 --batch 8 --seq 1024 --modes ideal,checkpoint,umrt \
    --gpu-memory checkpoint --steps 5 --json "$OUT/bench_gpu.json"
check bench_gpu_engines 200 env UMRT_SWAP_COPY=engines "$PY" -m bench.gpu --model gpt2 --batch 8 --seq 1024 \
    --modes checkpoint,umrt --gpu-memory checkpoint --steps 5 --json "$OUT/bench_gpu_engines.json"
