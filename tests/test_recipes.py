"""The cluster recipe a slime user follows (examples/run_qwen3_4b_issue1487.sh) must fit the model it names.

The script is run with a stand-in `python` that records its argv; those flags are then parsed by the
real parser and checked by the real model builder against Qwen3-4B's own config.json (tied embeddings,
36 layers, ...), so a flag that contradicts the checkpoint fails here rather than on the cluster.
"""
from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Qwen3-4B's config.json (the fields the builder reads), as published with the model.
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "rope_scaling": None, "tie_word_embeddings": True, "vocab_size": 151936, "attention_bias": False,
    "torch_dtype": "bfloat16",
}


def recorded_argv(tmp_path: Path) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.txt"
    stub = bin_dir / "python"
    stub.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {shlex.quote(str(record))}\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    hf, data = tmp_path / "Qwen3-4B", tmp_path / "prompts.jsonl"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(QWEN3_4B))
    data.write_text(json.dumps({"prompt": "1+1?", "label": "2"}) + "\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HF": str(hf), "DATA": str(data),
           "OUT": str(tmp_path / "out")}
    subprocess.run(["bash", str(ROOT / "examples" / "run_qwen3_4b_issue1487.sh")], env=env, check=True, timeout=60)
    assert (tmp_path / "out").is_dir(), "the recipe must create the directory its metrics go to"
    return record.read_text().splitlines()


def test_issue_recipe_parses_and_matches_qwen3_4b(tmp_path):
    from transformers import AutoConfig

    from slime.backends.megatron_utils.model import transformer_config_from_hf
    from slime.utils.arguments import parse_args

    argv = recorded_argv(tmp_path)
    assert argv[0] == "train.py"
    args = parse_args(argv[1:])
    hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
    config = transformer_config_from_hf(hf_config, args)  # raises on any flag that contradicts the checkpoint
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (36, 2560, 32)
    assert args.tensor_model_parallel_size == 2 and args.context_parallel_size == 4 and args.sequence_parallel
    assert args.colocate and args.offload_train and args.offload_rollout
