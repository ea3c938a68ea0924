#!/usr/bin/env bash
# The loop visibly learns, in upstream #1487's layout on a CPU machine: 8 CPU ranks
# as TP2 x SP x CP4 with --colocate, dynamic batches, per-token loss, the project's router and one
# embedded engine over the 8 ranks' GPUs. Task: continue a run of digits ("345" -> "678"), graded digit
# by digit by the reward plugin examples/counting_reward.py. Model: a random-init tiny Qwen3 over a
# 13-token character vocabulary. Writes $OUT/metrics.jsonl and $OUT/curves.png.
# Extra arguments go to train.py (later flags win), e.g. --kl-loss-coef 0 --entropy-coef 0.
# SCRIPT (default train.py) and COLOCATE (default --colocate) let examples/run_cpu_async_demo.sh reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/demo}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the reward plugin is imported as examples.counting_reward

SEED=${SEED:-1234}
MODEL="$OUT/${MODEL_NAME:-counting-model}-seed$SEED"  # random init: the seed picks the initial weights too
# TINY_ARGS: more flags for the tiny checkpoint (examples/run_cpu_demo_moe.sh makes a mixture of experts)
[ -f "$MODEL/config.json" ] || $PY -m slime.tools.tiny_checkpoint --out "$MODEL" --alphabet 0123456789 --seed "$SEED" \
  ${TINY_ARGS:-}
[ -f "$OUT/counting.jsonl" ] || $PY -m slime.tools.demo_prompts --task counting --n 200 --out "$OUT/counting.jsonl"
rm -f "$OUT/metrics.jsonl"

$PY "${SCRIPT:-train.py}" \
  --hf-checkpoint "$MODEL" \
  --prompt-data "$OUT/counting.jsonl" --input-key prompt --label-key label \
  --rollout-shuffle --custom-rm-path examples.counting_reward.reward \
  --actor-num-nodes 1 --actor-num-gpus-per-node 8 ${COLOCATE---colocate} \
  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 \
  --context-parallel-size 4 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1 \
  --use-dynamic-batch-size --max-tokens-per-gpu 96 --calculate-per-token-loss \
  --use-slime-router --rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.7 \
  --num-rollout "${NUM_ROLLOUT:-20}" --rollout-batch-size 8 --n-samples-per-prompt 8 --num-steps-per-rollout 2 \
  --rollout-max-response-len 3 --rollout-temperature 1.0 \
  --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.01 --kl-loss-type low_var_kl \
  --entropy-coef 0.001 --attention-dropout 0.0 --hidden-dropout 0.0 \
  --optimizer adam --lr 3e-3 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 \
  --seed "$SEED" --fence-timeout "${FENCE_TIMEOUT:-120}" \
  --metrics-jsonl "$OUT/metrics.jsonl" "$@"

# Curves per rollout (reward, loss, grad norm, log-prob diff, weight-sync and actor_train seconds).
$PY -m slime.tools.plot_metrics "$OUT/metrics.jsonl" --out "$OUT"
echo "curves: $OUT/curves.png"
