#!/usr/bin/env bash
# The GPU checks to run first when a GPU is at hand, from the repository root, in the order of
# what they decide, within one deadline (a lent GPU gives 10 minutes a command, ~15 in all):
#
#   bash bench/gpu_checks.sh [must|rest|all]     (default: must)
#
# must: umrt doctor; the copy probe shared/gpu-probes/um_micro_4.py where it was copied into
#       gpu-probes/ (ignored; carry it); an example loop with evaluations under umrt against plain
#       PyTorch (issue 24); GPT-2 with umrt beside activation checkpointing at checkpointing's peak
#       (issue 20). The GPU tests took 264 s on an H200 and come after, in rest:
# rest: python -m pytest -m gpu; bench.copy_wait and bench.remote_write (what the simulator
#       assumes); GPT-2 with umrt on the copy engines at the same peak.
#
# GPU_CHECKS_SECONDS (default 540) bounds the whole run: each check's timeout is its own cap or
# what is left, whichever is less, and a check with under 20 s left is skipped (said so in the
# summary). Each writes its output to $OUT (default gpu-out/) and one line to $OUT/summary.txt;
# none stops the others. umrt is taken from this checkout (PYTHONPATH): nothing to install.
set -u
STAGE=${1:-must}
case "$STAGE" in must|rest|all) ;; *) echo "usage: bash bench/gpu_checks.sh [must|rest|all]" >&2; exit 2 ;; esac
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
DEADLINE=$((SECONDS + ${GPU_CHECKS_SECONDS:-540}))

check() {  # check NAME SECONDS COMMAND...
    local name=$1 secs=$2 left=$((DEADLINE - SECONDS))
    shift 2
    if [ "$left" -lt 20 ]; then
        echo "$name: skipped ($left s left of GPU_CHECKS_SECONDS)" | tee -a "$OUT/summary.txt"
        return
    fi
    [ "$secs" -gt "$((left - 5))" ] && secs=$((left - 5))
    local t0=$SECONDS
    timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
    echo "$name: rc=$? in $((SECONDS - t0)) s (limit $secs s)" | tee -a "$OUT/summary.txt"
}

must() {
    check doctor 60 "$PY" -m umrt doctor
    if [ -f gpu-probes/um_micro_4.py ]; then
        check um_micro_4 150 env OUT="$OUT" "$PY" gpu-probes/um_micro_4.py
    else
        echo "um_micro_4: skipped (copy shared/gpu-probes/um_micro_4.py into gpu-probes/)" | tee -a "$OUT/summary.txt"
    fi
    # Issue 24: the loop that evaluates every 6 steps, plain and under umrt with a budget below
    # its footprint (umrt's own limit: the card's memory is not taken away); the losses must be
    # equal line for line, and the step times before and after each evaluation are in the logs.
    rm -f "$OUT"/loop_*
    check loop_plain 90 "$PY" examples/train_gpt_eval.py --device cuda --max-iters 18
    check loop_umrt 150 "$PY" -m umrt run --gpu-memory 150MB examples/train_gpt_eval.py --device cuda --max-iters 18
    grep -so 'loss [0-9.]*' "$OUT/loop_plain.txt" > "$OUT/loop_plain.losses"
    grep -so 'loss [0-9.]*' "$OUT/loop_umrt.txt" > "$OUT/loop_umrt.losses"
    if [ ! -f "$OUT/loop_plain.txt" ]; then
        :  # (skipped: no time left)
    elif [ ! -s "$OUT/loop_plain.losses" ]; then
        echo "loop losses: none from the plain run (see loop_plain.txt)" | tee -a "$OUT/summary.txt"
    elif diff "$OUT/loop_plain.losses" "$OUT/loop_umrt.losses" > "$OUT/loop_losses.diff"; then
        echo "loop losses: equal ($(wc -l < "$OUT/loop_plain.losses") lines)" | tee -a "$OUT/summary.txt"
    else
        echo "loop losses: DIFFER (see loop_losses.diff)" | tee -a "$OUT/summary.txt"
    fi
    # Issue 20: umrt at activation checkpointing's peak, beside checkpointing, in one run (umrt
    # copying with its SM copy kernel, the default).
    check bench_gpu 240 "$PY" -m bench.gpu --model gpt2 --batch 8 --seq 1024 --modes ideal,checkpoint,umrt \
        --gpu-memory checkpoint --steps 5 --json "$OUT/bench_gpu.json"
}

rest() {
    check pytest_gpu 330 "$PY" -m pytest -m gpu -q -p no:cacheprovider
    check copy_wait 90 env OUT="$OUT" "$PY" -m bench.copy_wait
    check remote_write 60 env OUT="$OUT" "$PY" -m bench.remote_write
    check bench_gpu_engines 200 env UMRT_SWAP_COPY=engines "$PY" -m bench.gpu --model gpt2 --batch 8 --seq 1024 \
        --modes checkpoint,umrt --gpu-memory checkpoint --steps 5 --json "$OUT/bench_gpu_engines.json"
}

case "$STAGE" in
    must) must ;;
    rest) rest ;;
    all) must; rest ;;
esac
