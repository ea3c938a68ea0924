#!/usr/bin/env bash
# One run of the colocated loop on a GPU machine. Usage: benchmarks/run_colocate_gpu.sh PHASE...
#   memory  trainer sleep/wake on a ~0.6B bf16 model under torchrun (1 rank per GPU): memory figures per
#           cycle, and parameters + optimizer state compared element-wise across one sleep/wake
#   engine  the embedded engine on CUDA: device memory awake vs released, same greedy outputs after resume
#   loop    python train.py --colocate: trainer and engine share every GPU, ROLLOUTS rollouts (default 24);
#           LOOP_EXTRA adds flags, LOOP_TAG names its outputs (loop$LOOP_TAG.log, loop${LOOP_TAG}_metrics.jsonl)
#   moe-replay  the loop on a Qwen3-MoE-shaped model (32 experts, top-4), bf16, twice: without and with
#           --use-rollout-routing-replay; train/train_rollout_logprob_abs_diff of each (ROLLOUTS, default 8);
#           MOE_EXTRA adds flags (e.g. --no-moe-grouped-gemm), MOE_TAG names its outputs, MOE_REPLAYS picks "off on"
#   loop-qwen3.5  the loop on a Qwen3.5-shaped hybrid written by transformers' Qwen3_5ForCausalLM (Qwen3.5-0.8B's
#           widths, 3 gated DeltaNet : 1 gated attention, QWEN35_LAYERS layers, default 24; the demo's characters),
#           ROLLOUTS rollouts (default 8); outputs loop_qwen3.5*
#   loop-vl  the colocated loop with images on one GPU: upstream's geo3k VLM job shrunk as examples/run_cpu_geo3k_vlm.sh
#           (GRPO on the square-counting pictures, --multimodal-keys, the vision tower trained) on a tiny random-init
#           vision + text checkpoint (VL_KIND, default qwen3-vl-moe: Qwen3-VL's tower and deepstack, fused experts;
#           qwen3.5-vl-moe is the CPU example's), bf16, ROLLOUTS rollouts (default 20): reward, the trainer/engine
#           log-prob diff and the weight-sync proof of every push, seconds per phase; outputs loop_vl*
#   push    the loop's model pushed into one embedded engine on the same GPU, shared-memory file vs CUDA IPC
#           side by side (benchmarks/bench_weight_push_gpu.py), next to the GPU's copy bandwidth
#   digest  the weight-sync proof's tensor digest on the GPU: equal to the host's for every dtype and layout, and its
#           throughput over a 0.6B-shaped body (benchmarks/bench_tensor_digest_gpu.py); the loop's summary prints the
#           proof's seconds per push beside actor_train (weight_sync/proof_seconds)
#   proof   the weight-sync proof's parts on the loop's model, one embedded engine on the same GPU: the sender's wait
#           for its digests, the engine's /weights_checker call, a control round trip, HTTP calls per push, and the
#           push's wall-clock time with the proof off and on (benchmarks/bench_weight_proof.py)
#   footprint  a trainer-like process's device memory outside PyTorch's allocator, item by item
#           (context, cuBLAS, attention, NCCL; benchmarks/footprint_gpu.py), with NCCL's default channels and with one
#   logprobs  the loop's model on one GPU: engine, transformers and megatron log-probs of the same generated
#           tokens in bf16 and fp32 (benchmarks/logprob_parity.py), which side of the loop's diff is off
# Prepare .whl/ with benchmarks/fetch_gpu_wheels.sh and copy it along. Results land in $OUT when set, or
# outputs/gpu-colocate.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu-colocate}
mkdir -p "$OUT"
source benchmarks/gpu_setup.sh || exit 1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
CKPT=/tmp/colocate-0.5b
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, megatron.core, transformers, ray; print("torch", torch.__version__, "cuda", torch.version.cuda, "megatron-core", megatron.core.__version__, "transformers", transformers.__version__, "ray", ray.__version__)'
  date -u; } 2>&1 | tee "$OUT/env.txt"

checkpoint() {  # a ~0.6B Qwen3-shaped random checkpoint with the Qwen tokenizer (engines need one)
  [ -f $CKPT/tokenizer.json ] && return
  python3 - <<'PY'
import sys
sys.path.insert(0, "benchmarks")
from pathlib import Path
from gpu_fenced_step import write_random_checkpoint
from slime.tools.qwen_tokenizer_files import save_hf_tokenizer
write_random_checkpoint("/tmp/colocate-0.5b", "0.5b")
save_hf_tokenizer(Path("/tmp/colocate-0.5b"), 4096)
PY
}

