"""Qwen3.5 / Qwen3-Next checkpoints (gated delta-net + full attention layers) are checked before Ray starts:
the layer pattern against what the builder builds, the delta-net heads against TP, upstream's linear-attention
and family flags against the HF config; a composite (vision + text) checkpoint is checked by its text config.
"""
from __future__ import annotations

import json

import pytest

from arg_testing import no_real_sglang, parse_error, parse_quiet  # noqa: F401 (fixture)
from slime.config.checks.linear_attention import layer_pattern, pattern_of_flag
from slime.config.errors import ArgumentValidationError

BASE = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "2",
        "--train-backend-device", "cpu"]
LIN, FULL = "linear_attention", "full_attention"
HYBRID = dict(model_type="qwen3_5_text", num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=128, layer_types=[LIN, LIN, LIN, FULL],
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)


def _checkpoint(tmp_path, config: dict) -> str:
    path = tmp_path / "ckpt"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")
    return str(path)


def _composite(text: dict) -> dict:
    return {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 2, "hidden_size": 32}}


def test_megatron_reads_linear_attention_freq_as_the_hf_layer_types():
    assert pattern_of_flag("4", 8) == (1, 1, 1, 0, 1, 1, 1, 0)
    assert pattern_of_flag("[1, 0, 1, 0]", 4) == (1, 0, 1, 0)
    assert layer_pattern({"layer_types": [LIN, LIN, LIN, FULL]}) == (1, 1, 1, 0)
    assert layer_pattern({"num_hidden_layers": 4}) is None
    for bad in ("0", "[2, 1]", "every fourth"):
        with pytest.raises(ArgumentValidationError, match="--linear-attention-freq"):
            pattern_of_flag(bad, 4)


@pytest.mark.parametrize("composite", [False, True], ids=["text", "composite"])
def test_upstream_hybrid_flags_that_agree_with_the_checkpoint_parse(composite, tmp_path):
    config = _composite(HYBRID) if composite else HYBRID
    args = parse_quiet([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, config), "--tensor-model-parallel-size", "2",
                        "--num-layers", "4", "--linear-attention-freq", "4", "--linear-num-key-heads", "2",
                        "--linear-num-value-heads", "4", "--linear-key-head-dim", "16", "--linear-conv-kernel-dim", "4"])
    assert args.linear_attention_freq == "4" and args.linear_num_value_heads == 4


@pytest.mark.parametrize("composite", [False, True], ids=["text", "composite"])
@pytest.mark.parametrize("flags, says", [
    (["--linear-attention-freq", "2"], "--linear-attention-freq 2 contradicts the layer_types"),
    (["--linear-num-value-heads", "8"], "--linear-num-value-heads 8 contradicts"),
    (["--linear-key-head-dim", "32"], "--linear-key-head-dim 32 contradicts"),
    (["--experimental-attention-variant", "dsa"], "--experimental-attention-variant dsa contradicts"),
    (["--num-layers", "8"], "--num-layers 8 contradicts"),
])
def test_a_hybrid_flag_that_contradicts_the_checkpoint_is_refused(composite, flags, says, tmp_path, capsys):
    config = _composite(HYBRID) if composite else HYBRID
    err = parse_error([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, config), *flags], capsys)
    assert says in err


def test_delta_net_heads_that_tp_does_not_divide_are_refused(tmp_path, capsys):
    config = {**HYBRID, "linear_num_key_heads": 3, "linear_num_value_heads": 6}
    err = parse_error([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, config), "--tensor-model-parallel-size", "2"],
                      capsys)
    assert "--tensor-model-parallel-size 2 does not divide the model's 3 linear-attention key heads" in err


def test_linear_attention_flags_on_a_model_without_such_layers_are_refused(tmp_path, capsys):
    dense = {k: v for k, v in HYBRID.items() if not k.startswith("linear_") and k != "layer_types"}
    err = parse_error([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, {**dense, "model_type": "qwen3"}),
                       "--linear-num-key-heads", "2"], capsys)
    assert "--linear-num-key-heads describe gated delta-net" in err and "has none" in err


@pytest.mark.parametrize("flag", ["--attention-output-gate", "--use-gated-attention", "--apply-layernorm-1p"])
def test_hybrid_layer_flags_are_accepted_for_qwen3_5_and_refused_for_a_dense_qwen3(flag, tmp_path, capsys):
    args = parse_quiet([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, _composite(HYBRID)), flag])
    assert args.attention_output_gate or args.apply_layernorm_1p
    dense = {k: v for k, v in HYBRID.items() if not k.startswith("linear_") and k != "layer_types"}
    err = parse_error([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, {**dense, "model_type": "qwen3"}), flag],
                      capsys)
    assert "contradicts" in err and "Qwen3 layers have no such thing" in err
