"""GLM-5 / GLM-5.2 (transformers' GlmMoeDsaForCausalLM, `glm_moe_dsa`): DeepSeek-V3's multi-latent attention
with DeepSeek sparse attention (a lightning indexer keeps the `index_topk` best keys per query;
sparse_attention.py), and GLM-4.5's MoE (the sigmoid router with the expert-score correction bias, shared
experts, dense layers where `mlp_layer_types` says "dense"; sigmoid_router.py).

The HF names are GLM-4.7-Flash's (MLA: deepseek_v3.attention_names; the MoE block: DeepSeek-V3's) plus the
indexer's `self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`, which megatron holds, frozen and replicated
over TP, as `self_attention.core_attention.indexer.*`.

GLM-5.2's "shared" indexer layers (`indexer_types`) are a layer kind: no indexer (so no indexer weights either
way), the keys the last "full" layer before them chose (sparse_attention.py). The choice is not sent between
pipeline stages: a split or a --recompute-granularity full grouping that separates a shared layer from its source
is refused before Ray starts, naming the fix.

Refused with the fix named: YaRN or partial RoPE (the indexer's RoPE here is the default one).
"""

from __future__ import annotations

from typing import Any, Mapping

from slime.config.layout import virtual_pipeline_size
from slime.models.deepseek_v3 import MLA_FIELDS, MLA_FLAGS, attention_names, mla_arch_overrides, mla_layer_spec
from slime.models.glm4_moe import glm4_moe_lite_config_fields
from slime.models.hf_fields import FieldRule, built, checked, table
from slime.models.registry import ModelFamily, register
from slime.models.sigmoid_router import (DEEPSEEK_STYLE_MOE_FIELDS, deepseek_style_moe, dense_or_sparse_layers,
                                         sigmoid_router_architecture)

# megatron flag dest -> TransformerConfig field: the MLA flags, checked against the HF config
DSA_FLAGS = dict(MLA_FLAGS)


def glm_moe_dsa_architecture(hf_config: Any):
    """GLM-5's MoE layers: those `mlp_layer_types` calls sparse, behind DeepSeek-V3's sigmoid router."""
    pattern = dense_or_sparse_layers(hf_config, "GLM-5")
    if not getattr(hf_config, "n_routed_experts", None) or 1 not in pattern:
        return None
    return sigmoid_router_architecture(deepseek_style_moe(hf_config, "GLM-5 MoE", pattern))


def indexer_kinds(hf_config: Any) -> tuple[str, ...]:
    """Each layer's indexer: "full" (its own) or "shared" (the last full layer's choice, GLM-5.2)."""
    kinds = tuple(getattr(hf_config, "indexer_types", None) or ("full",) * hf_config.num_hidden_layers)
    if len(kinds) != hf_config.num_hidden_layers or set(kinds) - {"full", "shared"}:
        raise ValueError(f"GLM-5: indexer_types {list(kinds)} must give 'full' or 'shared' for each of the "
                         f"{hf_config.num_hidden_layers} layers; fix config.json")
    if kinds[0] != "full":
        raise ValueError("GLM-5: indexer_types starts with 'shared', but a shared layer reuses the choice of a full "
                         "layer before it; fix config.json")
    return kinds


def shared_sources(hf_config: Any) -> dict[int, int]:
    """shared layer -> the full layer whose choice it reuses (the last one before it)."""
    sources, last = {}, 0
    for layer, kind in enumerate(indexer_kinds(hf_config)):
        if kind == "full":
            last = layer
        else:
            sources[layer] = last
    return sources


def check_indexer(hf_config: Any) -> None:
    """The indexer settings built here (also checked before Ray starts)."""
    indexer_kinds(hf_config)
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        if int(getattr(hf_config, key, 0) or 0) < 1:
            raise ValueError(f"GLM-5: {key}={getattr(hf_config, key, None)} in config.json; it must be a positive int")
    if hf_config.index_head_dim < hf_config.qk_rope_head_dim:
        raise ValueError(f"GLM-5: index_head_dim={hf_config.index_head_dim} is below qk_rope_head_dim="
                         f"{hf_config.qk_rope_head_dim}, the indexer's rotary dimensions; fix config.json")


