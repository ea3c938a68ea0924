#!/usr/bin/env bash
# The colocated loop on 2 and 4 GPUs: `python train.py --colocate` with one engine per GPU, per layout:
#   tp2sp      TP2 x SP            (2 GPUs)
#   tp2spcp2   TP2 x SP x CP2      (4 GPUs)
#   cp4        TP1 x CP4           (4 GPUs)
# each ROLLOUTS rollouts (default 20) with --use-dynamic-batch-size --calculate-per-token-loss, then one
# injected fault (a rank stalled in communicator set-up, SLIME_FAULT_INJECT=stall_comm_init@1) that must end
# as a named error within the deadline. Layouts that need more GPUs than the machine has are skipped and
# said so. While each run goes, nvidia-smi is sampled every second (per GPU and per process), so each
# side's memory awake and asleep is read independently of the run's own figures.
#   bash benchmarks/run_colocate_layouts.sh                # on a GPU machine (.whl/ as gpu_setup.sh says)
#   DRY_RUN=1 bash benchmarks/run_colocate_layouts.sh      # rehearsal on CPU: the same commands, tiny model,
#                                                          # gloo ranks, 2 rollouts, no nvidia-smi
# Results: $OUT/<layout>/{metrics.jsonl,train.log,smi.csv,summary.txt} and $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu-colocate-layouts}
mkdir -p "$OUT"
STATUS=0
say() { echo "$*" | tee -a "$OUT/summary.txt"; }

if [ "${DRY_RUN:-0}" = 1 ]; then
  PY=${PY:-.venv/bin/python}; NGPU=${NGPU:-4}; ROLLOUTS=${ROLLOUTS:-2}
  MODEL=$OUT/tiny-counting; DEVICE=(--train-backend-device cpu); TIMEOUT=${TIMEOUT:-600}; FAULT_WINDOW=30
  [ -f "$MODEL/config.json" ] || "$PY" -m slime.tools.tiny_checkpoint --out "$MODEL" --alphabet 0123456789 > /dev/null
  smi_start() { :; }; smi_stop() { :; }
else
  source benchmarks/gpu_setup.sh || exit 1
  PY=python3; NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())'); ROLLOUTS=${ROLLOUTS:-20}
  MODEL=/tmp/colocate-counting-0.6b; DEVICE=(--bf16); TIMEOUT=${TIMEOUT:-420}; FAULT_WINDOW=60
  [ -f "$MODEL/config.json" ] || "$PY" -m slime.tools.tiny_checkpoint --out "$MODEL" --alphabet 0123456789 \
    --layers 24 --hidden 1024 --heads 16 --kv-heads 8 --head-dim 64 --ffn-hidden 3072 --seed 1234 > /dev/null
  smi_start() {  # $1: file; per GPU and per process, every second, until smi_stop
    ( while true; do
        ts=$(date +%s.%N)
        nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits | sed "s/^/$ts,gpu,/"
        nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits |
          while IFS=', ' read -r uuid pid mib; do  # the process's role from its command line
            role=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -o 'embedded_engine\|sglang\|TrainRayActor\|train.py' | head -1)
            echo "$ts,proc,$uuid,$pid,$mib,${role:-other}"
          done
        sleep 1
      done ) > "$1" 2>/dev/null &
    SMI_PID=$!
  }
  smi_stop() { kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null; }
fi
"$PY" -m slime.tools.demo_prompts --task counting --n 400 --out "$OUT/counting.jsonl" > /dev/null || exit 1

# train LAYOUT_NAME NGPUS EXTRA_ENV FLAGS...: one colocated run, one engine per GPU
train() {
  local name=$1 gpus=$2 env=$3; shift 3
  local dir=$OUT/$name; mkdir -p "$dir"
  if [ "$gpus" -gt "$NGPU" ]; then say "SKIPPED $name: needs $gpus GPUs, the machine has $NGPU"; return 0; fi
  say "== $name ($gpus GPUs): $*"
  smi_start "$dir/smi.csv"
  env $env timeout -k 10 "$TIMEOUT" "$PY" train.py --hf-checkpoint "$MODEL" --rollout-backend embedded \
    --prompt-data "$OUT/counting.jsonl" --input-key prompt --label-key label --rollout-shuffle \
    --custom-rm-path examples.counting_reward.reward \
    --actor-num-nodes 1 --actor-num-gpus-per-node "$gpus" --colocate --rollout-num-gpus-per-engine 1 \
    --use-dynamic-batch-size --max-tokens-per-gpu 8192 --calculate-per-token-loss --use-slime-router \
    --num-rollout "$ROLLOUTS" --rollout-batch-size 8 --n-samples-per-prompt 8 --num-steps-per-rollout 2 \
    --rollout-max-response-len 3 --rollout-temperature 1.0 --advantage-estimator grpo \
    --optimizer adam --lr "${LR:-1e-4}" --lr-decay-style constant "${DEVICE[@]}" \
    --attention-dropout 0.0 --hidden-dropout 0.0 --seed 1234 \
    --ledger-dir "$dir/ledger" --metrics-jsonl "$dir/metrics.jsonl" "$@" > "$dir/train.log" 2>&1
  local rc=$?
  smi_stop
  echo "$rc" > "$dir/rc"
  say "$name rc=$rc; $(grep -h 'training stopped' "$dir/train.log" | tail -1 | cut -c1-400)"
  return "$rc"
}

summarize() {  # per rollout: reward, log-prob diff, sync vs actor_train, memory (colocate_summary.py)
  local dir=$OUT/$1
  [ -s "$dir/metrics.jsonl" ] || return 0
  "$PY" benchmarks/colocate_summary.py "$dir/metrics.jsonl" > "$dir/summary.txt" 2>&1
  tail -n 4 "$dir/summary.txt" | sed "s/^/  $1: /" | tee -a "$OUT/summary.txt"
  [ -s "$dir/smi.csv" ] && "$PY" benchmarks/smi_summary.py "$dir/smi.csv" | sed "s/^/  $1 smi: /" | tee -a "$OUT/summary.txt"
}

for layout in "tp2sp 2 --tensor-model-parallel-size 2 --sequence-parallel" \
              "tp2spcp2 4 --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2" \
              "cp4 4 --context-parallel-size 4"; do
  set -- $layout
  name=$1 gpus=$2; shift 2
  train "$name" "$gpus" "" --fence-timeout 120 "$@" || STATUS=1
  summarize "$name"
done

# The fault: rank 1 never finishes communicator warm-up; the run must stop with a named error in time.
gpus=$(( NGPU >= 4 ? 4 : 2 ))
start=$SECONDS
train fault "$gpus" "SLIME_FAULT_INJECT=stall_comm_init@1" --fence-timeout "$FAULT_WINDOW" \
  --tensor-model-parallel-size 2 --sequence-parallel $([ "$gpus" -ge 4 ] && echo --context-parallel-size 2)
rc=$?
if [ "$rc" -ne 0 ] && grep -q "training stopped: .*rank" "$OUT/fault/train.log"; then
  say "fault: ended as a named error after $((SECONDS - start)) s (window ${FAULT_WINDOW} s)"
else
  say "FAILED fault: rc=$rc, no named error in $OUT/fault/train.log"; STATUS=1
fi
exit $STATUS
