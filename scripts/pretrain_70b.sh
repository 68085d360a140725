#!/usr/bin/env bash
# A 70B model at 131072 tokens by continued pretraining on an Ascend cluster (910B NPUs: 64 GB
# of HBM, 60.97 GiB of it allocatable), with mcore-flash. MODEL= llama2-70b (default: extended
# from 4K), llama3.1-70b or qwen2.5-72b (both trained at 128K already: its own RoPE, ROPE=none).
#
#   HF_CHECKPOINT=/models/Llama-2-70b-hf NNODES=32 NODE_RANK=<0..31> MASTER_ADDR=<node 0> \
#     NPUS_PER_NODE=8 bash scripts/pretrain_70b.sh
#   MODEL=llama3.1-70b HF_CHECKPOINT=/models/Llama-3.1-70B NUM_DEVICES=8 bash scripts/pretrain_70b.sh
#   bash scripts/pretrain_70b.sh --dry-run     # on any CPU machine: validate + count, no allocation
#   bash scripts/pretrain_70b.sh --rehearse    # on any CPU machine: the recipe's code path on 8
#                                              # emulated NPUs (TP2 x PP2 x CP2), a tiny model
#   SHARDING=optim_grads_params bash scripts/pretrain_70b.sh --rehearse   # ZeRO-3 (Megatron-FSDP):
#                                              # TP2 x CP2 x DP2 on 8 emulated NPUs
#
# Layout and recompute: the planner's best fitting layout, asked at launch (below) with
#   mcore-flash plan --search --hardware ascend-910b-64g --num-devices $WORLD_SIZE --hccl-buffsize $HCCL_BUFFSIZE
# Why the planner: it keeps only layouts whose predicted memory, HCCL's buffers included, leaves
# >= 5% of what torch_npu can allocate of a 910B (60.97 GiB) free, and
# ranks them by the step-time model (docs/step-time.md: compute with recompute, exposed TP /
# CP-ring / PP / DP communication, the pipeline bubble), which reproduces published 70B
# figures within 8%. For 256 NPUs it picks TP8 SP x PP2 x CP16 x DP1, no recompute (54.9 GiB,
# 6.0 GiB free, ~95 s per 32 x 128K-token step); next: recompute qkv (51.4 GiB, +2% time),
# attention (49.8 GiB, +20%), full (33.6 GiB, +32%). TP=, PP=, CP=, RECOMPUTE=, SHARDING= override it.
# Below 64 NPUs nothing fits without ZeRO-3: for 32 (NNODES=4) the planner picks TP2 SP x CP16,
# full recompute for 79 of 80 layers (none for the other), Megatron-FSDP's optim_grads_params sharded over the 16 CP ranks (docs/planner.md).
#   TP 8 + sequence parallel   one node's 8 NPUs share each layer (HCCS inside the node)
#   CP                         ring attention over 2*CP chunks: 131072 / CP tokens per rank
#   PP                         80 layers -> 80/PP per stage, 1F1B
#   DP = world / (TP*PP*CP)    distributed optimizer shards fp32 master weights + Adam over DP x CP
#   SHARDING                   none | optim_grads_params (ZeRO-3: also the weights and gradients,
#                              --use-megatron-fsdp) | optim_grads (ZeRO-2), over DP x CP
#   recompute                  none | qkv | attention (the attention sub-block keeps only its
#                              input) | full (the layer keeps only its input)
#
# Continued pretraining (Xiong et al. 2023; Fu et al. 2024): with HF_CHECKPOINT set, node 0
# converts the Hugging Face checkpoint once into $SAVE/hf_converted (`mcore-flash convert
# hf-to-mcore`, streamed; other nodes wait for it), the first launch trains from it with
# --finetune --use-checkpoint-args (iteration 0, fresh optimizer) and every later launch
# resumes from $SAVE. RoPE for 4K -> 128K, ROPE=:
#   abf (default)  --rotary-base 500000 ("adjusted base frequency", Llama-2-Long)
#   pi             --rotary-seq-len-interpolation-factor 32 (linear position interpolation)
#   llama3         --use-rope-scaling --rope-scaling-factor 16 (Llama-3.1's scheme; it assumes
#                  8192 original positions: use it with Llama-3 8K checkpoints)
#   none           the checkpoint's own RoPE
# Packed documents: DOCUMENT_MASKING=1 (default) attends within each document only
# (--reset-attention-mask --reset-position-ids --eod-mask-loss: documents end at EOD tokens,
# data preprocessed with --append-eod; every document split over the CP ranks); 0 attends
# across the whole 128K sample.
# HOST_MEMORY (e.g. 1.2TB; default the 910B profile's assumed 2 TiB) is each node's host memory
# for the planner: where fp32 optimizer state does not fit it, the plan keeps Adam's moments in
# bf16 on the host (--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16).
# Without HF_CHECKPOINT it trains from random weights. Export the result with
#   mcore-flash convert mcore-to-hf --load $SAVE --save-hf <dir>
# Extra flags after the script's name are passed on to `mcore-flash pretrain`.
set -euo pipefail

