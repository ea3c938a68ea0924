#!/usr/bin/env bash
# Upstream's geo3k VLM job (examples/geo3k_vlm/run_geo3k_qwen35.sh: Qwen3.5-35B-A3B with images, GRPO, colocated,
# TP2 x SP x EP) with its flags, shrunk to 4 CPU ranks: a random-init tiny Qwen3.5-MoE with its vision tower
# (python -m slime.tools.tiny_vl_checkpoint --kind qwen3.5-vl-moe: one DeltaNet and one gated attention layer,
# 4 experts, a 2-block vision tower) learns the square-counting picture task (python -m slime.tools.square_images:
# "<image>how many red squares?", parquet rows with an `images` column, as geo3k's), graded by
# examples/square_count_reward.py instead of geo3k's --rm-type deepscaler (a random model writes no boxed answer).
# The trainer builds the vision tower in front of the text model and trains both (--freeze-params-name-list visual
# freezes the tower); one embedded engine serves transformers' composite class with the images.
# Writes $OUT/metrics.jsonl and $OUT/curves.png. Extra arguments go to train.py (later flags win), e.g.
#   --context-parallel-size 2   (TP2 x SP x CP2 x EP2 on the same 4 ranks)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/geo3k_vlm}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the reward plugin is imported as examples.square_count_reward

SEED=${SEED:-1234}
MODEL="$OUT/${MODEL_NAME:-squares-vl-moe}-seed$SEED"
[ -f "$MODEL/config.json" ] || $PY -m slime.tools.tiny_vl_checkpoint --out "$MODEL" --kind qwen3.5-vl-moe --seed "$SEED"
[ -f "$OUT/train/squares.parquet" ] || $PY -m slime.tools.square_images --out "$OUT/train" --n 256 --seed 0
[ -f "$OUT/test/squares.parquet" ] || $PY -m slime.tools.square_images --out "$OUT/test" --n 16 --seed 1
rm -f "$OUT/metrics.jsonl"

MODEL_ARGS=(--spec slime_plugins.models.qwen3_5_vl get_qwen3_5_vl_model_provider)  # sizes: from config.json
CKPT_ARGS=(--hf-checkpoint "$MODEL")
ROLLOUT_ARGS=(
   --prompt-data "$OUT/train/squares.parquet" --input-key prompt --label-key label --apply-chat-template
   --rollout-shuffle --custom-rm-path examples.square_count_reward.reward
   --num-rollout "${NUM_ROLLOUT:-20}" --rollout-batch-size 8 --n-samples-per-prompt 8
   --rollout-max-response-len 2 --rollout-temperature 1.0 --global-batch-size 64
)
MULTIMODAL_KEYS='{"image": "images"}'
EVAL_ARGS=(
   --eval-interval "${EVAL_INTERVAL:-10}" --eval-prompt-data squares "$OUT/test/squares.parquet"
   --n-samples-per-eval-prompt 1 --eval-max-response-len 2
)
GRPO_ARGS=(
   --advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00 --entropy-coef 0.00
   --eps-clip 0.2 --eps-clip-high 0.28
)
OPTIMIZER_ARGS=(  # upstream's, but a random model's learning rate (upstream's 35B model takes 1e-6)
   --optimizer adam --lr 3e-3 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
)
SGLANG_ARGS=(--rollout-num-gpus-per-engine 4 --sglang-mem-fraction-static 0.7)
BACKEND_ARGS=(
   --train-backend megatron --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
   --context-parallel-size 1 --expert-model-parallel-size 2 --expert-tensor-parallel-size 1
   --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
   --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
   --micro-batch-size 1 --use-dynamic-batch-size --max-tokens-per-gpu 256 --calculate-per-token-loss
)

$PY "${SCRIPT:-train.py}" \
  --actor-num-nodes 1 --actor-num-gpus-per-node 4 --colocate --use-slime-router \
  --multimodal-keys "$MULTIMODAL_KEYS" \
  "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${GRPO_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" "${BACKEND_ARGS[@]}" \
  --seed "$SEED" --fence-timeout "${FENCE_TIMEOUT:-120}" --metrics-jsonl "$OUT/metrics.jsonl" "$@"

$PY -m slime.tools.plot_metrics "$OUT/metrics.jsonl" --out "$OUT"
echo "curves: $OUT/curves.png"