def glm_moe_dsa_config_fields(hf_config: Any) -> dict[str, Any]:
    """MLA's fields (GLM-4.7-Flash's RoPE checks) plus the indexer's shape (megatron's dsa_indexer_* fields;
    experimental_attention_variant stays unset: megatron-core's DSA module is not the one built)."""
    fields = glm4_moe_lite_config_fields(hf_config)
    if fields["rope_type"] != "rope":
        raise ValueError("GLM-5: YaRN RoPE is not mapped onto the indexer's rotary embedding; use a config with "
                         "default RoPE (rope_parameters.rope_type 'default')")
    check_indexer(hf_config)
    return dict(fields, dsa_indexer_topk=int(hf_config.index_topk), dsa_indexer_n_heads=int(hf_config.index_n_heads),
                dsa_indexer_head_dim=int(hf_config.index_head_dim))


def dsa_layer_spec(config: Any, mlp: Any = None):
    """The local MLA layer spec with the sparse core attention (the MoE layers replace its MLP)."""
    from slime.models.sparse_attention import with_sparse_attention

    return with_sparse_attention(mla_layer_spec(config, mlp))


def dsa_kind_layer_spec(config: Any, kind: str):
    """A full layer (its own indexer) or a shared one (the last full layer's choice)."""
    from slime.models.sparse_attention import with_sparse_attention

    return with_sparse_attention(mla_layer_spec(config), shared=kind == "shared")


