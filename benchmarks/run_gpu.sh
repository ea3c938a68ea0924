#!/usr/bin/env bash
# One run: the fenced step on NCCL. Usage: benchmarks/run_gpu.sh PHASE... (bench keep equal faults fence)
#   bench   ~0.6B model, bf16, sleep/wake/train cycles per layout, process groups re-created every wake
#   keep    same model, keep-communicators mode (the default): fenced/unfenced A/B cycles, weight-sync cost
#   equal   tiny model, fp32, per layout; compare with the CPU run of the same flags (benchmarks/RESULTS.md)
#   faults  each SLIME_FAULT_INJECT kind must end with its named error inside the deadline
#   fence   benchmarks/bench_fence_overhead.py (pseudo-step, fenced vs unfenced)
# Layouts follow the GPU count: 4 GPUs -> TP1xCP4 and TP2xSPxCP2; 2 GPUs -> TP2xSP and CP2.
# Env: CYCLES (20, bench), KEEP_CYCLES (12, keep), AB_OFF (keep: variants among both fences ledger none, space-separated), WS_BENCH (1: weight-sync cost in keep),
#      NUM_SAMPLES (64), MIN_TOKENS / MAX_TOKENS (512 / 4096 per sample), TOKENS_PER_GPU (8192: --max-tokens-per-gpu),
#      BENCH_FROM (first layout index), BENCH_COUNT (layouts from there), BENCH_TIMEOUT (s per layout),
#      FAULT_TIMEOUT (--fence-timeout of the fault runs), FAULT_KINDS,
#      PROFILE (1: keep/bench runs under py-spy from .whl, split by variant with benchmarks/profile_split.py).
# Logs (and the fault runs' ledger files) end up in $OUT/logs.tgz ($OUT when set, else outputs/gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
if ls .whl/*.whl >/dev/null 2>&1; then  # megatron-core travels as a wheel (for a GPU machine without it and without network)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
fi
PYSPY_RATE=250
if [ "${PROFILE:-0}" = 1 ] && ! py-spy record -d 1 -o /tmp/pyspy_probe -- python3 -c 'import time; time.sleep(2)' >/dev/null 2>&1; then
  echo "WARNING: PROFILE=1 but py-spy cannot sample here (not in .whl, or no ptrace): running unprofiled"; PROFILE=0; fi
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$NGPU" -ge 4 ]; then NP=4; LAYOUTS=("--context-parallel-size 4" "--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2")
else NP=2; LAYOUTS=("--tensor-model-parallel-size 2 --sequence-parallel" "--context-parallel-size 2"); fi
COMMON="--use-dynamic-batch-size --calculate-per-token-loss"
RECREATE="--recreate-process-groups-on-wake"
PORT=29500
drv() { PORT=$((PORT + 7)); ${PROFILER:-} torchrun --nproc-per-node "$NP" --master-port "$PORT" benchmarks/gpu_fenced_step.py "$@"; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, megatron.core, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "megatron-core", megatron.core.__version__, "transformers", transformers.__version__)'
  date -u; } 2>&1 | tee "$OUT/env.txt"

for phase in "$@"; do case $phase in
bench|keep)
  if [ "$phase" = bench ]; then MODE="--recreate-process-groups-on-wake --cycles ${CYCLES:-20}"
  else MODE="--ab-fences --ab-off ${AB_OFF:-both} --cycles ${KEEP_CYCLES:-12}"
    [ "${WS_BENCH:-1}" = 1 ] && MODE="$MODE --bench-weight-sync"; fi
  i=${BENCH_FROM:-0}; for layout in "${LAYOUTS[@]:${BENCH_FROM:-0}:${BENCH_COUNT:-9}}"; do i=$((i + 1)); name=$phase$i
    PROFILER=""; [ "${PROFILE:-0}" = 1 ] && PROFILER="py-spy record --subprocesses --nonblocking --idle --threads \
      -r $PYSPY_RATE -f raw -o $OUT/$name.pyspy --"
    timeout ${BENCH_TIMEOUT:-290} bash -c "$(declare -f drv); PORT=$((PORT + 100 * i)); NP=$NP; PROFILER='$PROFILER'; drv --model-size 0.5b \
      --checkpoint-dir /tmp/ckpt05b --bench-fence-overhead --num-samples ${NUM_SAMPLES:-64} --min-tokens ${MIN_TOKENS:-512} \
      --max-tokens ${MAX_TOKENS:-4096} $layout $COMMON $MODE --max-tokens-per-gpu ${TOKENS_PER_GPU:-8192} --fence-timeout 120 --lr 1e-6 \
      --results-json $OUT/$name.json" 2>&1 | grep -v Warning > "$OUT/$name.log"; echo "$name rc=${PIPESTATUS[0]} layout: $layout"
    grep -h "SUMMARY\|FAILED" "$OUT/$name.log" | head -3
    [ -s "$OUT/$name.pyspy" ] && python3 benchmarks/profile_split.py "$OUT/$name.pyspy" "$OUT/$name.log" \
      --rate $PYSPY_RATE --top 25 | tee "$OUT/$name.profile.txt" | head -80
  done ;;
equal)
  i=0; for layout in "${LAYOUTS[@]}"; do i=$((i + 1))
    timeout 150 bash -c "$(declare -f drv); PORT=$((PORT + 300 + 10 * i)); NP=$NP; drv --model-size tiny --fp32 \
      --checkpoint-dir /tmp/ckpt_tiny --cycles 2 --num-samples 16 --min-tokens 64 --max-tokens 256 $layout $COMMON \
      $RECREATE --max-tokens-per-gpu 512 --fence-timeout 120 --lr 1e-4 --results-json $OUT/equal$i.json" \
      2>&1 | grep -v Warning > "$OUT/equal$i.log"
    echo "equal$i rc=${PIPESTATUS[0]} layout: $layout"; grep -h "CYCLE\|FAILED" "$OUT/equal$i.log" | cut -c1-200
  done ;;
faults)
  : > "$OUT/faults.txt"; rm -rf /tmp/ledgers
  for kind in ${FAULT_KINDS:-stall_comm_init diverge_plan extra_metric_key skip_collective stall_logging}; do
    start=$SECONDS
    SLIME_FAULT_INJECT="$kind@1#1" timeout 120 bash -c "$(declare -f drv); PORT=$((PORT + 400)); NP=$NP; drv --model-size tiny \
      --checkpoint-dir /tmp/ckpt_tiny --cycles 2 --num-samples 16 --min-tokens 64 --max-tokens 256 ${LAYOUTS[1]} $COMMON \
      $RECREATE --max-tokens-per-gpu 512 --fence-timeout ${FAULT_TIMEOUT:-20} --ledger-dir /tmp/ledgers/$kind" \
      > "$OUT/fault_$kind.log" 2>&1
    rc=$?; secs=$((SECONDS - start))
    line=$(grep -m1 -h "FAILED rank=\|^HANG:" "$OUT/fault_$kind.log" | cut -c1-300)
    echo "$kind rc=$rc wall_s=$secs :: $line" | tee -a "$OUT/faults.txt"
  done ;;
fence)
  timeout 120 torchrun --nproc-per-node "$NP" --master-port $((PORT + 500)) benchmarks/bench_fence_overhead.py \
    $( [ "$NP" -ge 4 ] && echo "--tp 2 --cp 2" || echo "--tp 2 --cp 1" ) 2>&1 | grep -v Warning | tail -8 | tee "$OUT/fence_overhead.txt" ;;
esac; done
rm -rf "$OUT/ledgers" && { [ ! -d /tmp/ledgers ] || cp -r /tmp/ledgers "$OUT/ledgers"; }
tar czf /tmp/gpu_logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu_logs.tgz "$OUT/logs.tgz"
