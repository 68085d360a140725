#!/usr/bin/env bash
# Llama-2-70B at 131072 tokens on an Ascend cluster (64 GB NPUs), with mcore-flash.
#
#   NNODES=32 NODE_RANK=<0..31> MASTER_ADDR=<node 0> NPUS_PER_NODE=8 bash scripts/pretrain_70b.sh
#   bash scripts/pretrain_70b.sh --dry-run     # on any CPU machine: validate + count, no allocation
#   bash scripts/pretrain_70b.sh --rehearse    # on any CPU machine: the recipe's code path on 8
#                                              # emulated NPUs (TP2 x PP2 x CP2), a tiny model
#
# Layout (checked by `mcore-flash plan`, see docs/benchmarks.md "Memory planner"):
#   TP 8 + sequence parallel   one node's 8 NPUs share each layer (HCCS inside the node)
#   CP ${CP}                   ring attention over 2*CP chunks: 131072 / CP tokens per rank
#   PP ${PP}                   80 layers -> 80/PP per stage, 1F1B
#   DP = world / (TP*PP*CP)    distributed optimizer shards fp32 master weights + Adam over DP x CP
#   recompute ${RECOMPUTE}     attention-only (default): the attention sub-block keeps only its
#                              input; planner: 47.5 GiB of 64 GiB, +19% FLOPs. RECOMPUTE=none:
#                              52.6 GiB (+0%, less margin); RECOMPUTE=full: 31.3 GiB (+31%)
# Extra flags after the script's name are passed on to `mcore-flash pretrain`.
set -euo pipefail

NNODES=${NNODES:-32}
NODE_RANK=${NODE_RANK:-0}
NPUS_PER_NODE=${NPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((NNODES * NPUS_PER_NODE))

TP=${TP:-8}
PP=${PP:-2}
CP=${CP:-16}
SEQ_LENGTH=131072
GLOBAL_BATCH=${GLOBAL_BATCH:-32}
RECOMPUTE=${RECOMPUTE:-attention}
DATA_PATH=${DATA_PATH:-/data/llama2_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-/models/llama-2-70b/tokenizer.model}
SAVE=${SAVE:-/ckpt/llama2-70b-128k}

# Ascend runtime: expandable segments against fragmentation at 128K; HCCL timeouts and
# buffers sized for ring context parallelism's large point-to-point K/V blocks.
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export HCCL_CONNECT_TIMEOUT=1800
export HCCL_EXEC_TIMEOUT=1800
export HCCL_BUFFSIZE=512
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TASK_QUEUE_ENABLE=2
export CPU_AFFINITY_CONF=1
export COMBINED_ENABLE=1

case "$RECOMPUTE" in
  none) RECOMPUTE_ARGS=() ;;
  attention) RECOMPUTE_ARGS=(--recompute-granularity selective --recompute-modules core_attn) ;;
  full) RECOMPUTE_ARGS=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
  *) echo "RECOMPUTE=$RECOMPUTE: choose none, attention or full" >&2; exit 2 ;;
esac

ARGS=(
  --model llama2-70b
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --tensor-model-parallel-size "$TP" --sequence-parallel
  --pipeline-model-parallel-size "$PP"
  --context-parallel-size "$CP" --cp-comm-type p2p
  --use-distributed-optimizer --overlap-grad-reduce
  "${RECOMPUTE_ARGS[@]}"
  --attention-backend npu
  --bf16
  --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH"
  --lr 1.0e-5 --min-lr 1.0e-6 --lr-decay-style cosine --lr-warmup-iters 100
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
  --train-iters 2000
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
  --data-path "$DATA_PATH" --split 100,0,0
  --save "$SAVE" --load "$SAVE" --save-interval 100 --log-interval 1
)

if [[ " $* " == *" --rehearse "* ]]; then
  # The NPU code path of this recipe - every parallelism, the recompute mode, bf16, the
  # distributed optimizer with overlapped reduction, the npu attention backend, HCCL - on
  # 8 emulated NPUs in CPU processes (mcore_flash.emulation), the layout halved in each
  # dimension and the model shrunk to fit 2 CPU cores; built-in data, 2 iterations.
  REHEARSAL=()
  skip=0
  for a in "${ARGS[@]}"; do
    if ((skip)); then skip=0; continue; fi
    case "$a" in
      --data-path|--tokenizer-model|--tokenizer-type|--load|--save|--tensor-model-parallel-size|\
      --pipeline-model-parallel-size|--context-parallel-size|--seq-length|--max-position-embeddings|\
      --global-batch-size|--train-iters|--save-interval|--lr-warmup-iters) skip=1; continue;;
      --split) skip=1; continue;;
    esac
    REHEARSAL+=("$a")
  done
  REHEARSAL+=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --context-parallel-size 2
              --num-layers 4 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4 --num-query-groups 2
              --seq-length 128 --max-position-embeddings 128 --global-batch-size 2 --train-iters 2 --lr-warmup-iters 1
              --save "${REHEARSAL_SAVE:-$(mktemp -d)}" --emulate-npu)
  args=()
  for a in "$@"; do [[ "$a" == --rehearse ]] || args+=("$a"); done
  OMP_NUM_THREADS=1 exec "${PYTHON:-python}" -m torch.distributed.run --nnodes 1 --nproc-per-node 8 \
    --master-addr 127.0.0.1 --master-port "${MASTER_PORT}" -m mcore_flash.pretrain "${REHEARSAL[@]}" "${args[@]}"
fi

if [[ " $* " == *" --dry-run "* ]]; then
  # One CPU process stands in for all ranks: flags are validated for WORLD_SIZE and every
  # pipeline stage's model is built on the meta device. Data/tokenizer/--load are cluster paths.
  DRY=()
  skip=0
  for a in "${ARGS[@]}"; do
    if ((skip)); then skip=0; continue; fi
    case "$a" in --data-path|--tokenizer-model|--tokenizer-type|--load) skip=1; continue;; esac
    DRY+=("$a")
  done
  WORLD_SIZE=$WORLD_SIZE exec "${PYTHON:-python}" -m mcore_flash.pretrain "${DRY[@]}" "$@"
fi

exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  -m mcore_flash.pretrain "${ARGS[@]}" "$@"
