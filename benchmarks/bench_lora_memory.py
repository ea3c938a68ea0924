"""Trainer memory with and without LoRA (not a test): one rank builds a Qwen3 of the given shape, takes one
training step, and reports the bytes of its parameters, gradient buffers and optimizer state, and the peak
(CUDA: max allocated; CPU: the process's peak RSS growth over the build and step). The frozen base holds no
gradient buffer and no optimizer state; the adapters are all the optimizer sees.

    python benchmarks/bench_lora_memory.py                                   # CPU, a tiny shape
    python benchmarks/bench_lora_memory.py --device cuda --shape 4b --bf16   # one GPU, a Qwen3-4B shape
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from mp_utils import run_ranks  # noqa: E402
from train_step_harness import make_rollout  # noqa: E402

SHAPES = {  # Qwen3 config fields
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=32, vocab_size=4096),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936),
}


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_state_bytes(optimizer) -> int:
    import torch

    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            total += _tensor_bytes(v for v in state.values() if isinstance(v, torch.Tensor))
        total += _tensor_bytes(p for p in getattr(opt, "fp32_from_float16_groups", [[]])[0])  # bf16 main params
    return total


def _child(rank, world, hf_dir, lora: bool, device: str, bf16: bool, rank_r: int) -> dict:
    import copy

    import torch

    if device == "cuda":
        torch.cuda.set_device(0)
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from train_step_harness import build_loaded_model, layout_args, plans_for_this_rank

    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    args = layout_args(dict(enable_lora=lora, lora_target_modules=["linear_qkv", "linear_proj", "linear_fc1",
                                                                     "linear_fc2"],
                            lora_rank=rank_r, lora_alpha=2.0 * rank_r, lora_dropout=0.0, lr=1e-4, bf16=bf16,
                            max_tokens_per_gpu=512))
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    data = make_rollout(num_samples=4, seed=0, vocab=1000, max_len=256)
    (plan,) = plans_for_this_rank(data, args)
    data = copy.deepcopy(data)
    rows = compute_log_probs(model, data, plan, args)
    data["log_probs"] = data["ref_log_probs"] = data["rollout_log_probs"] = rows
    train_one_step(model, optimizer, scheduler, data, plan, args)
    params = [p for chunk in model for p in chunk.parameters()]
    grads = [b.grad_data for chunk in model for b in chunk.buffers] if hasattr(model[0], "buffers") else []
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_start) * 1024)
    return dict(params=_tensor_bytes(params), trainable=_tensor_bytes(p for p in params if p.requires_grad),
                grads=_tensor_bytes(grads), optimizer=_optimizer_state_bytes(optimizer), peak=peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=16)
    cli = parser.parse_args()
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        config = Qwen3Config(**SHAPES[cli.shape], max_position_embeddings=4096, tie_word_embeddings=False)
        with torch.device("cpu"):
            Qwen3ForCausalLM(config).to(torch.bfloat16 if cli.bf16 else torch.float32).save_pretrained(tmp)
        rows = {}
        for lora in (False, True):  # a fresh process each: the peaks do not mix
            rows[lora] = run_ranks(_child, 1, args=(tmp, lora, cli.device, cli.bf16, cli.lora_rank),
                                   timeout_s=1800)[0]
    gib = 1024 ** 3
    print(f"shape {cli.shape}, device {cli.device}, {'bf16' if cli.bf16 else 'fp32'}, LoRA rank {cli.lora_rank}")
    print(f"{'':>18} {'full':>12} {'LoRA':>12} {'LoRA / full':>12}")
    for key in ("params", "trainable", "grads", "optimizer", "peak"):
        full, adapted = rows[False][key], rows[True][key]
        ratio = adapted / full if full else float("nan")
        print(f"{key + ' GiB':>18} {full / gib:12.4f} {adapted / gib:12.4f} {ratio:12.3f}")


if __name__ == "__main__":
    main()