NPUS_PER_NODE=${NPUS_PER_NODE:-8}
# NUM_DEVICES (8, 16, 32, 64, 128, 256) sets the world size and the nodes it takes; else NNODES
if [[ -n "${NUM_DEVICES:-}" ]]; then
  NNODES=$(( (NUM_DEVICES + NPUS_PER_NODE - 1) / NPUS_PER_NODE ))
  (( NUM_DEVICES % NPUS_PER_NODE == 0 )) || { echo "NUM_DEVICES=$NUM_DEVICES: a multiple of NPUS_PER_NODE=$NPUS_PER_NODE" >&2; exit 2; }
fi
NNODES=${NNODES:-32}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((NNODES * NPUS_PER_NODE))

SEQ_LENGTH=131072
GLOBAL_BATCH=${GLOBAL_BATCH:-32}
MODEL=${MODEL:-llama2-70b}
case "$MODEL" in
  llama2-70b) DEFAULT_ROPE=abf ;;
  llama3.1-70b|qwen2.5-72b) DEFAULT_ROPE=none ;;
  *) echo "MODEL=$MODEL: choose llama2-70b, llama3.1-70b or qwen2.5-72b" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python}
# the planner's best fitting layout for this world size (pure Python, well under a second):
# TP PP CP, the sharding strategy, its rung, its limits (--distributed-timeout-minutes,
# HCCL_EXEC_TIMEOUT), then the recompute flags, "::", and the host-offload flags (optimizer,
# activations, bf16 gradients). The plan counts HCCL's buffers at the HCCL_BUFFSIZE exported below.
HCCL_BUFFSIZE=${HCCL_BUFFSIZE:-200}
read -r PLAN_TP PLAN_PP PLAN_CP PLAN_SHARDING PLAN_RUNG PLAN_TIMEOUT PLAN_HCCL_EXEC_TIMEOUT PLAN_REST < <(
  "$PYTHON" -m mcore_flash.planning.cli --search --model "$MODEL" --seq-length "$SEQ_LENGTH" \
    --num-devices "$WORLD_SIZE" --global-batch-size "$GLOBAL_BATCH" --hccl-buffsize "$HCCL_BUFFSIZE" \
    --hardware ascend-910b-64g ${HOST_MEMORY:+--host-memory "$HOST_MEMORY"} --top 1 --json |
  "$PYTHON" -c 'import json, sys; best = json.load(sys.stdin)["layouts"][0]; lay = best["layout"]
offload = best["offload_flags"] + best["gradient_flags"] + best["tiling_flags"] + best["streaming_flags"]
limits = best["timeouts"]
print(lay["tp"], lay["pp"], lay["cp"], lay["fsdp"] or "none", best["rung"].replace(" ", "-"),
      limits["distributed_timeout_minutes"], limits["hccl_exec_timeout_s"], *best["recompute_flags"], "::", *offload)'
) || { echo "mcore-flash plan --search found no layout of $WORLD_SIZE NPUs that fits their capacity with 5% free" >&2; exit 2; }
PLAN_RECOMPUTE_ARGS=${PLAN_REST%%::*}
read -r -a PLAN_OFFLOAD_ARGS <<< "${PLAN_REST#*::}"
echo "planner: $WORLD_SIZE NPUs -> TP$PLAN_TP x PP$PLAN_PP x CP$PLAN_CP, rung $PLAN_RUNG" >&2
TP=${TP:-$PLAN_TP}
PP=${PP:-$PLAN_PP}
CP=${CP:-$PLAN_CP}
SHARDING=${SHARDING:-$PLAN_SHARDING}
RECOMPUTE=${RECOMPUTE:-planner}  # planner: the plan's recompute flags (partial recompute included)
DATA_PATH=${DATA_PATH:-/data/${MODEL}_text_document}
SAVE=${SAVE:-/ckpt/$MODEL-128k}
HF_CHECKPOINT=${HF_CHECKPOINT:-}
if [[ "$MODEL" == llama2-70b ]]; then  # Llama-2's SentencePiece model; the others' tokenizer.json
  TOKENIZER_ARGS=(--tokenizer-type SentencePieceTokenizer
                  --tokenizer-model "${TOKENIZER_MODEL:-${HF_CHECKPOINT:-/models/llama-2-70b}/tokenizer.model}")
