#!/usr/bin/env bash
# Upstream #1487's 8-GPU configuration on a cluster node with SGLang installed (TransformerEngine is not
# needed: the default layer spec is local; docs/cluster.md). Not yet run end to end on 8 GPUs (README,
# "Where it has run"). HF, DATA and OUT are placeholders.
# Model flags are Qwen3-4B's own config.json: 36 layers, hidden 2560, 32 query / 8 KV heads of 128,
# FFN 9728, rope base 1e6, and TIED embeddings (tie_word_embeddings: true), so no
# --untie-embeddings-and-output-weights: the model builder refuses a flag that contradicts the checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${HF:-/models/Qwen3-4B}
DATA=${DATA:-/data/dapo-math-17k.jsonl}
OUT=${OUT:-outputs/issue1487}
mkdir -p "$OUT"

MODEL_ARGS=(
  --swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728
  --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
  --use-rotary-position-embeddings --rotary-base 1000000 --disable-bias-linear --qk-layernorm
  --normalization RMSNorm --norm-epsilon 1e-6 --vocab-size 151936
)
python train.py "${MODEL_ARGS[@]}" \
  --hf-checkpoint "$HF" --ref-load "$HF" \
  --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle \
  --rm-type deepscaler --num-rollout 3000 \
  --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate \
  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 \
  --context-parallel-size 4 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1 \
  --rollout-batch-size 16 --n-samples-per-prompt 64 --rollout-max-response-len 40000 \
  --rollout-temperature 1.0 --num-steps-per-rollout 1 \
  --use-dynamic-batch-size --max-tokens-per-gpu 32768 --calculate-per-token-loss \
  --use-slime-router --rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.7 \
  --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.0 --kl-loss-type low_var_kl \
  --entropy-coef 0.0 --eps-clip 0.2 --eps-clip-high 0.28 \
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 \
  --bf16 --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 \
  --attention-softmax-in-fp32 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --fence-timeout 600 --metrics-jsonl "$OUT/metrics.jsonl" --ledger-dir "$OUT/ledger" "$@"
