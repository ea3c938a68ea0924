#!/usr/bin/env bash
# One run (<= 9 minutes): attention and fenced-step figures, old vs new path, one run each.
#   bash benchmarks/run_step_bench_gpu.sh            (with .whl/ beside it; results under $OUT)
# Phases, each under its own deadline inside BUDGET_S (default 530 s):
#   attention   benchmarks/bench_step_gpu.py attention: CP1 and a CP2 rank, 16k and 32k tokens, 0.6B and 4B heads
#   step06      qwen3-0.6b step, fused vs new vs old (S06_PATHS), with a sync audit and one profiled cycle
#   moe         Qwen3-30B-A3B-shaped MoE step (8 of 48 layers, EP1), grouped vs sequential experts (SMOE_PATHS;
#               grouped-base: the grouped step before the fused AdamW and the other launch savings):
#               TFLOP/s of the active parameters, peak memory, loss / grad-norm parity, a profiled grouped cycle;
#               before it, benchmarks/check_grouped_experts_gpu.py (grouped_mm vs loop at one expert layer)
#   moeoffload  the same MoE step (grouped experts; SMO_PATHS) with Adam's state and update on the host:
#               --optimizer-cpu-offload --use-precision-aware-optimizer --overlap-cpu-optimizer-d2h-h2d (SMO_EXTRA adds
#               flags, e.g. --optimizer-offload-fraction 0.5); MEMORY adds the host peak. The host optimizer runs on
#               OMP_NUM_THREADS threads (default 4 here: give it the machine's cores for this phase).
#               SMOE_MODEL=qwen3-30b-a3b-4l (4 of the 48 layers) runs moe and moeoffload on a shape where both fit one H100
#   moefused    the same MoE step on the fused path (--fused-kernels compile: norms, RoPE, the experts' weighted
#               SwiGLU, the log-prob head compiled), its first cycle the compile (90-101 s on one H200: give SMF_CAP
#               >= 250 for timed cycles); SMF_PATHS="fused grouped sequential" compares the three in one process
#   glm         GLM-4.7-Flash-shaped MoE step (8 of 47 layers: MLA, 64 experts top-4 sigmoid router + shared expert,
#               the first MLP dense; EP1), grouped experts (GLM_PATHS adds sequential), a profiled cycle
#   dsv4        (only when PHASES names it) DeepSeek-V4-Flash-shaped step (4 of 43 layers at its widths: compressed
#               sparse / heavily compressed attention with the indexer, 4 hyper-connection streams, 32 of its 256
#               experts top-6 + a shared one, the first layer hash-routed; EP1), grouped experts (V4_PATHS), a
#               profiled cycle; V4_TOKENS_PER_GPU / V4_MIN_TOKENS / V4_MAX_TOKENS size it
#   gptoss      (only when PHASES names it) gpt-oss-20b-shaped step (4 of 24 layers at its widths: sliding-window and
#               full attention alternating, attention sinks, 32 biased experts of 2880 top-4 behind the biased router,
#               the clamped SwiGLU; EP1; ~80 GiB static: an H200), grouped experts (OSS_PATHS), a profiled cycle
#   gdn         benchmarks/bench_gated_delta_gpu.py: the gated DeltaNet's kernel alone, fla's kernels with the project's
#               chunk_bwd_dqkwg (fla-dqkwg) vs the compiled rule, errors of every gradient vs fp64 (GDN_JOBS: its --jobs)
#   qwen35      Qwen3.5-4B-sized hybrid step (16 of 32 layers: 12 gated DeltaNet, 4 gated attention; fused path,
#               recompute of 1 layer), the DeltaNet on its auto kernel vs the compiled rule (Q35D_PATHS, default
#               "fused fused@compiled"; PATH@KERNEL: bench_step_gpu.py --paths), loss / grad-norm parity (--lr 0)
#   qwen35moe   Qwen3.5-35B-A3B-shaped hybrid MoE step (4 of 40 layers: 3 gated DeltaNet, 1 gated attention; 256
#               experts top-8 + a gated shared expert; EP1; peak ~104 GiB: an H200), grouped experts with the DeltaNet
#               on its auto kernel vs the compiled rule (Q35_PATHS, default "grouped grouped@compiled"; "grouped
#               sequential" compares the experts), eager kernels (Q35_KERNELS=compile: the fused path), Q35_EXTRA more
#               flags (--profile: the first path's kernels)
#   compile     the fused path's first step (0.6B) in two fresh processes sharing one empty inductor cache dir
#               (TORCHINDUCTOR_CACHE_DIR): cold, then warm; COMPILE lines
#   lora        the qwen3-4b step (new path) twice: every parameter trained, then LoRA adapters only (rank 16 on the
#               four linear targets): MEMORY lines, peak and static (parameters, gradient buffers, optimizer state)
#   step4b      qwen3-4b step with --max-tokens-per-gpu 32768 and full recompute (the fit check), fused vs new
#               (S4B_PATHS; S4B_RECOMPUTE replaces the recompute flags);
#               if it runs out of memory, step4b16k repeats it at 16384 so the 4B figures exist
# Layout: 1 GPU -> TP1; N > 1 GPUs -> TPN x SP (LAYOUT overrides). Env overrides: BUDGET_S, S06_* and S4B_*
# (NUM_SAMPLES, MIN_TOKENS, MAX_TOKENS, TOKENS_PER_GPU, CYCLES, CAP: the phase's seconds), ATTN_TOKENS, PY, OUT.
# Everything measured lands in $OUT: <phase>.log, <phase>.json, env.txt, summary.txt (the RATIO/MEMORY/FIT/SYNC lines).
# Exit code: 0 when every phase ran, 1 when one failed, 2 when something the run needs is missing.
# DRY_RUN=1 PY=.venv/bin/python bash benchmarks/run_step_bench_gpu.sh: the same script on CPU at tiny shapes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/step_bench}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # less fragmentation at 32k tokens
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
START=$SECONDS
BUDGET_S=${BUDGET_S:-530}
fatal() { echo "FATAL: $*" | tee -a "$OUT/summary.txt"; exit 2; }
left() { echo $((BUDGET_S - (SECONDS - START))); }

