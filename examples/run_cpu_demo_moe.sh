#!/usr/bin/env bash
# The counting demo (examples/run_cpu_demo.sh) on a mixture of experts: a random-init tiny Qwen3-MoE
# (8 experts, top-2, softmax router renormalised over the two) over the 13-token character vocabulary,
# 8 CPU ranks as TP2 x SP x EP4 (experts split over 4 expert-parallel ranks, each expert's rows over
# TP2) with --colocate, dynamic batches, per-token loss, the alltoall token dispatcher, the router and
# one embedded engine (transformers' Qwen3MoeForCausalLM) per rank. Writes $OUT/metrics.jsonl and
# $OUT/curves.png. Extra arguments go to train.py (later flags win), e.g.
#   --expert-model-parallel-size 2 --context-parallel-size 2   (EP2 x CP2 x TP2)
#   --use-rollout-routing-replay                               (replay the engines' routes)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/demo_moe}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the reward plugin is imported as examples.counting_reward

SEED=${SEED:-1234}
MODEL="$OUT/counting-moe-seed$SEED"  # random init: the seed picks the initial weights too
[ -f "$MODEL/config.json" ] || $PY -m slime.tools.tiny_checkpoint --out "$MODEL" --alphabet 0123456789 --seed "$SEED" \
  --num-experts 8 --moe-topk 2 --moe-ffn-hidden 64
[ -f "$OUT/counting.jsonl" ] || $PY -m slime.tools.demo_prompts --task counting --n 200 --out "$OUT/counting.jsonl"
rm -f "$OUT/metrics.jsonl"

$PY train.py \
  --hf-checkpoint "$MODEL" \
  --prompt-data "$OUT/counting.jsonl" --input-key prompt --label-key label \
  --rollout-shuffle --custom-rm-path examples.counting_reward.reward \
  --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate \
  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 \
  --context-parallel-size 1 --expert-model-parallel-size 4 --expert-tensor-parallel-size 2 \
  --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-router-dtype fp32 \
  --moe-aux-loss-coeff 0.0 --moe-router-load-balancing-type aux_loss \
  --use-dynamic-batch-size --max-tokens-per-gpu 96 --calculate-per-token-loss \
  --use-slime-router --rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.7 \
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
