"""Every HF config field of every registered family is built, checked against the one value built, or declared
irrelevant (slime/models/hf_fields.py), and one record with one flag map serves the pre-Ray check and the ranks
(slime/models/hf_arch.py).

- transformers' own config class of each registered model_type is walked (its dataclass fields, the attributes of a
  default instance, what it writes to config.json): a field in no table fails;
- every checked field refuses its example, on the ranks (hf_arch) and before Ray starts (check_hf_config);
- the record built from config.json before Ray equals the one the ranks build from AutoConfig;
- every flag of the one map is refused alike before Ray and on the ranks;
- Llama-3 RoPE reads both spellings and builds transformers' frequencies; other fixed factors are refused;
- no model_type string of a registered family appears outside slime/models.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch

from slime.config import defaults_namespace
from slime.config.errors import ArgumentValidationError
from slime.models.hf_arch import ARCH_FLAGS, hf_arch, hf_config_from_dict
from slime.models.hf_fields import BUILT, CHECKED, IGNORED
from slime.models.registry import language_model_config, registered_families, supported_model_types

REPO = Path(__file__).resolve().parents[1]


def _config_class(family, model_type):
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[family.hf_config_types.get(model_type, model_type)]


def _default_config(family, model_type):
    config = _config_class(family, model_type)()
    config.model_type = model_type
    return config


def _cases():
    return [(family, model_type) for family in registered_families()
            for model_type in (*family.model_types, *family.composite_types)]


def _rules(family, model_type):
    return family.composite_fields if model_type in family.composite_types else family.hf_fields


def undeclared(config_class, rules) -> list[str]:
    """The fields of transformers' config class that `rules` does not declare (an alias counts through its
    target)."""
    fields = {f.name for f in dataclasses.fields(config_class)} | set(vars(config_class())) | \
        set(config_class().to_dict())
    aliases = getattr(config_class, "attribute_map", None) or {}
    return sorted(name for name in fields if not name.startswith("_") and name not in rules
                  and aliases.get(name) not in rules)


@pytest.mark.parametrize("family, model_type", _cases(), ids=[m for _, m in _cases()])
def test_every_field_of_transformers_config_class_is_declared(family, model_type):
    rules = _rules(family, model_type)
    assert undeclared(_config_class(family, model_type), rules) == []
    assert all(rule.how in (BUILT, CHECKED, IGNORED) and rule.note for rule in rules.values())


def test_the_walk_names_a_field_no_table_declares():
    from transformers import Qwen3Config

    from slime.models.qwen import QWEN3

    rules = {name: rule for name, rule in QWEN3.hf_fields.items() if name != "sliding_window"}
    assert undeclared(Qwen3Config, rules) == ["sliding_window"]


@pytest.mark.parametrize("family, model_type", _cases(), ids=[m for _, m in _cases()])
def test_every_checked_field_refuses_its_example(family, model_type):
    hf_arch(language_model_config(_default_config(family, model_type)))  # the defaults are built
    checked = {name: rule for name, rule in _rules(family, model_type).items() if rule.how == CHECKED}
    assert checked
    for name, rule in checked.items():
        config = _default_config(family, model_type)
        setattr(config, name, rule.refuses)
        with pytest.raises(ValueError, match=f"config.json {name}="):
            hf_arch(language_model_config(config))


def _write(tmp_path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _tiny_configs():
    from transformers import (Glm4Config, Glm4MoeConfig, GlmMoeDsaConfig, LlamaConfig,
                              MiniMaxM2Config, Qwen2MoeConfig, Qwen3_5Config, Qwen3MoeConfig)

    from tiny_models import tiny_deepseek_v3_config, tiny_deepseek_v4_config, tiny_qwen3_config

    small = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2)
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    return {
        "qwen3_sliding": tiny_qwen3_config(use_sliding_window=True, sliding_window=8, max_window_layers=1),
        "qwen3_moe_sliding": Qwen3MoeConfig(**small, num_experts=4, use_sliding_window=True, sliding_window=8),
        "qwen2_moe": Qwen2MoeConfig(**small, num_experts=4, qkv_bias=False),
        "llama3": LlamaConfig(**small, max_position_embeddings=16384, rope_parameters=llama3, tie_word_embeddings=True),
        "deepseek_v3": tiny_deepseek_v3_config(first_k_dense_replace=1),
        "glm4": Glm4Config(**small, attention_bias=False),
        "glm4_moe": Glm4MoeConfig(**small, n_routed_experts=4, use_qk_norm=True),
        "minimax_m2": MiniMaxM2Config(**small, num_local_experts=4, rotary_dim=8, head_dim=16),
        "glm_moe_dsa": GlmMoeDsaConfig(num_hidden_layers=3, index_topk_pattern="FSF"),
        "qwen3_5": Qwen3_5Config(text_config=dict(**small, layer_types=["linear_attention", "full_attention"] * 2)),
        "deepseek_v4": tiny_deepseek_v4_config(),
    }


@pytest.mark.parametrize("name", list(_tiny_configs()))
def test_the_record_of_config_json_before_ray_is_the_ranks(name, tmp_path):
    from transformers import AutoConfig

    _tiny_configs()[name].save_pretrained(tmp_path)
    ranks = hf_arch(language_model_config(AutoConfig.from_pretrained(tmp_path)))
    before_ray = hf_arch(language_model_config(hf_config_from_dict(json.loads((tmp_path / "config.json").read_text()))))
    assert before_ray == ranks
    if name.endswith("_sliding"):
        assert ranks.attention_windows == {"qwen3_sliding": (None, 8), "qwen3_moe_sliding": (8,) * 4}[name]


def test_the_ranks_build_what_the_record_says():
    """Fields that were read nowhere before: Qwen2-MoE's qkv_bias, GLM-4's attention_bias, Llama-3's factor and the
    windows reach the TransformerConfig and the layers."""
    from slime.backends.megatron_utils.model import transformer_config_from_hf

    configs = _tiny_configs()
    assert not transformer_config_from_hf(configs["qwen2_moe"], defaults_namespace()).add_qkv_bias
    assert not transformer_config_from_hf(configs["glm4"], defaults_namespace()).add_qkv_bias
    config = transformer_config_from_hf(configs["qwen3_sliding"], defaults_namespace())
    assert config.hf_attention_windows == (None, 8)
    assert hf_arch(configs["llama3"]).rope.llama3_factor == 32.0


@pytest.mark.parametrize("config, says", [
    (dict(hidden_act="gelu"), "config.json hidden_act='gelu'"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantized weights (fp8) are not dequantised"),
    (dict(use_sliding_window=False, layer_types=["sliding_attention", "full_attention"]),
     "sliding_attention layers but sliding_window is None"),
    (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types has ['chunked_attention']"),
    (dict(model_type="deepseek_v3", num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
          qk_rope_head_dim=8, v_head_dim=8), "one key/value head per query head"),
])
def test_a_checked_field_is_refused_before_ray_naming_it(config, says, tmp_path):
    from slime.config.launch import check_hf_config

    qwen3 = dict(model_type="qwen3", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96, vocab_size=128)
    with pytest.raises(ArgumentValidationError, match="^.*" + __import__("re").escape(says)):
        check_hf_config(defaults_namespace(), _write(tmp_path, {**qwen3, **config}))


def test_a_config_json_field_no_table_knows_is_named_before_ray(tmp_path):
    from slime.config.launch import check_hf_config

    path = _write(tmp_path, dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                 intermediate_size=96, vocab_size=128, my_new_attention_knob=3))
    with pytest.warns(UserWarning, match="does not know: my_new_attention_knob"):
        check_hf_config(defaults_namespace(), path)


# ---------------------------------------------------------------- one flag map, two sides
TINY_LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True)
WRONG = {"num_layers": 3, "hidden_size": 128, "ffn_hidden_size": 64, "num_attention_heads": 2, "num_query_groups": 4,
         "kv_channels": 32, "norm_epsilon": 1e-5, "qk_layernorm": True, "add_qkv_bias": True, "rotary_base": 500.0,
         "rotary_percent": 0.5, "rotary_interleaved": True, "post_self_attn_layernorm": True,
         "post_mlp_layernorm": True, "attention_output_gate": True, "apply_layernorm_1p": True,
         "multi_latent_attention": True, "untie_embeddings_and_output_weights": True, "model_name": "qwen3",
         "use_rope_scaling": True}


def test_every_flag_of_the_map_is_tested():
    assert set(ARCH_FLAGS) <= set(WRONG)


@pytest.mark.parametrize("dest", list(WRONG))
def test_one_flag_map_refuses_alike_before_ray_and_on_the_ranks(dest, tmp_path):
    from transformers import LlamaConfig

    from slime.backends.megatron_utils.model import transformer_config_from_hf
    from slime.config.launch import check_hf_config

    flag = "--" + dest.replace("_", "-")
    args = defaults_namespace(**{dest: WRONG[dest]})
    with pytest.raises(ArgumentValidationError, match=f"{flag}.* contradicts .*config.json"):
        check_hf_config(args, _write(tmp_path, TINY_LLAMA))
    with pytest.raises(ValueError, match=f"{flag}.* contradicts the HF config"):
        transformer_config_from_hf(LlamaConfig(**TINY_LLAMA), args)


def test_sliding_layers_refuse_a_spec_plugin_and_mtp_layers(tmp_path):
    from slime.config.launch import check_hf_config

    path = _write(tmp_path, dict(TINY_LLAMA, model_type="mimo", use_sliding_window=True, sliding_window=4,
                                 max_window_layers=1, tie_word_embeddings=False, num_nextn_predict_layers=1))
    check_hf_config(defaults_namespace(), path)
    for flags in (dict(spec=["slime_plugins.models.glm4", "get_glm_spec"]), dict(mtp_num_layers=1)):
        with pytest.raises(ArgumentValidationError, match="sliding-window layers"):
            check_hf_config(defaults_namespace(**flags), path)


def test_sliding_layers_warn_only_where_sglangs_model_serves_full_attention(tmp_path):
    """Qwen3's SGLang model serves every layer with full attention: the run warns; gpt-oss's applies the windows
    (its model reads sliding_window): no warning, which would send a gpt-oss user hunting for a mismatch."""
    import warnings

    from tiny_models import tiny_qwen3_config
    from transformers import GptOssConfig

    from slime.config.launch import check_hf_config

    (tmp_path / "qwen3").mkdir()
    (tmp_path / "gpt_oss").mkdir()
    qwen3 = _write(tmp_path / "qwen3", tiny_qwen3_config(use_sliding_window=True, sliding_window=8,
                                                          max_window_layers=1).to_dict())
    gpt_oss = _write(tmp_path / "gpt_oss", dict(GptOssConfig(
        vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        pad_token_id=0).to_dict()))
    for path, warns in ((qwen3, True), (gpt_oss, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_hf_config(defaults_namespace(), path)
        window_warnings = [w for w in caught if "serve every layer with full attention" in str(w.message)]
        assert bool(window_warnings) == warns, (path, [str(w.message) for w in caught])


# ---------------------------------------------------------------- Llama-3 RoPE
LLAMA32 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def test_llama3_rope_is_read_from_either_spelling_and_builds_transformers_frequencies(tmp_path):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    small = dict(TINY_LLAMA, max_position_embeddings=16384)
    current = LlamaConfig(**small, rope_parameters=dict(LLAMA32, rope_theta=500000.0))
    # transformers 4.x's object: rope_scaling, and rope_theta beside it (no rope_parameters)
    legacy = types.SimpleNamespace(**small, rope_scaling=dict(LLAMA32), rope_theta=500000.0)
    legacy_json = dict(small, rope_scaling=dict(LLAMA32), rope_theta=500000.0)  # a 4.x config.json read by 5.x
    for config in (current, legacy, hf_config_from_dict(legacy_json)):
        rope = hf_arch(config).rope
        assert (rope.type, rope.llama3_factor, rope.base) == ("llama3", 32.0, 500000.0)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](current, "cpu")
    arch = hf_arch(current)

    def megatron_inv_freq(factor):
        return RotaryEmbedding(arch.kv_channels, arch.rope.percent, rotary_base=int(arch.rope.base), rope_scaling=True,
                               rope_scaling_factor=factor, use_cpu_initialization=True).inv_freq

    assert torch.allclose(megatron_inv_freq(arch.rope.llama3_factor), want, rtol=1e-6, atol=0)
    assert not torch.allclose(megatron_inv_freq(8.0), want, rtol=1e-3, atol=0)  # megatron's default is not Llama-3.2's


@pytest.mark.parametrize("key, value", [("low_freq_factor", 2.0), ("high_freq_factor", 8.0),
                                        ("original_max_position_embeddings", 4096)])
def test_llama3_factors_megatron_does_not_build_are_refused(key, value, tmp_path):
    from transformers import LlamaConfig

    from slime.config.launch import check_hf_config

    rope = dict(LLAMA32, rope_theta=500000.0, **{key: value})
    with pytest.raises(ValueError, match=f"llama3 RoPE with {{'{key}': {value}}}"):
        hf_arch(LlamaConfig(**dict(TINY_LLAMA, max_position_embeddings=16384), rope_parameters=rope))
    path = _write(tmp_path, dict(TINY_LLAMA, max_position_embeddings=16384, rope_scaling=rope))
    with pytest.raises(ArgumentValidationError, match=f"{key}"):
        check_hf_config(defaults_namespace(), path)


# ---------------------------------------------------------------- family knowledge stays in slime/models
def _model_type_literals(source: str, model_types: set[str]) -> list[tuple[int, str]]:
    """(line, literal) of every string constant equal to a model_type, but the --loss-mask-type choices (chat
    template names that share some of the spellings)."""
    tree = ast.parse(source)
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value == "--loss-mask-type":
            skipped |= {id(sub) for sub in ast.walk(node)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in model_types and id(node) not in skipped]


def test_no_model_type_string_appears_outside_slime_models():
    model_types = set(supported_model_types())
    files = [*(REPO / "slime").rglob("*.py"), *(REPO / "slime_plugins").rglob("*.py"),
             REPO / "train.py", REPO / "train_async.py"]
    found = [f"{path.relative_to(REPO)}:{line}: {literal!r}" for path in files
             if not path.is_relative_to(REPO / "slime" / "models")
             for line, literal in _model_type_literals(path.read_text(), model_types)]
    assert found == []


def test_the_model_type_scan_sees_a_literal():
    source = 'MLA = ("deepseek_v3", "glm_moe_dsa")\ng.add_argument("--loss-mask-type", choices=["qwen3"])\n'
    assert _model_type_literals(source, set(supported_model_types())) == [(1, "deepseek_v3"), (1, "glm_moe_dsa")]


@pytest.mark.parametrize("name", ["glm_moe_dsa", "kimi_k2", "deepseek_v2", "qwen3_5_moe_text", "QWEN3_5_MOE"])
def test_model_name_accepts_every_registered_family(name):
    """--model-name's names come from the registry (the hand-kept list missed six registered model types)."""
    from arg_testing import parse_quiet

    args = parse_quiet(["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
                        "--train-backend-device", "cpu", "--model-name", name])
    assert args.model_name == name
