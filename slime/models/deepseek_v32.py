"""DeepSeek-V3.2 (transformers' DeepseekV32ForCausalLM, `deepseek_v32`): DeepSeek-V3's multi-latent attention (always
with the query compression) and MoE, with DeepSeek sparse attention in every layer: a lightning indexer keeps the
`index_topk` best keys per query (sparse_attention.py, GLM-5's implementation).

Where the maths differ from GLM-5's (transformers' two modeling files, compared):
- the indexer's RoPE rotates its first `qk_rope_head_dim` dimensions as two halves, not as interleaved pairs;
- the RoPE is the model's, YaRN included (the released config's factor 40): the indexer's frequencies and the
  factor on its cos / sin are YaRN's, as the MLA's are (GLM-5 refuses YaRN);
- every layer has its own indexer (no "shared" layers), dense / MoE layers per `mlp_layer_types` (transformers
  derives them from `first_k_dense_replace`), DeepSeek-V3's sigmoid router with expert groups;
- the same elsewhere: the indexer's projections (wq_b on MLA's normalised q latent, wk with a LayerNorm of eps
  1e-6, weights_proj / sqrt(index_n_heads)), relu(q . k / sqrt(index_head_dim)) summed over the heads, the top-k
  over the causal keys (clamped to the keys there are), the indexer frozen (transformers gives it no gradient; the
  KL loss of --dsa-indexer-loss-coeff trains it, indexer_loss.py).
transformers keeps the indexer's weights_proj in fp32 under bf16 (`_keep_in_fp32_modules`); the trainer keeps every
indexer weight in its params dtype.

The HF names are DeepSeek-V3's (deepseek_v3.attention_names, the MoE block's) plus `self_attn.indexer.*`, as GLM-5's.
The released checkpoints' MTP layer (`model.layers.61`, which transformers' class drops on load) is not built here:
--mtp-num-layers is refused. Their FP8 weights are refused like any quantized checkpoint (use the bf16 weights).
"""

from __future__ import annotations

from typing import Any

from slime.models.deepseek_v3 import DEEPSEEK_V3_FIELDS, MLA_FLAGS, mla_arch_overrides, mla_config_fields, \
    mla_layer_spec
from slime.models.glm_moe_dsa import dsa_names, sparse_attention_fields
from slime.models.hf_fields import built, checked, ignored, must_be, table
from slime.models.registry import ModelFamily, register
from slime.models.sigmoid_router import deepseek_style_moe, dense_or_sparse_layers, sigmoid_router_architecture


def moe_architecture(hf_config: Any):
    """The MoE layers: those `mlp_layer_types` calls sparse, behind DeepSeek-V3's sigmoid router."""
    pattern = dense_or_sparse_layers(hf_config, "DeepSeek-V3.2")
    if not getattr(hf_config, "n_routed_experts", None) or 1 not in pattern:
        return None
    return sigmoid_router_architecture(deepseek_style_moe(hf_config, "DeepSeek-V3.2 MoE", pattern))


def check_indexer(hf_config: Any) -> None:
    """The indexer settings built here (also checked before Ray starts)."""
    for key in ("index_topk", "index_n_heads", "index_head_dim", "q_lora_rank"):
        if int(getattr(hf_config, key, 0) or 0) < 1:
            raise ValueError(f"DeepSeek-V3.2: {key}={getattr(hf_config, key, None)} in config.json; it must be a "
                             "positive int")
    if hf_config.index_head_dim < hf_config.qk_rope_head_dim:
        raise ValueError(f"DeepSeek-V3.2: index_head_dim={hf_config.index_head_dim} is below qk_rope_head_dim="
                         f"{hf_config.qk_rope_head_dim}, the indexer's rotary dimensions; fix config.json")


def deepseek_v32_config_fields(hf_config: Any) -> dict[str, Any]:
    """MLA's fields (default or YaRN RoPE) plus the indexer's shape (megatron's dsa_indexer_* fields;
    experimental_attention_variant stays unset: megatron-core's DSA module is not the one built)."""
    check_indexer(hf_config)
    return dict(mla_config_fields(hf_config), dsa_indexer_topk=int(hf_config.index_topk),
                dsa_indexer_n_heads=int(hf_config.index_n_heads), dsa_indexer_head_dim=int(hf_config.index_head_dim))


def layer_spec(config: Any, mlp: Any = None):
    """The local MLA layer spec with the sparse core attention, the indexer's RoPE on two halves."""
    from slime.models.sparse_attention import with_sparse_attention

    return with_sparse_attention(mla_layer_spec(config, mlp), indexer_rope_interleaved=False)


DEEPSEEK_V32_FIELDS = table(
    DEEPSEEK_V3_FIELDS, sparse_attention_fields("DeepSeek-V3.2"),
    q_lora_rank=built("the query compression (q_a_proj, q_b_proj: always there in DeepSeek-V3.2)"),
    rope_interleave=ignored("not a field of transformers' DeepSeek-V3.2 class, whose MLA always rotates "
                            "interleaved pairs (built so)"),
    moe_layer_freq=ignored("the released config's MoE spacing, which transformers' class does not read "
                           "(mlp_layer_types says which layers are MoE: built)"),
    num_nextn_predict_layers=ignored("the released checkpoints' MTP layer, which transformers' class drops on load; "
                                     "not built here (--mtp-num-layers is refused)"),
    scoring_func=checked("the sigmoid router (transformers' class builds it whatever the key says)",
                         must_be("sigmoid", "transformers' DeepSeek-V3.2 router is the sigmoid one"), "softmax"),
    topk_method=checked("noaux_tc: the routing bias chooses, as transformers' class does",
                        must_be("noaux_tc", "transformers' DeepSeek-V3.2 router adds e_score_correction_bias"),
                        "greedy"),
)

DEEPSEEK_V32 = register(ModelFamily(
    name="DeepSeek-V3.2",
    model_types=("deepseek_v32",),
    hf_fields=DEEPSEEK_V32_FIELDS,
    experts_key="n_routed_experts",
    qk_layernorm=True,  # the latent q/kv norms are megatron's qk_layernorm
    rope_types=None,  # mla_config_fields reads default or YaRN RoPE
    arch_overrides=mla_arch_overrides,
    config_fields=deepseek_v32_config_fields,
    config_flags=MLA_FLAGS,
    layer_spec=layer_spec,
    moe_architecture=moe_architecture,
    layer_names=dsa_names,
    check_config=check_indexer,
    transformer_engine_spec=False,  # TransformerEngine's MLA spec has no indexer
))