MODEL=/tmp/colocate-counting-0.6b
counting_model() {  # the loop's model: a Qwen3-0.6B-shaped body over the demo's character vocabulary
  [ -f $MODEL/config.json ] || python3 -m slime.tools.tiny_checkpoint --out $MODEL --alphabet 0123456789 \
    --layers 24 --hidden 1024 --heads 16 --kv-heads 8 --head-dim 64 --ffn-hidden 3072 --seed 1234 > /dev/null
  python3 -m slime.tools.demo_prompts --task counting --n 400 --out /tmp/counting.jsonl > /dev/null
}

# The learnable counting task (examples/run_cpu_demo.sh) on $MODEL (by default a Qwen3-0.6B-shaped body: 24 layers,
# hidden 1024, 16/8 heads, FFN 3072) over the demo's character vocabulary, random init, bf16: rewards
# vary inside groups from rollout 0, so every step moves the weights and a push that lost them
# would show in train/train_rollout_logprob_abs_diff.
run_loop() {
  timeout ${LOOP_TIMEOUT:-480} python3 train.py --hf-checkpoint $MODEL --rollout-backend embedded \
    --prompt-data /tmp/counting.jsonl --input-key prompt --label-key label --rollout-shuffle \
    --custom-rm-path examples.counting_reward.reward \
    --actor-num-nodes 1 --actor-num-gpus-per-node "$NGPU" --colocate --rollout-num-gpus-per-engine 1 \
    ${LAYOUT:-} --use-dynamic-batch-size --max-tokens-per-gpu 8192 --calculate-per-token-loss --use-slime-router \
    --num-rollout ${ROLLOUTS:-24} --rollout-batch-size 8 --n-samples-per-prompt 8 --num-steps-per-rollout 2 \
    --rollout-max-response-len 3 --rollout-temperature 1.0 \
    --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.01 --kl-loss-type low_var_kl --entropy-coef 0.001 \
    --optimizer adam --lr ${LR:-1e-4} --lr-decay-style constant --bf16 \
    --attention-dropout 0.0 --hidden-dropout 0.0 --fence-timeout 120 --seed 1234 ${LOOP_EXTRA:-} \
    --metrics-jsonl "$OUT/loop${LOOP_TAG:-}_metrics.jsonl" > "$OUT/loop${LOOP_TAG:-}.log" 2>&1
  echo "loop${LOOP_TAG:-} rc=$?"; grep -h "training stopped\|Traceback\|Error" "$OUT/loop${LOOP_TAG:-}.log" | head -5
  python3 benchmarks/colocate_summary.py "$OUT/loop${LOOP_TAG:-}_metrics.jsonl" | tee "$OUT/loop${LOOP_TAG:-}_summary.txt"
}

QWEN35=/tmp/colocate-counting-qwen3.5
qwen35_model() {  # the counting task's tokenizer and ids, the body a random-init Qwen3_5ForCausalLM
  [ -f $QWEN35/config.json ] && return
  python3 -m slime.tools.tiny_checkpoint --out $QWEN35 --alphabet 0123456789 --seed 1234 > /dev/null
  QWEN35_LAYERS=${QWEN35_LAYERS:-24} python3 - $QWEN35 <<'PY'
import json, os, sys
from pathlib import Path
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
out = Path(sys.argv[1])
ids = json.loads((out / "config.json").read_text())
generation = (out / "generation_config.json").read_text()
layers = int(os.environ["QWEN35_LAYERS"])
config = Qwen3_5TextConfig(
    vocab_size=ids["vocab_size"], pad_token_id=ids["pad_token_id"], bos_token_id=ids["bos_token_id"],
    eos_token_id=ids["eos_token_id"], hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=4096,
    tie_word_embeddings=True, architectures=["Qwen3_5ForCausalLM"])
torch.manual_seed(1234)
model = Qwen3_5ForCausalLM(config)
model.save_pretrained(out)
(out / "generation_config.json").write_text(generation)
print(f"Qwen3.5 counting model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {layers} layers")
PY
}

VL_MODEL=/tmp/colocate-squares-${VL_KIND:-qwen3-vl-moe}
squares_task() {  # the tiny vision + text checkpoint and the square-counting prompts as JSONL (no pyarrow needed)
  python3 -c 'import PIL' 2>/dev/null || { echo "loop-vl: Pillow is not importable (images are decoded and drawn with it); carry its cp312 wheel in .whl/"; return 1; }
  [ -f $VL_MODEL/config.json ] || python3 -m slime.tools.tiny_vl_checkpoint --out $VL_MODEL --kind ${VL_KIND:-qwen3-vl-moe} \
    --seed 1234 > /dev/null || return 1
  python3 - <<'PY'
import base64, json
from slime.tools.square_images import make_rows
with open("/tmp/squares.jsonl", "w") as f:
    for row in make_rows(256, seed=0):
        f.write(json.dumps({**row, "images": [base64.b64encode(i).decode() for i in row["images"]]}) + "\n")
PY
}