# megatron-core travels as a wheel (for a GPU machine without it and without network); installing it must not be skipped silently
if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  ls .whl/megatron_core-*.whl >/dev/null 2>&1 || fatal "megatron-core is not importable and .whl/ holds no megatron_core wheel (benchmarks/fetch_gpu_wheels.sh makes it)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/megatron_core-*.whl || fatal "pip could not install .whl/megatron_core-*.whl"
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# flash-linear-attention (fla-core, pure Python, with einops) travels the same way where .whl/ holds it; without it
# the gated DeltaNet runs the project's compiled rule (its log line says so)
if ! "$PY" -c "import fla" 2>/dev/null && ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/fla_core-*.whl $(ls .whl/einops-*.whl 2>/dev/null) || fatal "pip could not install .whl/fla_core-*.whl"
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
"$PY" -c "import megatron.core, transformers, safetensors, torch.distributed.run" || fatal "a required package does not import (above)"
if [ "${DRY_RUN:-0}" = 1 ]; then
  NGPU=1 M06=tiny M4B=tiny MMOE=tiny-moe MGLM=tiny-glm-moe-lite MQ35=tiny-hybrid-moe MV4=tiny-deepseek-v4 MOSS=tiny-gpt-oss ATTN=(--device cpu --tokens 64 --shapes 4:2:16 --reps 1) SMI=true
  export V4_MIN_TOKENS=64 V4_MAX_TOKENS=128 V4_TOKENS_PER_GPU=256 V4_CYCLES=1
  export OSS_MIN_TOKENS=64 OSS_MAX_TOKENS=128 OSS_TOKENS_PER_GPU=256 OSS_CYCLES=1
  export S06_MIN_TOKENS=64 S06_MAX_TOKENS=128 S06_TOKENS_PER_GPU=256 S06_CYCLES=1
  export S4B_MIN_TOKENS=200 S4B_MAX_TOKENS=240 S4B_TOKENS_PER_GPU=256 S4B_CYCLES=1
  export SMOE_MIN_TOKENS=64 SMOE_MAX_TOKENS=128 SMOE_TOKENS_PER_GPU=256 SMOE_CYCLES=1
  export GLM_MIN_TOKENS=64 GLM_MAX_TOKENS=128 GLM_TOKENS_PER_GPU=256 GLM_CYCLES=1
  export Q35_MIN_TOKENS=64 Q35_MAX_TOKENS=128 Q35_TOKENS_PER_GPU=256 Q35_CYCLES=1
  export Q35D_MIN_TOKENS=64 Q35D_MAX_TOKENS=128 Q35D_TOKENS_PER_GPU=256 Q35D_CYCLES=1
  GDN=(--device cpu) MQ35D=tiny-hybrid GDN_OLD=torch  # CPU: the eager rule stands in for the compiled one
  export CMP_MIN_TOKENS=64 CMP_MAX_TOKENS=128 CMP_TOKENS_PER_GPU=256
  export LORA_MIN_TOKENS=64 LORA_MAX_TOKENS=128 LORA_TOKENS_PER_GPU=256
