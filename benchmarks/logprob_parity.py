"""Which side of train/train_rollout_logprob_abs_diff is off: engine, transformers and megatron log-probs
of the same generated tokens, from the same weights, in bf16 and fp32 (one process; CUDA when present).

    python benchmarks/logprob_parity.py --model-path DIR [--prompts counting.jsonl] [--results-json F]

The embedded engine generates (bf16, temperature 1, its own KV-cached decode) and reports the log-prob
of each sampled token. The same prompt + response sequences are then scored by one full forward:
transformers in fp32 and bf16, and megatron-core (one rank, THD-packed like a training micro-batch,
weights loaded by load_model_weights) in fp32 and bf16. Each figure is the mean |difference| over the
response tokens, per response position; the fp32 transformers forward is the reference.
"""
from __future__ import annotations

import argparse
import json
import os

import torch


def _generate(model_path: str, prompts: list[str], device: str, max_new: int):
    from slime.backends.embedded_engine.engine import EmbeddedEngine, GenerationRequest
    from slime.backends.embedded_engine.sampling import SamplingParams

    engine = EmbeddedEngine(model_path, dtype="bfloat16", device=device, seed=5)
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=1.0)
    requests = [GenerationRequest(rid=str(i), input_ids=tuple(engine.tokenize(p)), params=params, return_logprob=True)
                for i, p in enumerate(prompts)]
    results = engine.generate_batch(requests)
    sequences = [(list(q.input_ids), r.output_ids) for q, r in zip(requests, results)]
    return sequences, [r.output_logprobs for r in results]


@torch.no_grad()
def _transformers_log_probs(model_path: str, sequences, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    out = []
    for prompt, response in sequences:
        ids = torch.tensor([prompt + response], device=device)
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        out.append([float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(response)])
    del model
    return out


def _megatron_log_probs(model_path: str, sequences, bf16: bool):
    import transformers

    from slime.backends.megatron_utils.checkpoint import load_model_weights
    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.config import defaults_namespace
    from slime_plugins.models.cp_attention import packed_seq_params

    args = defaults_namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                              sequence_parallel=False, seed=1234, lr=1e-6, bf16=bf16)
    init_model_parallel(args)
    hf_config = transformers.AutoConfig.from_pretrained(model_path)
    model, optimizer, _ = build_model_and_optimizer(args, hf_config)
    load_model_weights(model_path, model, optimizer, hf_config)
    model[0].eval()
    device = next(model[0].parameters()).device
    tokens = [prompt + response for prompt, response in sequences]
    lengths = [-(-len(t) // 8) * 8 for t in tokens]  # padded like a micro-batch's sequences
    ids = torch.zeros(sum(lengths), dtype=torch.long)
    positions = torch.cat([torch.arange(n) for n in lengths])
    offset = 0
    for t, n in zip(tokens, lengths):
        ids[offset:offset + len(t)] = torch.tensor(t)
        offset += n
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32).to(device)
    with torch.no_grad():  # not around the build: megatron's DDP hooks need autograd
        logits = model[0](ids.unsqueeze(0).to(device), positions.unsqueeze(0).to(device), None,
                          packed_seq_params=packed_seq_params(cu, tuple(lengths)))
    logp = torch.log_softmax(logits[0, :, :hf_config.vocab_size].float(), -1)
    out, offset = [], 0
    for (prompt, response), n in zip(sequences, lengths):
        out.append([float(logp[offset + len(prompt) - 1 + k, t]) for k, t in enumerate(response)])
        offset += n
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    del model, optimizer
    return out


def _diff(a, b) -> dict[str, float]:
    """Mean |a - b| over all response tokens, and per response position."""
    width = max(len(x) for x in a)
    per_position = []
    for k in range(width):
        values = [abs(x[k] - y[k]) for x, y in zip(a, b) if k < len(x)]
        per_position.append(sum(values) / len(values))
    flat = [abs(u - v) for x, y in zip(a, b) for u, v in zip(x, y)]
    return {"mean": sum(flat) / len(flat), "max": max(flat), "per_position": per_position}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--prompts", default=None, help="jsonl with a 'prompt' key (default: digit strings)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--results-json", default=None)
    ns = parser.parse_args()
    if ns.prompts:
        with open(ns.prompts) as f:
            prompts = [json.loads(line)["prompt"] for line in f][: ns.num_prompts]
    else:
        prompts = ["0123456789"[: 2 + i % 8] for i in range(ns.num_prompts)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29655")
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(0)
    sequences, engine = _generate(ns.model_path, prompts, device, ns.max_new_tokens)
    sides = {"engine_bf16": engine,
             "transformers_bf16": _transformers_log_probs(ns.model_path, sequences, torch.bfloat16, device),
             "megatron_fp32": _megatron_log_probs(ns.model_path, sequences, bf16=False),
             "megatron_bf16": _megatron_log_probs(ns.model_path, sequences, bf16=True)}
    reference = _transformers_log_probs(ns.model_path, sequences, torch.float32, device)
    report = {name: _diff(values, reference) for name, values in sides.items()}
    report["engine_bf16_vs_megatron_bf16"] = _diff(engine, sides["megatron_bf16"])
    report["mean_abs_logprob_fp32"] = sum(abs(v) for x in reference for v in x) / sum(len(x) for x in reference)
    for name, d in report.items():
        if isinstance(d, dict):
            print(f"LOGPROB_PARITY {name:32s} mean {d['mean']:.3e} max {d['max']:.3e} per position "
                  + " ".join(f"{v:.3e}" for v in d["per_position"]))
    print(f"LOGPROB_PARITY mean |log-prob| (fp32 reference) {report['mean_abs_logprob_fp32']:.3f}")
    if ns.results_json:
        with open(ns.results_json, "w") as f:
            json.dump({"device": device, "num_sequences": len(sequences), **report}, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