else
  TOKENIZER_ARGS=(--tokenizer-type HuggingFaceTokenizer
                  --tokenizer-model "${TOKENIZER_MODEL:-${HF_CHECKPOINT:-/models/$MODEL}}")
fi
ROPE=${ROPE:-$DEFAULT_ROPE}
DOCUMENT_MASKING=${DOCUMENT_MASKING:-1}

# Ascend runtime: expandable segments against fragmentation at 128K; HCCL's buffers as planned
# (each communicator holds 2 x HCCL_BUFFSIZE MB outside the allocator: HCCL's default 200, not
# more, as the plan's one-node layouts need the memory) and its wait in a collective above the
# predicted longest phase and below the watchdog's limit (docs/fault-tolerance.md).
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export HCCL_CONNECT_TIMEOUT=1800
# DISTRIBUTED_TIMEOUT_MINUTES= and HCCL_EXEC_TIMEOUT= override the plan's limits
DISTRIBUTED_TIMEOUT_MINUTES=${DISTRIBUTED_TIMEOUT_MINUTES:-$PLAN_TIMEOUT}
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-$PLAN_HCCL_EXEC_TIMEOUT}
(( HCCL_EXEC_TIMEOUT < DISTRIBUTED_TIMEOUT_MINUTES * 60 )) || echo "warning: HCCL_EXEC_TIMEOUT=$HCCL_EXEC_TIMEOUT s is not below --distributed-timeout-minutes $DISTRIBUTED_TIMEOUT_MINUTES: the watchdog will end a stuck collective before HCCL names it" >&2
export HCCL_BUFFSIZE
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TASK_QUEUE_ENABLE=2
export CPU_AFFINITY_CONF=1
export COMBINED_ENABLE=1

case "$RECOMPUTE" in
  planner) read -r -a RECOMPUTE_ARGS <<< "$PLAN_RECOMPUTE_ARGS" ;;
  none) RECOMPUTE_ARGS=() ;;
  qkv) RECOMPUTE_ARGS=(--recompute-granularity selective --recompute-modules qkv) ;;
  attention) RECOMPUTE_ARGS=(--recompute-granularity selective --recompute-modules core_attn) ;;
  full) RECOMPUTE_ARGS=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
  *) echo "RECOMPUTE=$RECOMPUTE: choose none, qkv, attention or full" >&2; exit 2 ;;
esac

# host offload (rungs 4-6: optimizer, activations, bf16 gradients, sequence tiles, weights
# streamed by torch FSDP2): the plan's flags, or OFFLOAD=none
OFFLOAD=${OFFLOAD:-planner}
case "$OFFLOAD" in
  planner) OFFLOAD_ARGS=("${PLAN_OFFLOAD_ARGS[@]}") ;;
  none) OFFLOAD_ARGS=() ;;
  *) echo "OFFLOAD=$OFFLOAD: choose planner or none" >&2; exit 2 ;;
esac

case "$SHARDING" in
  none) SHARDING_ARGS=(--use-distributed-optimizer --overlap-grad-reduce) ;;
  optim_grads_params|optim_grads) SHARDING_ARGS=(--use-distributed-optimizer --overlap-grad-reduce
                                                 --use-megatron-fsdp --data-parallel-sharding-strategy "$SHARDING") ;;
  *) echo "SHARDING=$SHARDING: choose none, optim_grads_params or optim_grads" >&2; exit 2 ;;
esac

case "$ROPE" in
  abf) ROPE_ARGS=(--rotary-base 500000) ;;
  pi) ROPE_ARGS=(--rotary-seq-len-interpolation-factor 32) ;;
  llama3) ROPE_ARGS=(--use-rope-scaling --rope-scaling-factor 16) ;;
  none) ROPE_ARGS=() ;;
  *) echo "ROPE=$ROPE: choose abf, pi, llama3 or none" >&2; exit 2 ;;