else
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())') || fatal "torch does not start"
  [ "$NGPU" -ge 1 ] || fatal "no GPU visible to torch"
  M06=qwen3-0.6b M4B=qwen3-4b MMOE=${SMOE_MODEL:-qwen3-30b-a3b-8l} MGLM=glm-4.7-flash-8l MQ35=qwen3.5-35b-a3b-4l MV4=deepseek-v4-flash-4l MOSS=gpt-oss-20b-4l ATTN=(--tokens ${ATTN_TOKENS:-16384 32768} --shapes 16:8:128 32:8:128) SMI=nvidia-smi
  GDN=() MQ35D=qwen3.5-4b-16l GDN_OLD=compiled
fi
TORCHRUN=("$PY" -m torch.distributed.run --nproc-per-node "$NGPU")
if [ "$NGPU" -gt 1 ]; then LAYOUT=${LAYOUT:---tensor-model-parallel-size $NGPU --sequence-parallel}; else LAYOUT=${LAYOUT:-}; fi
{ $SMI --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c 'import torch, megatron.core, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "megatron-core", megatron.core.__version__, "transformers", transformers.__version__)'
  "$PY" -c 'import flash_attn; print("flash-attn", flash_attn.__version__)' 2>/dev/null || echo "flash-attn: not installed (SDPA kernels)"
  "$PY" -c 'import fla, triton; print("fla-core", fla.__version__, "triton", triton.__version__)' 2>/dev/null || echo "fla-core: not installed"
  "$PY" -c 'import torch; from slime.models import gated_delta_rule as g; print("gated DeltaNet auto choice:", g.active_kernel(torch.device("cuda" if torch.cuda.is_available() else "cpu")))' 2>&1 | tail -1
  echo "gpus $NGPU layout '${LAYOUT}'"; date -u; } 2>&1 | tee "$OUT/env.txt"

