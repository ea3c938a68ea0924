"""DeepSeek-V3.2 against transformers' DeepseekV32ForCausalLM: multi-latent attention with DeepSeek sparse attention
(the indexer keeping 6 keys per query, its RoPE on two halves with YaRN's frequencies and attention factor), the
sigmoid-router MoE with expert groups and a shared expert.

- the indexer's rotated queries and keys are transformers' (two halves, YaRN), and GLM-5's interleaved layout is not;
- two training steps at TP2 x SP x CP2 x EP2 equal the single process's, each pushed by the fenced weight sync to a
  running embedded engine (transformers' class), whose log-probs equal the trainer's (fp32, 1e-5) before the first
  push and after each; HF -> megatron -> HF is exact on every rank; the order proof holds;
- LoRA on linear_proj / linear_fc1 / linear_fc2 trains, merges and pushes the adapted layers;
- what is not built is refused before Ray starts.
"""
from __future__ import annotations

import json

import pytest
import torch

from family_push import TP2_SP_CP2_EP2
from slime.config import defaults_namespace

pytestmark = pytest.mark.ranks


def test_the_indexer_rotates_as_transformers_does():
    """Two halves with YaRN's frequencies and cos / sin factor (not 1 here), as DeepseekV32Indexer applies them to
    the first qk_rope_head_dim dimensions; the interleaved layout (GLM-5's) gives other queries and keys."""
    import types

    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32RotaryEmbedding, \
        apply_rotary_pos_emb

    from slime.models.hf_arch import hf_arch
    from slime.models.sparse_attention import LightningIndexer
    from tiny_models import DEEPSEEK_V32_YARN

    hf_config = DeepseekV32Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                                  kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                                  index_head_dim=16, index_n_heads=4, index_topk=6, max_position_embeddings=512,
                                  rope_parameters=dict(DEEPSEEK_V32_YARN))
    config = types.SimpleNamespace(**hf_arch(hf_config).family_fields, hidden_size=64, params_dtype=torch.float32)
    positions = torch.arange(40, 52)
    x = torch.randn(12, 4, 16, generator=torch.Generator().manual_seed(0))
    cos, sin = DeepseekV32RotaryEmbedding(hf_config)(x, positions.unsqueeze(0))
    rot, rest = x.split([8, 8], dim=-1)
    want, _ = apply_rotary_pos_emb(rot.unsqueeze(0), rot.unsqueeze(0), cos, sin, unsqueeze_dim=2)
    assert abs(float(cos[0, 0, 0]) - 1.0) > 1e-3  # YaRN's attention factor is in cos and sin
    halves = LightningIndexer(config, rope_interleaved=False)._rope(x, positions)
    assert torch.allclose(halves, torch.cat([want[0], rest], dim=-1), atol=1e-6)
    assert not torch.allclose(LightningIndexer(config)._rope(x, positions), halves, atol=1e-2)


def test_the_sparsity_is_in_force(tmp_path):
    """transformers' own logits move when index_topk is lifted above the sequence: the tiny checkpoint's attention
    is sparse, so the agreement below is the sparse attention's."""
    import transformers

    from tiny_models import save_tiny_deepseek_v32

    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    logits = []
    for topk in (6, 64):
        path = save_tiny_deepseek_v32(str(tmp_path / str(topk)), index_topk=topk)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert type(model).__name__ == "DeepseekV32ForCausalLM"
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert (logits[0] - logits[1]).abs().max() > 1e-2


MOE_TRAINING = dict(expert_tensor_parallel_size=1, calculate_per_token_loss=True, lr=1e-3,
                    moe_router_bias_update_rate=0.05)
LAYOUT = dict(MOE_TRAINING, **TP2_SP_CP2_EP2)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny DeepSeek-V3.2 with the project's tiny tokenizer, a rollout, and an embedded engine serving it."""
    from family_push import serve_tiny
    from tiny_models import save_tiny_deepseek_v32

    with serve_tiny(tmp_path_factory.mktemp("v32_served"), save_tiny_deepseek_v32) as served:
        yield served


@pytest.mark.timeout(400)
def test_steps_at_tp2_sp_cp2_ep2_equal_the_single_process_and_every_push_reaches_the_engine(served, tmp_path):
    from safetensors.torch import load_file

    from family_push import check_layout_run

    # every rank exports every expert (EP all-gather), the indexers and the routing bias
    check_layout_run(tmp_path, served, MOE_TRAINING, LAYOUT, load_file(f"{served[0]}/model.safetensors"))


@pytest.mark.timeout(200)
def test_lora_trains_merges_and_pushes(served):
    from family_push import check_lora_run

    check_lora_run(served, ["linear_proj", "linear_fc1", "linear_fc2"])


def test_what_is_not_built_is_refused_before_ray(served, tmp_path):
    from slime.config.errors import ArgumentValidationError
    from slime.config.launch import check_hf_config

    hf_dir, _, _ = served
    config = json.loads(open(f"{hf_dir}/config.json").read())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    check_hf_config(defaults_namespace(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=24,
                                       rotary_scaling_factor=4.0), str(path))
    refused = [(dict(mtp_num_layers=1), {}, "--mtp-num-layers"),
               (dict(kv_lora_rank=512), {}, "--kv-lora-rank 512 contradicts"),
               ({}, dict(index_topk=0), "index_topk=0"),
               ({}, dict(layer_types=["indexed_attention", "full_attention"]),
                "layer_types"),
               ({}, dict(quantization_config={"quant_method": "fp8"}), "quantized weights (fp8)")]
    for flags, fields, says in refused:
        path.write_text(json.dumps({**config, **fields}))
        with pytest.raises(ArgumentValidationError, match=__import__("re").escape(says)):
            check_hf_config(defaults_namespace(**flags), str(path))
