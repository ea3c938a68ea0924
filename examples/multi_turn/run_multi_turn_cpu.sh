#!/usr/bin/env bash
# A multi-turn tool-calling rollout on the embedded CPU default: one training rank, one embedded engine,
# the tiny random Qwen3 with the real Qwen tokenizer. Tool replies are masked out of the loss (tool_call.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/multi_turn}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1

[ -f "$OUT/tiny-qwen3/config.json" ] || $PY -m slime.tools.tiny_checkpoint --out "$OUT/tiny-qwen3"
[ -f "$OUT/prompts.jsonl" ] || $PY -m slime.tools.demo_prompts --out "$OUT/prompts.jsonl"
printf 'multi_turn_tool_calls: 2\nmulti_turn_turn_tokens: 8\n' > "$OUT/multi_turn.yaml"
rm -f "$OUT/metrics.jsonl"

$PY train.py \
  --hf-checkpoint "$OUT/tiny-qwen3" \
  --prompt-data "$OUT/prompts.jsonl" --input-key prompt --label-key label --apply-chat-template \
  --custom-generate-function-path examples/multi_turn/tool_call.py:generate_with_tool \
  --custom-rm-path examples/multi_turn/tool_call.py:reward \
  --custom-config-path "$OUT/multi_turn.yaml" \
  --actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1 --use-slime-router \
  --use-dynamic-batch-size --max-tokens-per-gpu 1024 \
  --num-rollout 2 --rollout-batch-size 2 --n-samples-per-prompt 4 --num-steps-per-rollout 1 \
  --rollout-max-response-len 96 --rollout-temperature 1.0 \
  --advantage-estimator grpo --attention-dropout 0.0 --hidden-dropout 0.0 \
  --optimizer adam --lr 1e-4 --lr-decay-style constant --seed 1234 --fence-timeout "${FENCE_TIMEOUT:-120}" \
  --metrics-jsonl "$OUT/metrics.jsonl" "$@"