STATUS=0
# Why a phase exited non-zero, in the summary itself: its exit code read, then the end of its log.
explain_failure() {
  local name=$1 rc=$2 log=$3 why="exit code $rc"
  [ "$rc" -eq 124 ] && why="timed out (exit 124)"; [ "$rc" -eq 137 ] && why="killed (exit 137: out of time or memory)"
  echo "FAILED $name: $why; the last lines of $log:"; tail -n 15 "$log" | cut -c1-300 | sed 's/^/  | /'
}
summarize() { grep -h "^RATIO\|^WARMUP_PROFILE\|^KERNELS\|^COMPILE_COUNTERS\|^HOST\|^MEMORY\|^FIT\|^PARITY\|^GROUPED_CHECK\|^SYNC\|^PROFILE\|^OOM\|^FAILED\|^MISMATCH\|^STOPPED\|^ROW\|^GRADS\|^ERRORS\|^auto choice\|^device \|gated delta rule on" "$OUT/$1.log" | cut -c1-900 | tee -a "$OUT/summary.txt"; }
# run NAME CAP_S CMD...: the command under min(CAP_S, time left - 10 s), its output in $OUT/NAME.log
run() {
  local name=$1 cap=$2; shift 2
  local limit=$(( $(left) - 10 )); [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$limit" -lt 30 ]; then echo "SKIPPED $name: $(left) s left" | tee -a "$OUT/summary.txt"; STATUS=1; return 1; fi
  echo "== $name (limit ${limit}s, $(left)s left): $*" | tee -a "$OUT/summary.txt"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc after $((SECONDS - START))s" | tee -a "$OUT/summary.txt"
  summarize "$name"
  [ "$rc" -eq 0 ] || { STATUS=1; explain_failure "$name" "$rc" "$OUT/$name.log" | tee -a "$OUT/summary.txt"; }
  return "$rc"
}
step() {  # step NAME CAP_S PREFIX MODEL FLAGS...: one torchrun of the step benchmark; its own cycle budget
  local name=$1 cap=$2 prefix=$3 model=$4; shift 4  # stays 30 s inside the phase's deadline
  local v=${prefix}_NUM_SAMPLES; local n=${!v}; v=${prefix}_MIN_TOKENS; local lo=${!v}; v=${prefix}_MAX_TOKENS; local hi=${!v}
  v=${prefix}_CYCLES; local cycles=${!v}
  local limit=$(( $(left) - 10 )); [ "$limit" -gt "$cap" ] && limit=$cap
  run "$name" "$limit" "${TORCHRUN[@]}" --master-port $((29600 + RANDOM % 200)) benchmarks/bench_step_gpu.py step \
    --model "$model" --num-samples "$n" --min-tokens "$lo" --max-tokens "$hi" --cycles "$cycles" \
    --time-budget-s $((limit - 30)) --results-json "$OUT/$name.json" $LAYOUT "$@"
}


# PHASES picks phases (default all): e.g. PHASES=moe runs only the MoE step
want() { [ -z "${PHASES:-}" ] || [[ " $PHASES " == *" $1 "* ]]; }
want attention && run attention "${ATTN_CAP:-100}" "$PY" benchmarks/bench_step_gpu.py attention "${ATTN[@]}" ${ATTN_EXTRA:-} --results-json "$OUT/attention.json"

SMOE_NUM_SAMPLES=${SMOE_NUM_SAMPLES:-4} SMOE_MIN_TOKENS=${SMOE_MIN_TOKENS:-6144} SMOE_MAX_TOKENS=${SMOE_MAX_TOKENS:-8192}
SMOE_CYCLES=${SMOE_CYCLES:-2}
if want moe; then  # Qwen3-30B-A3B-shaped MoE step (8 layers, 128 experts, top-8, EP1): grouped vs sequential experts
  [ "${DRY_RUN:-0}" = 1 ] || [ "${MOE_CHECK:-1}" = 0 ] || run moecheck 60 "$PY" benchmarks/check_grouped_experts_gpu.py
  # --lr 0: every cycle trains the same weights, so PARITY compares the two paths' loss and grad norm
  step moe "${SMOE_CAP:-300}" SMOE "$MMOE" --paths ${SMOE_PATHS:-grouped sequential} --profile ${SMOE_EXTRA:-} --lr 0 --moe-grouped-gemm \
    --max-tokens-per-gpu "${SMOE_TOKENS_PER_GPU:-8192}" --moe-token-dispatcher-type alltoall --moe-router-dtype fp32 \
    --use-distributed-optimizer
fi
if want moeoffload; then  # the same step, the optimizer's state and update on the host (what fits an 80 GB card)
  step moeoffload "${SMO_CAP:-300}" SMOE "$MMOE" --paths ${SMO_PATHS:-grouped} --lr 0 --moe-grouped-gemm \
    --max-tokens-per-gpu "${SMOE_TOKENS_PER_GPU:-8192}" --moe-token-dispatcher-type alltoall --moe-router-dtype fp32 \
    --use-distributed-optimizer --optimizer-cpu-offload --use-precision-aware-optimizer --overlap-cpu-optimizer-d2h-h2d \
    ${SMO_EXTRA:-}
fi
if want moefused; then  # the same step with the compiled kernels on top of the grouped experts
  step moefused "${SMF_CAP:-240}" SMOE "$MMOE" --paths ${SMF_PATHS:-fused} --lr 0 --moe-grouped-gemm \
    --max-tokens-per-gpu "${SMOE_TOKENS_PER_GPU:-8192}" --moe-token-dispatcher-type alltoall --moe-router-dtype fp32 \
    --use-distributed-optimizer
fi
if want glm; then  # GLM-4.7-Flash-shaped MoE step (8 layers: MLA, 64 experts top-4 + shared expert, EP1)
  GLM_NUM_SAMPLES=${GLM_NUM_SAMPLES:-4} GLM_MIN_TOKENS=${GLM_MIN_TOKENS:-6144} GLM_MAX_TOKENS=${GLM_MAX_TOKENS:-8192}
  GLM_CYCLES=${GLM_CYCLES:-2}
  step glm "${GLM_CAP:-200}" GLM "$MGLM" --paths ${GLM_PATHS:-grouped} --profile --lr 0 --moe-grouped-gemm \
    --max-tokens-per-gpu "${GLM_TOKENS_PER_GPU:-8192}" --moe-token-dispatcher-type alltoall --moe-router-dtype fp32 \
    --use-distributed-optimizer
fi
if [[ " ${PHASES:-} " == *" dsv4 "* ]]; then  # DeepSeek-V4-Flash-shaped step: named phase only (not in the default run)
  V4_NUM_SAMPLES=${V4_NUM_SAMPLES:-4} V4_MIN_TOKENS=${V4_MIN_TOKENS:-6144} V4_MAX_TOKENS=${V4_MAX_TOKENS:-8192}
  V4_CYCLES=${V4_CYCLES:-2}
  step dsv4 "${V4_CAP:-420}" V4 "$MV4" --paths ${V4_PATHS:-grouped} --profile ${V4_EXTRA:-} --lr 0 --moe-grouped-gemm \
    --max-tokens-per-gpu "${V4_TOKENS_PER_GPU:-8192}" --moe-token-dispatcher-type alltoall --moe-router-dtype fp32 \
    --use-distributed-optimizer
fi
if [[ " ${PHASES:-} " == *" gptoss "* ]]; then  # gpt-oss-20b-shaped step: named phase only (not in the default run)
  OSS_NUM_SAMPLES=${OSS_NUM_SAMPLES:-4} OSS_MIN_TOKENS=${OSS_MIN_TOKENS:-6144} OSS_MAX_TOKENS=${OSS_MAX_TOKENS:-8192}
  OSS_CYCLES=${OSS_CYCLES:-2}
  step gptoss "${OSS_CAP:-360}" OSS "$MOSS" --paths ${OSS_PATHS:-grouped} --profile ${OSS_EXTRA:-} --lr 0 \
    --moe-grouped-gemm --max-tokens-per-gpu "${OSS_TOKENS_PER_GPU:-8192}" --moe-token-dispatcher-type alltoall \
    --moe-router-dtype fp32 --use-distributed-optimizer
fi

# the gated DeltaNet kernel alone (no megatron): fla-dqkwg vs the compiled rule, every gradient against fp64
want gdn && run gdn "${GDN_CAP:-400}" "$PY" benchmarks/bench_gated_delta_gpu.py ${GDN[@]+"${GDN[@]}"} --budget-s "${GDN_BUDGET_S:-300}" \
  ${GDN_JOBS:+--jobs $GDN_JOBS}

if want qwen35; then  # the Qwen3.5-4B-sized hybrid step (RESULTS.md "Qwen3.5: a hybrid ... step"), DeltaNet new vs old
  Q35D_NUM_SAMPLES=${Q35D_NUM_SAMPLES:-4} Q35D_MIN_TOKENS=${Q35D_MIN_TOKENS:-12288} Q35D_MAX_TOKENS=${Q35D_MAX_TOKENS:-16384}
  Q35D_CYCLES=${Q35D_CYCLES:-2}
  step qwen35 "${Q35D_CAP:-420}" Q35D "$MQ35D" --paths ${Q35D_PATHS:-fused fused@$GDN_OLD} ${Q35D_EXTRA:-} --lr 0 \
    --max-tokens-per-gpu "${Q35D_TOKENS_PER_GPU:-8192}" \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
fi

if want qwen35moe; then  # a Qwen3.5-MoE-shaped hybrid step: DeltaNet layers and 256 experts (4 layers fit one H200)
  Q35_NUM_SAMPLES=${Q35_NUM_SAMPLES:-4} Q35_MIN_TOKENS=${Q35_MIN_TOKENS:-6144} Q35_MAX_TOKENS=${Q35_MAX_TOKENS:-8192}
  Q35_CYCLES=${Q35_CYCLES:-2}
  step qwen35moe "${Q35_CAP:-300}" Q35 "$MQ35" --paths ${Q35_PATHS:-grouped grouped@$GDN_OLD} ${Q35_EXTRA:-} --lr 0 --moe-grouped-gemm \
    --max-tokens-per-gpu "${Q35_TOKENS_PER_GPU:-8192}" --moe-token-dispatcher-type alltoall --moe-router-dtype fp32 \
    --use-distributed-optimizer --fused-kernels "${Q35_KERNELS:-eager}"
fi

if want lora; then  # trainer memory of the 4B step, every parameter trained vs LoRA adapters (rank 16, four targets)
  LORA_NUM_SAMPLES=${LORA_NUM_SAMPLES:-2} LORA_MIN_TOKENS=${LORA_MIN_TOKENS:-6144} LORA_MAX_TOKENS=${LORA_MAX_TOKENS:-8192}
  LORA_CYCLES=1
  step lora_full "${LORA_CAP:-110}" LORA "$M4B" --paths new --max-tokens-per-gpu "${LORA_TOKENS_PER_GPU:-8192}"
  step lora_adapters "${LORA_CAP:-110}" LORA "$M4B" --paths new --max-tokens-per-gpu "${LORA_TOKENS_PER_GPU:-8192}" \
    --enable-lora --lora-rank 16 --lora-alpha 32 --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2
fi

if want compile; then  # the fused path's first step in a fresh process: an empty compile cache, then the same cache
  CACHE=$(mktemp -d /tmp/inductor_cache.XXXX)
  CMP_NUM_SAMPLES=${CMP_NUM_SAMPLES:-4} CMP_MIN_TOKENS=${CMP_MIN_TOKENS:-12288} CMP_MAX_TOKENS=${CMP_MAX_TOKENS:-16384}
  CMP_CYCLES=1
  for kind in ${CMP_KINDS:-cold warm}; do
    t0=$SECONDS
    export TORCHINDUCTOR_CACHE_DIR=$CACHE
    extra=(); [ "$kind" = warm-profiled ] && extra=(--profile-warmup)
    step "compile_$kind" "${CMP_CAP:-150}" CMP "$M06" --paths fused \
      --max-tokens-per-gpu "${CMP_TOKENS_PER_GPU:-16384}" "${extra[@]}"
    "$PY" - "$OUT/compile_$kind.json" "$kind" $((SECONDS - t0)) "$CACHE" <<'PY' | tee -a "$OUT/summary.txt"
import json, subprocess, sys
path, kind, process_s, cache = sys.argv[1:]
cycles = json.load(open(path))["cycles"]
first = next(c for c in cycles if c["kind"] == "warmup")
steady = [c["step_s"] for c in cycles if c["kind"] == "timed"]
size = subprocess.run(["du", "-sh", cache], capture_output=True, text=True).stdout.split()[0]
print(f"COMPILE {kind}: first fused step {first['wall_s']:.1f} s, steady step {steady[0] if steady else float('nan'):.2f} s, "
      f"whole process {process_s} s (start-up, first step, one more); cache {cache} {size}")
PY
  done
  unset TORCHINDUCTOR_CACHE_DIR
fi
want step06 || want step4b || { echo "done after $((SECONDS - START))s, status $STATUS" | tee -a "$OUT/summary.txt"; exit "$STATUS"; }

S06_NUM_SAMPLES=${S06_NUM_SAMPLES:-6} S06_MIN_TOKENS=${S06_MIN_TOKENS:-12288} S06_MAX_TOKENS=${S06_MAX_TOKENS:-16384}
S06_CYCLES=${S06_CYCLES:-3}
step step06 "${S06_CAP:-170}" S06 "$M06" --paths ${S06_PATHS:-fused new old} --max-tokens-per-gpu "${S06_TOKENS_PER_GPU:-16384}" \
  --sync-audit --profile

S4B_NUM_SAMPLES=${S4B_NUM_SAMPLES:-2} S4B_MIN_TOKENS=${S4B_MIN_TOKENS:-24576} S4B_MAX_TOKENS=${S4B_MAX_TOKENS:-30720}
S4B_CYCLES=${S4B_CYCLES:-2}
RECOMPUTE=${S4B_RECOMPUTE:-"--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"}
step step4b "${S4B_CAP:-210}" S4B "$M4B" --paths ${S4B_PATHS:-fused new} --max-tokens-per-gpu "${S4B_TOKENS_PER_GPU:-32768}" $RECOMPUTE
if grep -q "^OOM" "$OUT/step4b.log"; then  # out of memory at 32k: the same at 16k, so 4B figures exist
  S4B_MIN_TOKENS=12288 S4B_MAX_TOKENS=16384
  step step4b16k 170 S4B "$M4B" --paths ${S4B_PATHS:-fused new} --max-tokens-per-gpu 16384 $RECOMPUTE
fi

echo "done after $((SECONDS - START))s, status $STATUS" | tee -a "$OUT/summary.txt"
exit "$STATUS"
