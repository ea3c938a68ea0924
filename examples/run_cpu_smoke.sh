#!/usr/bin/env bash
# Smoke run of upstream #1487's configuration scaled to a CPU machine: 8 CPU ranks
# as TP2 x SP x CP4 with --colocate, dynamic batches, per-token loss, the project's router and one
# embedded engine per rank, a tiny random-weight Qwen3 with the real Qwen tokenizer, 3 rollouts.
# Over Qwen's 151,936-token vocabulary a random model earns no math reward: this run shows the
# loop works, examples/run_cpu_demo.sh shows it learn.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/smoke}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1

[ -f "$OUT/tiny-qwen3/config.json" ] || $PY -m slime.tools.tiny_checkpoint --out "$OUT/tiny-qwen3"
[ -f "$OUT/prompts.jsonl" ] || $PY -m slime.tools.demo_prompts --out "$OUT/prompts.jsonl"
rm -f "$OUT/metrics.jsonl"

$PY train.py \
  --hf-checkpoint "$OUT/tiny-qwen3" \
  --prompt-data "$OUT/prompts.jsonl" --input-key prompt --label-key label --apply-chat-template \
  --rollout-shuffle --rm-type math \
  --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate \
  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 \
  --context-parallel-size 4 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1 \
  --use-dynamic-batch-size --max-tokens-per-gpu 96 --calculate-per-token-loss \
  --use-slime-router --rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.7 \
  --num-rollout 3 --rollout-batch-size 4 --n-samples-per-prompt 4 --num-steps-per-rollout 1 \
  --rollout-max-response-len 16 --rollout-temperature 1.0 \
  --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.01 --kl-loss-type low_var_kl \
  --entropy-coef 0.001 --attention-dropout 0.0 --hidden-dropout 0.0 \
  --optimizer adam --lr 1e-4 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 \
  --seed 1234 --fence-timeout "${FENCE_TIMEOUT:-120}" \
  --metrics-jsonl "$OUT/metrics.jsonl" "$@"
