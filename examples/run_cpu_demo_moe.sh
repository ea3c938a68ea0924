#!/usr/bin/env bash
# The counting demo (examples/run_cpu_demo.sh) on a mixture of experts: a random-init tiny Qwen3-MoE
# (8 experts, top-2, softmax router renormalised over the two) over the 13-token character vocabulary,
# 8 CPU ranks as TP2 x SP x EP4 (experts over 4 expert-parallel ranks, each expert's rows over TP2) with
# --colocate, dynamic batches, per-token loss, the alltoall token dispatcher, the router and one embedded
# engine (transformers' Qwen3MoeForCausalLM) per rank. Writes $OUT/metrics.jsonl and $OUT/curves.png.
# Extra arguments go to train.py (later flags win), e.g.
#   --expert-model-parallel-size 2 --context-parallel-size 2   (EP2 x CP2 x TP2)
#   --use-rollout-routing-replay                               (replay the engines' routes)
set -euo pipefail
export OUT=${OUT:-outputs/demo_moe} MODEL_NAME=counting-moe TINY_ARGS="--num-experts 8 --moe-topk 2 --moe-ffn-hidden 64"
exec bash "$(dirname "$0")/run_cpu_demo.sh" \
  --context-parallel-size 1 --expert-model-parallel-size 4 --expert-tensor-parallel-size 2 \
  --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-router-dtype fp32 \
  --moe-aux-loss-coeff 0.0 --moe-router-load-balancing-type aux_loss "$@"
