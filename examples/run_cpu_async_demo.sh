#!/usr/bin/env bash
# train_async.py learns the demo task on a CPU machine: 4 CPU ranks as TP2 x SP x CP2 train while 2 embedded
# engines of their own (--rollout-num-gpus 2, no --colocate) generate the next rollout (upstream's one-step-off
# schedule); weights reach the engines over the distributed group (gloo). Task, model, reward and every other
# flag are examples/run_cpu_demo.sh's. Writes $OUT/metrics.jsonl and $OUT/curves.png.
# Extra arguments go to train_async.py (later flags win), e.g. --update-weights-interval 2, or
# --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async.
# SCRIPT=train.py with --colocate runs the same job colocated (benchmarks/bench_async_overlap.py).
set -euo pipefail
export SCRIPT=${SCRIPT:-train_async.py} COLOCATE="" OUT=${OUT:-outputs/async-demo}
exec bash "$(dirname "$0")/run_cpu_demo.sh" \
  --actor-num-gpus-per-node 4 --rollout-num-gpus 2 --rollout-num-gpus-per-engine 1 --context-parallel-size 2 "$@"