for phase in "$@"; do case $phase in
loop-vl)
  squares_task || exit 1
  rm -f "$OUT/loop_vl_metrics.jsonl"  # the metrics sink appends
  timeout ${LOOP_TIMEOUT:-480} python3 train.py --hf-checkpoint $VL_MODEL --rollout-backend embedded \
    --prompt-data /tmp/squares.jsonl --input-key prompt --label-key label --apply-chat-template \
    --multimodal-keys '{"image": "images"}' --rollout-shuffle --custom-rm-path examples.square_count_reward.reward \
    --actor-num-nodes 1 --actor-num-gpus-per-node 1 --colocate --rollout-num-gpus-per-engine 1 --use-slime-router \
    --use-dynamic-batch-size --max-tokens-per-gpu 4096 --calculate-per-token-loss \
    --num-rollout ${ROLLOUTS:-20} --rollout-batch-size 8 --n-samples-per-prompt 8 --global-batch-size 64 \
    --rollout-max-response-len 2 --rollout-temperature 1.0 \
    --advantage-estimator grpo --kl-loss-coef 0.00 --kl-coef 0.00 --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28 \
    --optimizer adam --lr ${LR:-3e-3} --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 \
    --bf16 --attention-dropout 0.0 --hidden-dropout 0.0 --fence-timeout 120 --seed 1234 ${LOOP_EXTRA:-} \
    --metrics-jsonl "$OUT/loop_vl_metrics.jsonl" > "$OUT/loop_vl.log" 2>&1
  echo "loop-vl rc=$?"; grep -h "training stopped\|Traceback\|Error" "$OUT/loop_vl.log" | head -5
  python3 benchmarks/colocate_summary.py "$OUT/loop_vl_metrics.jsonl" | tee "$OUT/loop_vl_summary.txt" ;;
loop-qwen3.5)
  qwen35_model || exit 1
  python3 -m slime.tools.demo_prompts --task counting --n 400 --out /tmp/counting.jsonl > /dev/null
  MODEL=$QWEN35 LOOP_TAG=_qwen3.5 ROLLOUTS=${ROLLOUTS:-8} run_loop ;;
push)
  counting_model
  timeout ${PUSH_TIMEOUT:-200} python3 benchmarks/bench_weight_push_gpu.py --checkpoint $MODEL --repeats ${REPEATS:-5} \
    --json "$OUT/push.json" > "$OUT/push.log" 2>&1
  echo "push rc=$?"; grep -h "WEIGHT_PUSH\|Error" "$OUT/push.log" | cut -c1-400 ;;
proof)
  counting_model
  timeout ${PROOF_TIMEOUT:-300} python3 benchmarks/bench_weight_proof.py --device cuda --checkpoint $MODEL \
    --repeats ${REPEATS:-5} --json "$OUT/proof.json" > "$OUT/proof.log" 2>&1
  echo "proof rc=$?"; grep -h "WEIGHT_PROOF\|Error" "$OUT/proof.log" | cut -c1-400 ;;
digest)
  timeout ${DIGEST_TIMEOUT:-240} python3 benchmarks/bench_tensor_digest_gpu.py --repeats ${REPEATS:-5} \
    --json "$OUT/digest.json" > "$OUT/digest.log" 2>&1
  echo "digest rc=$?"; grep -h "DIGEST_GPU\|Error" "$OUT/digest.log" | cut -c1-400 ;;
footprint)
  for ctas in 0 1; do  # NCCL's default channels, then one (the trainer's default for groups of one rank)
    timeout ${FOOTPRINT_TIMEOUT:-120} python3 benchmarks/footprint_gpu.py --max-ctas $ctas \
      --json "$OUT/footprint_ctas$ctas.json" > "$OUT/footprint_ctas$ctas.log" 2>&1
    echo "footprint --max-ctas $ctas rc=$?"; grep -h "FOOTPRINT\|Error" "$OUT/footprint_ctas$ctas.log" | cut -c1-300
  done ;;
logprobs)
  counting_model
  timeout ${LOGPROBS_TIMEOUT:-180} python3 benchmarks/logprob_parity.py --model-path $MODEL --prompts /tmp/counting.jsonl \
    --num-prompts 64 --results-json "$OUT/logprobs.json" > "$OUT/logprobs.log" 2>&1
  echo "logprobs rc=$?"; grep -h "LOGPROB_PARITY\|Error" "$OUT/logprobs.log" | cut -c1-300 ;;
