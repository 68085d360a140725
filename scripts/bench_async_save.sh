#!/usr/bin/env bash
# The stall a checkpoint save puts on training, synchronous vs --async-save (docs/benchmarks.md).
#
#   bash scripts/bench_async_save.sh [WORK_DIR]
#
# One CPU process trains a 25.9M-parameter model (8 layers, hidden 512, 512 tokens; fp32
# weights and the distributed optimizer: ~400 MB a checkpoint) for 60 iterations with a save
# every 20, once with synchronous saves and once with --async-save, and prints each save's
# "training stopped" seconds from the trainer's log (with --async-save, the wait for the
# previous save's write included) and the run's wall time.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
python=${PYTHON:-.venv/bin/python}
flags=(--num-layers 8 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8
       --num-query-groups 8 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 1
       --global-batch-size 1 --train-iters 60 --save-interval 20 --log-interval 20
       --use-distributed-optimizer)
for mode in sync async; do
    extra=()
    [[ $mode == async ]] && extra=(--async-save)
    rm -rf "$work/$mode"
    start=$SECONDS
    "$python" -m mcore_flash.pretrain "${flags[@]}" "${extra[@]}" --save "$work/$mode" 2>&1 |
        grep -o "training stopped [0-9.]* s[^)]*" | sed "s/^/$mode: /"
    echo "$mode: the whole run $((SECONDS - start)) s"
done
du -sh "$work/sync/iter_0000020" "$work/async/iter_0000020"
