"""Model families beyond the dense Qwen3 / Llama layout, against transformers (what the embedded engine runs).

- DeepSeek-V3 multi-latent attention (megatron-core's MLA in the local spec with the project's CP/SP plugins),
  default RoPE and YaRN; GLM-4 through its --spec plug-in (post norms, q/k/v biases, half-rotary interleaved RoPE);
- the megatron model gives transformers' logits (fp32, ~1e-7) at TP2, CP2 and TP2 x CP2 and exports the HF
  tensors bit-exactly;
- the training step (packed THD micro-batches, zig-zag CP, SP) gives the single process's log-probs, loss and
  grad norm, and those log-probs are transformers'.
"""
from __future__ import annotations

import types

import pytest
import torch

from mp_utils import run_ranks
from test_train_step import assert_matches_reference, rollout  # noqa: F401 (fixture)
from tiny_models import save_tiny_deepseek_v3, save_tiny_glm4
from train_step_harness import layout_child

SEQ = 16
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


ARCHITECTURES = {"rope": "DeepseekV3ForCausalLM", "yarn": "DeepseekV3ForCausalLM", "glm4": "Glm4ForCausalLM"}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {"rope": save_tiny_deepseek_v3(str(root / "rope")),
            # no query compression (q_proj instead of q_a/q_b), YaRN RoPE
            "yarn": save_tiny_deepseek_v3(str(root / "yarn"), seed=1, q_lora_rank=None, rope_scaling=YARN),
            "glm4": save_tiny_glm4(str(root / "glm4"))}


def _forward_and_export(rank, world, hf_dir, tp, cp):
    import transformers
    from megatron.core import parallel_state

    from slime.backends.megatron_utils.model import build_gpt_model
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime_plugins.models.cp_attention import zigzag_positions
    from slime_plugins.models.hf_weights import export_hf_weights, load_hf_weights

    args = types.SimpleNamespace(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 pipeline_model_parallel_size=1, seed=5, attention_dropout=0.0, hidden_dropout=0.0)
    init_model_parallel(args)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(args, hf_config).eval()
    load_hf_weights([model], hf_dir, hf_config)
    tokens = torch.randint(0, hf_config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ)
    if cp > 1:
        positions = zigzag_positions(SEQ, cp, parallel_state.get_context_parallel_rank())
    with torch.no_grad():
        logits = model(tokens[:, positions], positions.unsqueeze(0), None)[0]
    return dict(logits=logits, positions=positions, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                exported=dict(export_hf_weights([model], hf_config)))


def _hf_logits(hf_dir, architecture):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == architecture
    tokens = torch.randint(0, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(tokens).logits[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind, tp, cp", [("rope", 2, 1), ("rope", 1, 2), ("yarn", 2, 2), ("glm4", 2, 2)])
def test_logits_match_transformers_and_export_is_exact(family_dirs, kind, tp, cp):
    from safetensors.torch import load_file

    hf_dir = family_dirs[kind]
    reference = _hf_logits(hf_dir, ARCHITECTURES[kind])
    original = load_file(f"{hf_dir}/model.safetensors")
    for result in run_ranks(_forward_and_export, tp * cp, args=(hf_dir, tp, cp), timeout_s=220):
        width = result["logits"].shape[-1]
        want = reference[result["positions"]][:, result["tp_rank"] * width:(result["tp_rank"] + 1) * width]
        assert (result["logits"] - want).abs().max().item() < 1e-5
        exported = result["exported"]
        assert sorted(exported) == sorted(original)
        assert all(torch.equal(exported[name], original[name]) for name in original)


LAYOUTS = {
    "tp2_sp_cp2": dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2),
    # without SP the RoPE key's gradient is summed over TP by the plugin (deepseek_v3._full_latent_forward)
    "tp2": dict(tensor_model_parallel_size=2),
}
_REFERENCES = {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, name", [("yarn", "tp2_sp_cp2"), ("yarn", "tp2"), ("glm4", "tp2_sp_cp2")])
def test_train_step_matches_single_process_and_transformers(family_dirs, rollout, kind, name):  # noqa: F811
    import transformers

    hf_dir = family_dirs[kind]
    modes = ("per_token", "per_sample")
    if kind not in _REFERENCES:
        (_REFERENCES[kind],) = run_ranks(layout_child, 1, args=(dict(calculate_per_token_loss=True), hf_dir,
                                                                 rollout, modes), timeout_s=120)
    reference = _REFERENCES[kind]
    layout = dict(LAYOUTS[name], calculate_per_token_loss=True)
    world = layout["tensor_model_parallel_size"] * layout.get("context_parallel_size", 1)
    results = run_ranks(layout_child, world, args=(layout, hf_dir, rollout, modes), timeout_s=220)
    assert_matches_reference(results, reference, rollout)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for tokens, response, got in zip(rollout["tokens"], rollout["response_lengths"], reference["log_probs"]):
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0].log_softmax(-1)
        want = logits[:-1].gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)[-response:]
        assert got == pytest.approx(want.tolist(), abs=1e-5)


def test_architecture_flags_must_agree_with_the_hf_config():
    from slime.backends.megatron_utils.model import transformer_config_from_hf
    from tiny_models import tiny_deepseek_v3_config, tiny_qwen3_config

    config = transformer_config_from_hf(tiny_deepseek_v3_config(rope_scaling=YARN), types.SimpleNamespace(
        multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8,
        v_head_dim=12, rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0))
    assert config.multi_latent_attention and config.rope_type == "yarn" and config.rotary_scaling_factor == 4.0
    with pytest.raises(ValueError, match="--kv-lora-rank=512 contradicts the HF config"):
        transformer_config_from_hf(tiny_deepseek_v3_config(), types.SimpleNamespace(kv_lora_rank=512))
    with pytest.raises(ValueError, match="--multi-latent-attention contradicts the HF config"):
        transformer_config_from_hf(tiny_qwen3_config(), types.SimpleNamespace(multi_latent_attention=True))
    with pytest.raises(ValueError, match="--rotary-interleaved=True contradicts"):
        transformer_config_from_hf(tiny_qwen3_config(), types.SimpleNamespace(rotary_interleaved=True))
    with pytest.raises(ValueError, match="DeepSeek-V3's MoE layers are not built here yet"):
        transformer_config_from_hf(tiny_deepseek_v3_config(first_k_dense_replace=1), types.SimpleNamespace())


def test_spec_plugin_signatures_and_result_types():
    from slime.backends.megatron_utils import model as builder
    from slime_plugins.models import glm4
    from tiny_models import tiny_qwen3_config

    args = types.SimpleNamespace(spec=["slime_plugins.models.glm4", "get_glm_spec"])
    assert builder.spec_function(args, tiny_qwen3_config()) is glm4.get_glm_spec
    assert builder.spec_function(types.SimpleNamespace(spec=None), tiny_qwen3_config()) is None
    config = builder.transformer_config_from_hf(tiny_qwen3_config(), types.SimpleNamespace())
    legacy = builder._plugin_spec(lambda a: "from fn(args)", args, config, None)
    assert legacy == "from fn(args)"
    with pytest.raises(TypeError, match="expected a megatron ModuleSpec"):
        # a one-parameter function is called as fn(args); this one returns a dict, not a spec
        builder._layer_spec(types.SimpleNamespace(spec=["slime_plugins.models.glm4", "layer_names"]),
                            tiny_qwen3_config(), config, None)