esac
case "$DOCUMENT_MASKING" in
  1) DOCUMENT_ARGS=(--reset-attention-mask --reset-position-ids --eod-mask-loss) ;;
  0) DOCUMENT_ARGS=() ;;
  *) echo "DOCUMENT_MASKING=$DOCUMENT_MASKING: choose 1 (attend within documents) or 0" >&2; exit 2 ;;
esac

# streamed weights (torch FSDP2) shard the optimizer themselves: no distributed optimizer
[[ " ${OFFLOAD_ARGS[*]} " == *" --use-torch-fsdp2 "* ]] && SHARDING_ARGS=()

ARGS=(
  --model "$MODEL"
  "${ROPE_ARGS[@]}"
  "${DOCUMENT_ARGS[@]}"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --tensor-model-parallel-size "$TP" --sequence-parallel
  --pipeline-model-parallel-size "$PP"
  --context-parallel-size "$CP" --cp-comm-type p2p
  "${SHARDING_ARGS[@]}"
  "${RECOMPUTE_ARGS[@]}"
  "${OFFLOAD_ARGS[@]}"
  --attention-backend npu
  --bf16
  --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH"
  --lr 1.0e-5 --min-lr 1.0e-6 --lr-decay-style cosine --lr-warmup-iters 100
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
  --train-iters 2000
  "${TOKENIZER_ARGS[@]}"
  --data-path "$DATA_PATH" --split 100,0,0
  --save "$SAVE" --save-interval 100 --log-interval 1
  --distributed-timeout-minutes "$DISTRIBUTED_TIMEOUT_MINUTES"
)

# Where training starts: $SAVE once it holds a checkpoint (resume), else the converted
# Hugging Face checkpoint (converted here once), else random weights.
CONVERTED=${CONVERTED:-$SAVE/hf_converted}
start_from() {
  if [[ -f "$SAVE/latest_checkpointed_iteration.txt" ]]; then
    LOAD_ARGS=(--load "$SAVE")
  elif [[ -n "$HF_CHECKPOINT" ]]; then
    if [[ ! -f "$CONVERTED/latest_checkpointed_iteration.txt" ]]; then
      if [[ "$NODE_RANK" == 0 ]]; then
        "$PYTHON" -m mcore_flash.cli convert hf-to-mcore --hf-dir "$HF_CHECKPOINT" --save "$CONVERTED" \
          --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --bf16
      else
        until [[ -f "$CONVERTED/latest_checkpointed_iteration.txt" ]]; do sleep 30; done
      fi
    fi
    LOAD_ARGS=(--load "$CONVERTED" --finetune --use-checkpoint-args)
  else
    LOAD_ARGS=()
  fi
}

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
      # the plan's layers to offload, of 80: one of the rehearsal's 2 per stage
      --activation-offload-layers) skip=1; REHEARSAL+=(--activation-offload-layers 1); continue;;
    esac
    REHEARSAL+=("$a")
  done
  # Megatron-FSDP and FSDP2 do not pipeline here (refused by name): they shard over DP2 x CP2
  REHEARSAL_PP=2
  [[ "$SHARDING" == none && ${#SHARDING_ARGS[@]} -gt 0 ]] || REHEARSAL_PP=1  # FSDP2 too
  REHEARSAL+=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size "$REHEARSAL_PP" --context-parallel-size 2
              --num-layers 4 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4 --num-query-groups 2
              --seq-length 128 --max-position-embeddings 128 --global-batch-size 2 --train-iters 2 --lr-warmup-iters 1
              --emulate-npu)
  SAVE=${REHEARSAL_SAVE:-$(mktemp -d)} NODE_RANK=0 TP=2 PP=$REHEARSAL_PP
  CONVERTED=$SAVE/hf_converted
  start_from
  REHEARSAL+=(--save "$SAVE" "${LOAD_ARGS[@]}")
  args=()
  for a in "$@"; do [[ "$a" == --rehearse ]] || args+=("$a"); done
  # one node: torchrun's --standalone store binds a free port itself
  OMP_NUM_THREADS=1 exec "${PYTHON:-python}" -m torch.distributed.run --standalone --local-addr 127.0.0.1 \
    --nproc-per-node 8 -m mcore_flash.pretrain "${REHEARSAL[@]}" "${args[@]}"
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

start_from
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  -m mcore_flash.pretrain "${ARGS[@]}" "${LOAD_ARGS[@]}" "$@"