def _pipeline_chunks(args: Any, layers: int) -> list[range]:
    """The layers of each model chunk (pipeline stage, or virtual stage under --virtual-pipeline-...)."""
    pp, vp = args.pipeline_model_parallel_size, virtual_pipeline_size(args) or 1
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if vp > 1 and (first is not None or last is not None):
        raise ValueError("GLM-5.2's shared indexer layers with a virtual pipeline and --decoder-first/last-pipeline-"
                         "num-layers: the chunk boundaries are not checked here; drop one of the two")
    middle = pp - (first is not None) - (last is not None)
    sizes = ([first] if first is not None else []) + [(layers - (first or 0) - (last or 0)) // max(middle, 1)] * middle
    sizes += [last] if last is not None else []
    if vp > 1:
        sizes = [layers // (pp * vp)] * (pp * vp)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def _recompute_groups(args: Any, chunk: range) -> list[range]:
    """The layers of a pipeline chunk that --recompute-granularity full re-runs together."""
    if args.recompute_granularity != "full":
        return [chunk]
    count = args.recompute_num_layers  # set with full granularity (slime/config/checks/model.py)
    if args.recompute_method == "block":  # the first `count` layers alone, the rest not at all
        alone = [range(layer, layer + 1) for layer in chunk[:count]]
        return alone + ([chunk[count:]] if len(chunk) > count else [])
    return [chunk[i:i + count] for i in range(0, len(chunk), count)]


def check_indexer_layout(hf_config: Any, args: Any) -> None:
    """Each shared layer built (and recomputed) with its source layer: the choice is not sent between stages."""
    sources = shared_sources(hf_config)
    if not sources:
        return
    for chunk in _pipeline_chunks(args, hf_config.num_hidden_layers):
        for group in _recompute_groups(args, chunk):
            for layer in group:
                if layer in sources and sources[layer] not in group:
                    where = "pipeline stage" if group == chunk else "--recompute-granularity full group"
                    raise ValueError(
                        f"GLM-5.2: shared indexer layer {layer} reuses layer {sources[layer]}'s top-k keys, which "
                        f"is built in another {where} (layers {group.start}-{group.stop - 1}); choose "
                        "--decoder-first/last-pipeline-num-layers or --pipeline-model-parallel-size so that each "
                        "stage starts with a full layer, and --recompute-method uniform with --recompute-num-layers "
                        "grouping each shared layer with its source (or --recompute-granularity selective)")


def dsa_names(prefix: str) -> dict[str, str]:
    """MLA's names and the indexer's."""
    indexer = f"{prefix}self_attn.indexer."
    core = "self_attention.core_attention.indexer."
    names = {f"{core}{part}": f"{indexer}{part}"
             for part in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")}
    return dict(attention_names(prefix), **names)


def get_glm5_spec(args: Any, config: Any, vp_stage: int | None = None):
    """Upstream's `--spec slime_plugins.models.glm5.glm5 get_glm5_spec`: this pipeline stage's GLM-5 layers, each
    by its indexer kind (config.hf_layer_kinds), with megatron's MoE layer where config.moe_layer_freq says so (the
    layers built without --spec too)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from slime.models.grouped_experts import grouped_experts_chosen
    from slime.models.local_spec import with_moe_mlp
    from slime.models.sp_norm import SequenceParallelNorm

    grouped = grouped_experts_chosen(args.moe_grouped_gemm)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    kinds = {kind: dsa_kind_layer_spec(config, kind) for kind in ("full", "shared")}
    specs = []
    for layer in range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage)):
        spec = kinds[config.hf_layer_kinds[layer]]
        moe = config.num_moe_experts and config.moe_layer_freq[layer]
        specs.append(with_moe_mlp(spec, config, grouped) if moe else spec)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=SequenceParallelNorm)


def sparse_attention_fields(family: str) -> Mapping[str, FieldRule]:
    """The fields of a family whose every layer is DeepSeek sparse attention (an indexer) over a dense or MoE MLP."""

    def every_layer_indexed(value: Any, hf_config: Any) -> str | None:
        unknown = sorted(set(value or ()) - {"indexed_attention"})
        return (f"has {unknown}; every {family} layer built here is sparse attention with its indexer "
                "(indexed_attention)" if unknown else None)

    return table(
        mlp_layer_types=built("each layer's MLP: dense or sparse (the MoE layer pattern)"),
        first_k_dense_replace=built("the dense layers, through mlp_layer_types (transformers derives it when unset)"),
        layer_types=checked("indexed_attention on every layer", every_layer_indexed, ["full_attention"]),
        index_topk=built("dsa_indexer_topk: the keys each query keeps"),
        index_n_heads=built("dsa_indexer_n_heads"),
        index_head_dim=built("dsa_indexer_head_dim"),
    )


GLM_MOE_DSA_FIELDS = table(
    MLA_FIELDS, DEEPSEEK_STYLE_MOE_FIELDS, sparse_attention_fields("GLM-5"),
    indexer_types=built("each layer's indexer: full or shared (GLM-5.2)"),
    index_topk_pattern=built("indexer_types spelt F/S (transformers derives indexer_types from it)"),
    index_topk_freq=built("indexer_types' schedule (transformers derives indexer_types from it)"),
    index_skip_topk_offset=built("indexer_types' schedule (transformers derives indexer_types from it)"),
)

GLM_MOE_DSA = register(ModelFamily(
    name="GLM-5",
    model_types=("glm_moe_dsa",),
    hf_fields=GLM_MOE_DSA_FIELDS,
    experts_key="n_routed_experts",
    spec_plugins=("slime_plugins.models.glm5.glm5 get_glm5_spec",),
    qk_layernorm=True,  # the latent q/kv norms are megatron's qk_layernorm
    rope_types=None,  # glm_moe_dsa_config_fields checks the RoPE
    arch_overrides=mla_arch_overrides,
    config_fields=glm_moe_dsa_config_fields,
    config_flags=DSA_FLAGS,
    layer_spec=dsa_layer_spec,
    layer_kinds=indexer_kinds,
    kind_layer_spec=dsa_kind_layer_spec,
    moe_architecture=glm_moe_dsa_architecture,
    layer_names=dsa_names,
    check_config=check_indexer,
    check_layout=check_indexer_layout,
    transformer_engine_spec=False,  # TransformerEngine's MLA spec has no indexer
))
