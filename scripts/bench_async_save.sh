#!/usr/bin/env bash
# The stall a checkpoint save puts on training, synchronous vs --async-save (docs/benchmarks.md).
#
#   bash scripts/bench_async_save.sh [WORK_DIR]
#
# One CPU process trains a 25.9M-parameter model (8 layers, hidden 512; fp32 weights, the
# distributed optimizer: 16 B of weights + Adam state per parameter, ~415 MB a checkpoint)
# for 4 iterations with a save after each, once with synchronous saves and once with
# --async-save, and prints each save's "training stopped" seconds from the trainer's log.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
python=${PYTHON:-.venv/bin/python}
flags=(--num-layers 8 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8
       --num-query-groups 8 --seq-length 128 --max-position-embeddings 128 --micro-batch-size 1
       --global-batch-size 1 --train-iters 4 --save-interval 1 --log-interval 1
       --use-distributed-optimizer)
for mode in sync async; do
    extra=()
    [[ $mode == async ]] && extra=(--async-save)
    rm -rf "$work/$mode"
    "$python" -m mcore_flash.pretrain "${flags[@]}" "${extra[@]}" --save "$work/$mode" 2>&1 |
        grep -o "training stopped [0-9.]* s" | sed "s/^/$mode: /"
done
du -sh "$work/sync/iter_0000001" "$work/async/iter_0000001"