memory)
  checkpoint
  timeout ${MEMORY_TIMEOUT:-240} torchrun --nproc-per-node "$NGPU" --master-port 29611 benchmarks/gpu_fenced_step.py \
    --model-size 0.5b --checkpoint-dir $CKPT --cycles ${CYCLES:-4} --check-wake-exact --num-samples 16 \
    --min-tokens 512 --max-tokens 4096 --use-dynamic-batch-size --max-tokens-per-gpu 8192 --calculate-per-token-loss \
    --fence-timeout 120 --lr 1e-6 --results-json "$OUT/memory.json" 2>&1 | grep -v Warning > "$OUT/memory.log"
  echo "memory rc=${PIPESTATUS[0]}"; grep -h "WAKE_EXACT\|SUMMARY\|FAILED" "$OUT/memory.log" | cut -c1-1500 ;;
engine)
  checkpoint
  timeout ${ENGINE_TIMEOUT:-240} python3 benchmarks/engine_memory.py --model-path $CKPT --device cuda --dtype bfloat16 \
    --results-json "$OUT/engine.json" > "$OUT/engine.log" 2>&1
  echo "engine rc=$?"; grep -h "ENGINE_MEMORY\|Error" "$OUT/engine.log" | cut -c1-1500 ;;
moe-replay)
  MOE_MODEL=/tmp/colocate-counting-moe
  [ -f $MOE_MODEL/config.json ] || python3 -m slime.tools.tiny_checkpoint --out $MOE_MODEL --alphabet 0123456789 \
    --layers 8 --hidden 1024 --heads 16 --kv-heads 8 --head-dim 64 --num-experts 32 --moe-topk 4 \
    --moe-ffn-hidden 512 --seed 1234 > /dev/null
  python3 -m slime.tools.demo_prompts --task counting --n 400 --out /tmp/counting.jsonl > /dev/null
  for replay in ${MOE_REPLAYS:-off on}; do
    tag=${replay}${MOE_TAG:-}
    extra=(); [ $replay = on ] && extra=(--use-rollout-routing-replay)
    rm -f "$OUT/moe_replay_$tag.jsonl"  # the metrics sink appends: a second run on the same machine starts afresh
    timeout ${MOE_TIMEOUT:-280} python3 train.py --hf-checkpoint $MOE_MODEL --rollout-backend embedded \
      --prompt-data /tmp/counting.jsonl --input-key prompt --label-key label --rollout-shuffle \
      --custom-rm-path examples.counting_reward.reward \
      --actor-num-nodes 1 --actor-num-gpus-per-node "$NGPU" --colocate --rollout-num-gpus-per-engine 1 \
      ${LAYOUT:-} --use-dynamic-batch-size --max-tokens-per-gpu 8192 --calculate-per-token-loss --use-slime-router \
      --num-experts 32 --moe-router-topk 4 --moe-token-dispatcher-type alltoall "${extra[@]}" ${MOE_EXTRA:-} \
      --num-rollout ${ROLLOUTS:-8} --rollout-batch-size 8 --n-samples-per-prompt 8 --num-steps-per-rollout 2 \
      --rollout-max-response-len 3 --rollout-temperature 1.0 \
      --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.01 --kl-loss-type low_var_kl --entropy-coef 0.001 \
      --optimizer adam --lr ${LR:-1e-4} --lr-decay-style constant --bf16 \
      --attention-dropout 0.0 --hidden-dropout 0.0 --fence-timeout 120 --seed 1234 \
      --metrics-jsonl "$OUT/moe_replay_$tag.jsonl" > "$OUT/moe_replay_$tag.log" 2>&1
    echo "moe-replay $tag rc=$?"; grep -h "training stopped\|Traceback\|Error" "$OUT/moe_replay_$tag.log" | head -5
    python3 - "$OUT/moe_replay_$tag.jsonl" "$tag" <<'PY'
import json, statistics, sys
diffs = [e["train/train_rollout_logprob_abs_diff"] for e in map(json.loads, open(sys.argv[1]))
         if e.get("event") == "train" and "train/train_rollout_logprob_abs_diff" in e]
train_s = [e["perf/actor_train_s"] for e in map(json.loads, open(sys.argv[1]))
           if e.get("event") == "train" and "perf/actor_train_s" in e][1:]  # the first rollout compiles
print(f"MOE_REPLAY {sys.argv[2]}: rollouts {len(diffs)} logprob_abs_diff mean {statistics.mean(diffs):.3e} "
      f"max {max(diffs):.3e}; actor_train median after the first {statistics.median(train_s) if train_s else float('nan'):.3f} s"
      if diffs else f"MOE_REPLAY {sys.argv[2]}: no train events")
PY
  done ;;
loop)
  counting_model
  run_loop ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac; done
