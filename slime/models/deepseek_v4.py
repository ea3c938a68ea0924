"""DeepSeek-V4 (transformers' DeepseekV4ForCausalLM, `deepseek_v4`), registered as one ModelFamily at the end.

A V4 layer differs from every other family's in three places, each a module of its own beside this one:
- attention (compressed_attention.py): one shared key/value head (K = V) with a sliding window of
  `sliding_window` keys, a per-head sink logit and a grouped low-rank output projection; a
  `compressed_sparse_attention` layer adds one compressed key per `compress_rates[...]` (m) tokens from two
  overlapping windows, of which a lightning indexer keeps `index_topk` per query; a
  `heavily_compressed_attention` layer adds one per m' tokens, all of them visible;
- the residual stream (hyper_connections.py): `hc_mult` streams mixed by Sinkhorn-normalised matrices
  (manifold-constrained hyper-connections), collapsed into the attention / MLP input and expanded from its output;
- the MoE routers (deepseek_v4_routers.py): sqrt(softplus) scores with the expert-score correction bias
  (`moe` layers), or experts fixed per token id by a frozen `tid2eid` table (`hash_moe` layers); every layer
  is an MoE layer with one shared expert, and every expert clamps its SwiGLU at `swiglu_limit`.

The HF names are what transformers' class writes (`save_pretrained` reverses its conversion to DeepSeek's own
spelling: `model.layers.L.attn.wq_a.weight`, `...ffn.experts.E.w1.weight`, `...hc_attn_fn`, `head.weight`);
the embedded engine resolves them through transformers' own renaming (engine.checkpoint_target).

Refused before Ray starts, with the reason: pipeline parallelism (the streams are hc_mult x wider than what
megatron's pipeline sends between stages), MTP layers (transformers' class does not build them: nothing to check
them against), a --spec plug-in, LoRA, routing replay, megatron's aux losses (the router balances with its expert
bias) and the indexer's KL loss (not built for V4's indexer). Context parallelism never splits the compressed
keys: each CP rank builds all of a sequence's compressed keys from the all-gathered layer input (a window spans
the CP chunks' boundaries), so every CP layout the plan allows runs; the price is that replicated work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from slime.models.hf_fields import ATTENTION_BIAS, CONFIG_OBJECT, DECODER, MLP_BIAS, ROUTER_TRAINING, built, \
    checked, ignored, must_be, table
from slime.models.registry import ModelFamily, register

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_KINDS = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"


@dataclass(frozen=True)
class Rotary:
    """One of V4's two rotary embeddings: interleaved pairs of each head's last `dim` dimensions."""

    base: float
    dim: int
    yarn_factor: float | None = None
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    """cos and sin are multiplied by it (transformers' attention_scaling)."""


@dataclass(frozen=True)
class DeepseekV4Layers:
    """What V4's own layers read (TransformerConfig.hf_layer_config)."""

    attention_kinds: tuple[str, ...]
    mlp_kinds: tuple[str, ...]
    head_dim: int
    q_lora_rank: int
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    ratios: tuple[tuple[str, int], ...]
    """(compressed attention kind, tokens per compressed key)."""
    index_heads: int
    index_head_dim: int
    index_topk: int
    main_rope: Rotary
    """The sliding layers' RoPE (rope_theta)."""
    compress_rope: Rotary
    """The compressed layers' RoPE (compress_rope_theta, optionally YaRN): their queries, keys and compressors."""
    streams: int
    sinkhorn_iters: int
    hc_eps: float
    norm_eps: float
    vocab_size: int
    topk: int
    fp32_weights: bool = True
    """The sinks, position biases, V4's norms and the hyper-connection weights in fp32 whatever --bf16 says (as
    transformers keeps them); False under --optimizer-cpu-offload, whose hybrid CPU optimizer holds 16-bit
    parameters only (deepseek_v4_spec sets it from the flags)."""

    def ratio(self, kind: str) -> int:
        return dict(self.ratios)[kind]


def _fail(message: str) -> None:
    raise ValueError(f"DeepSeek-V4: {message}")


def _kinds(hf_config: Any, key: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    kinds = tuple(getattr(hf_config, key, None) or ())
    if len(kinds) != hf_config.num_hidden_layers or set(kinds) - set(allowed):
        _fail(f"{key} {list(kinds)} must give one of {list(allowed)} for each of the {hf_config.num_hidden_layers} "
              "layers; fix config.json")
    return kinds


def _rotary(params: Any, what: str, dim: int, allowed: tuple[str, ...]) -> Rotary:
    if not isinstance(params, dict):
        _fail(f"rope_parameters has no {what!r} entry; transformers' DeepseekV4Config writes one for each rope kind")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in allowed:
        _fail(f"rope_parameters[{what!r}] has rope type {rope_type!r}; the {what} RoPE built here is "
              f"{' or '.join(allowed)}")
    base = float(params["rope_theta"])
    if rope_type == "default":
        return Rotary(base=base, dim=dim)
    if params.get("truncate", True) is not True:
        _fail("YaRN with truncate=false is not built (transformers' V4 rotary truncates whatever it says)")
    factor = float(params["factor"])
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        scale = (lambda m: 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0)  # noqa: E731
        attention = scale(mscale) / scale(mscale_all) if mscale and mscale_all else scale(1.0)
    return Rotary(base=base, dim=dim, yarn_factor=factor,
                  original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                  beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                  attention_factor=float(attention))


def layers_of(hf_config: Any) -> DeepseekV4Layers:
    """The record of a DeepseekV4Config (transformers' object: it derives layer_types and the nested RoPE);
    ValueError naming the fix for what is not built here."""
    attention = _kinds(hf_config, "layer_types", ATTENTION_KINDS)
    mlp = _kinds(hf_config, "mlp_layer_types", (HASH_MOE, MOE))
    rates = dict(getattr(hf_config, "compress_rates", None) or {})
    for kind in {CSA, HCA} & set(attention):
        if not isinstance(rates.get(kind), int) or rates[kind] < 1:
            _fail(f"compress_rates[{kind!r}] = {rates.get(kind)!r}; a {kind} layer needs a positive int")
    head_dim = hf_config.head_dim
    rope_dim = int(head_dim * float(hf_config.partial_rotary_factor))
    if rope_dim % 2 or rope_dim > head_dim:
        _fail(f"partial_rotary_factor {hf_config.partial_rotary_factor} rotates {rope_dim} of {head_dim} dimensions; "
              "an even number up to head_dim is built")
    if CSA in attention and hf_config.index_head_dim < rope_dim:
        _fail(f"index_head_dim {hf_config.index_head_dim} is below the {rope_dim} rotated dimensions")
    if hf_config.num_attention_heads % hf_config.o_groups:
        _fail(f"o_groups {hf_config.o_groups} does not divide the {hf_config.num_attention_heads} heads")
    for key in ("hc_mult", "hc_sinkhorn_iters", "sliding_window", "index_topk", "index_n_heads", "q_lora_rank"):
        if int(getattr(hf_config, key, 0) or 0) < 1:
            _fail(f"{key}={getattr(hf_config, key, None)!r}; it must be a positive int")
    rope = dict(hf_config.rope_parameters or {})
    return DeepseekV4Layers(
        attention_kinds=attention, mlp_kinds=mlp, head_dim=head_dim, q_lora_rank=hf_config.q_lora_rank,
        sliding_window=hf_config.sliding_window, o_groups=hf_config.o_groups, o_lora_rank=hf_config.o_lora_rank,
        ratios=tuple((kind, int(rates[kind])) for kind in (CSA, HCA) if kind in rates),
        index_heads=hf_config.index_n_heads, index_head_dim=hf_config.index_head_dim,
        index_topk=hf_config.index_topk, main_rope=_rotary(rope.get("main"), "main", rope_dim, ("default",)),
        compress_rope=_rotary(rope.get("compress"), "compress", rope_dim, ("default", "yarn")),
        streams=hf_config.hc_mult, sinkhorn_iters=hf_config.hc_sinkhorn_iters, hc_eps=float(hf_config.hc_eps),
        norm_eps=float(hf_config.rms_norm_eps), vocab_size=hf_config.vocab_size,
        topk=hf_config.num_experts_per_tok)


def main_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """megatron's GPT model wants one RoPE: the sliding layers' (V4's layers rotate with their own)."""
    main = dict((getattr(hf_config, "rope_parameters", None) or {}).get("main") or {})
    return dict(main, rope_type="default", partial_rotary_factor=float(hf_config.partial_rotary_factor))


def arch_overrides(hf_config: Any) -> dict[str, Any]:
    """The one key/value head is shared by every query head (replicated over TP, never split)."""
    return dict(num_query_groups=hf_config.num_attention_heads, kv_channels=hf_config.head_dim)


def config_fields(hf_config: Any) -> dict[str, Any]:
    """The experts' SwiGLU clamp (megatron's activation_func_clamp_value: gate <= limit, |up| <= limit); the
    layers' record is checked here too, so the pre-Ray check refuses what the ranks would."""
    layers_of(hf_config)
    return dict(activation_func_clamp_value=float(hf_config.swiglu_limit))


# ------------------------------------------------------------------ the MoE layers


def moe_architecture(hf_config: Any):
    """Every layer is an MoE layer: sqrt(softplus) scores renormalised over the top-k and scaled by
    routed_scaling_factor, the correction bias on the choice of `moe` layers, one ungated shared expert."""
    from slime.models.moe_arch import MoEArchitecture

    experts, topk = hf_config.n_routed_experts, hf_config.num_experts_per_tok
    if topk > experts:
        _fail(f"num_experts_per_tok={topk} is above n_routed_experts={experts}")
    return MoEArchitecture(
        num_layers=hf_config.num_hidden_layers, num_experts=experts, topk=topk,
        ffn_hidden_size=hf_config.moe_intermediate_size, norm_topk_prob=True,
        layer_pattern=(1,) * hf_config.num_hidden_layers,
        shared_expert_intermediate_size=hf_config.moe_intermediate_size, shared_expert_gate=False,
        hf_shared_expert="shared_experts", hf_block="ffn", hf_expert_projs=("w1", "w3", "w2"),
        hf_expert_bias="gate.bias", score_function="sqrtsoftplus", expert_bias=True,
        topk_scaling_factor=float(hf_config.routed_scaling_factor or 1.0))


def moe_names(layer_suffix: str, prefix: str, global_expert: int | None, arch: Any) -> tuple[str, ...] | None:
    """DeepSeek's spelling of the MoE block (`ffn.`): the shared expert's w1 / w3 / w2 and the hash table."""
    from slime.models.moe_hf import family_moe_names

    block = f"{prefix}ffn."
    if layer_suffix == "mlp.router.tid2eid":
        return (f"{block}gate.tid2eid",)
    if layer_suffix.startswith("mlp.shared_experts."):
        names = tuple(f"{block}shared_experts.{w}.weight" for w in ("w1", "w3", "w2"))
        return names[:2] if layer_suffix.endswith("linear_fc1.weight") else names[2:]
    return family_moe_names(layer_suffix, prefix, global_expert, arch)


# ------------------------------------------------------------------ HF <-> megatron names


def _attention_names(prefix: str) -> dict[str, str]:
    attn, ours = f"{prefix}attn.", "self_attention."
    names = {"linear_q_down_proj.weight": "wq_a.weight", "q_layernorm.weight": "q_norm.weight",
             "linear_q_up_proj.weight": "wq_b.weight", "linear_kv_proj.weight": "wkv.weight",
             "kv_layernorm.weight": "norm.weight", "linear_o_group_proj.weight": "wo_a.weight",
             "linear_proj.weight": "wo_b.weight", "sinks": "attn_sink"}
    compressor = {"linear_kv_proj.weight": "wkv.weight", "linear_gate_proj.weight": "wgate.weight",
                  "position_bias": "ape", "norm.weight": "norm.weight"}
    names.update({f"compressor.{k}": f"compressor.{v}" for k, v in compressor.items()})
    names.update({f"indexer.compressor.{k}": f"indexer.compressor.{v}" for k, v in compressor.items()})
    names.update({"indexer.linear_q_up_proj.weight": "indexer.wq_b.weight",
                  "indexer.weights_proj.weight": "indexer.weights_proj.weight"})
    return {f"{ours}{k}": f"{attn}{v}" for k, v in names.items()}


def layer_names(prefix: str) -> dict[str, str]:
    """megatron layer suffix -> HF name: the norms, the two mixers' hyper-connection weights, the attention."""
    names = {"input_layernorm.weight": f"{prefix}attn_norm.weight",
             "pre_mlp_layernorm.weight": f"{prefix}ffn_norm.weight"}
    for ours, theirs in (("attention_mixer", "hc_attn"), ("mlp_mixer", "hc_ffn")):
        names.update({f"{ours}.{part}": f"{prefix}{theirs}_{part}" for part in ("fn", "base", "scale")})
    return dict(names, **_attention_names(prefix))


def model_names(text: str) -> dict[str, str]:
    """The output layer (`head.weight`) and the final collapse of the streams (`hc_head`)."""
    head = {f"decoder.final_layernorm.hc_{part}": f"{text}hc_head.hc_{part}" for part in ("fn", "base", "scale")}
    return dict(head, **{"output_layer.weight": "head.weight"})


# ------------------------------------------------------------------ what is not built


def _given(args: Any, dest: str) -> Any:
    return getattr(args, dest, None)


def refuse_unbuilt(args: Any) -> None:
    """Flags whose meaning V4's layers do not build (module docstring); ValueError naming the fix."""
    refusals = [
        ((_given(args, "pipeline_model_parallel_size") or 1) > 1,
         "--pipeline-model-parallel-size above 1: the hc_mult residual streams are wider than the hidden state "
         "megatron's pipeline sends between stages; use --pipeline-model-parallel-size 1 (TP, SP, CP and EP split "
         "the model)"),
        (bool(_given(args, "spec")), "--spec: the V4 layers are this project's own (hyper-connections, compressed "
         "attention); drop --spec"),
        (bool(_given(args, "mtp_num_layers")), "--mtp-num-layers: transformers' class does not build V4's MTP "
         "layers, so nothing checks them; drop --mtp-num-layers and --enable-mtp-training"),
        (bool(_given(args, "enable_lora")), "--enable-lora: LoRA adapters are not built on V4's attention and "
         "mixers; train in full (drop --enable-lora)"),
        (bool(_given(args, "use_routing_replay") or _given(args, "use_rollout_routing_replay")),
         "--use-routing-replay / --use-rollout-routing-replay: V4's hash layers route by token id and its "
         "sqrt(softplus) router is not megatron's, whose replay these flags drive; drop them"),
        (bool(_given(args, "moe_aux_loss_coeff")) or _given(args, "moe_router_load_balancing_type") == "sinkhorn",
         "--moe-aux-loss-coeff / --moe-router-load-balancing-type sinkhorn: megatron's balancing reads softmax or "
         "sigmoid scores; V4 balances with its expert bias (--moe-router-bias-update-rate): drop them"),
        (bool(_given(args, "moe_expert_capacity_factor")), "--moe-expert-capacity-factor: transformers' class "
         "drops no token; drop the flag"),
        (bool(_given(args, "dsa_indexer_loss_coeff")), "--dsa-indexer-loss-coeff: the KL loss is built for "
         "GLM-5's indexer, not V4's compressed one (frozen here, as transformers' gets no gradient); drop it"),
    ]
    for refused, message in refusals:
        if refused:
            _fail(message)


def check_layout(hf_config: Any, args: Any) -> None:
    """Before Ray starts (config.json's fields): the flags V4's layers do not build, the output groups over TP."""
    refuse_unbuilt(args)
    tp, groups = _given(args, "tensor_model_parallel_size") or 1, getattr(hf_config, "o_groups", None)
    if isinstance(groups, int) and groups % tp:
        _fail(f"--tensor-model-parallel-size {tp} does not divide o_groups {groups} (each TP rank holds whole output "
              "groups); pick a TP size that divides it")


# ------------------------------------------------------------------ the layers


def deepseek_v4_spec(args: Any, config: Any, vp_stage: int | None = None):
    """Every layer of the model: hyper-connected, its attention of its kind, megatron's MoE layer with V4's
    router (sqrt(softplus) or hash) and experts; the final norm collapses the streams first."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    from slime.models.compressed_attention import CompressedSparseAttention
    from slime.models.deepseek_v4_routers import HashRouter, SqrtSoftplusRouter
    from slime.models.grouped_experts import grouped_experts_chosen
    from slime.models.hyper_connections import HyperConnectedLayer, HyperHeadNorm
    from slime.models.local_spec import with_moe_mlp
    from slime.models.sp_norm import SequenceParallelNorm

    refuse_unbuilt(args)
    layers: DeepseekV4Layers = dataclasses.replace(config.hf_layer_config,
                                                   fp32_weights=not getattr(args, "optimizer_cpu_offload", False))
    config.hf_layer_config = layers  # what the layers built from these specs read
    grouped = grouped_experts_chosen(args.moe_grouped_gemm)
    specs = []
    for attention, mlp in zip(layers.attention_kinds, layers.mlp_kinds):
        base = ModuleSpec(module=HyperConnectedLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=SequenceParallelNorm, pre_mlp_layernorm=SequenceParallelNorm,
            self_attention=ModuleSpec(module=CompressedSparseAttention, params={"kind": attention})))
        spec = with_moe_mlp(base, config, grouped)
        moe = spec.submodules.mlp
        router = HashRouter if mlp == HASH_MOE else SqrtSoftplusRouter
        moe = dataclasses.replace(moe, submodules=dataclasses.replace(moe.submodules, router=router))
        specs.append(dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=moe)))
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=HyperHeadNorm)


def prepare_model(model: Any) -> None:
    from slime.models.deepseek_v4_routers import feed_token_ids

    feed_token_ids(model)


# ------------------------------------------------------------------ every config field


def _one_shared_kv_head(value: Any, hf_config: Any) -> str | None:
    return None if value in (None, 1) else "V4's attention has one key/value head shared by every query head (K = V)"


DEEPSEEK_V4_FIELDS = table(
    CONFIG_OBJECT, DECODER, ATTENTION_BIAS, MLP_BIAS, ROUTER_TRAINING,
    num_key_value_heads=checked("1: one key/value head (K = V), replicated over TP", _one_shared_kv_head, 2),
    head_dim=built("each head's width, queries' and the shared key's"),
    intermediate_size=built("moe_intermediate_size (transformers' alias): the shared expert's width"),
    rope_parameters=built("main (sliding layers: rope_theta) and compress (compressed layers: compress_rope_theta, "
                          "default or YaRN with its attention_factor) RoPE on each head's last dimensions"),
    rope_theta=built("the main RoPE's base"),
    partial_rotary_factor=built("the rotated fraction of each head (its last qk_rope_head_dim dimensions)"),
    qk_rope_head_dim=built("head_dim x partial_rotary_factor (transformers derives it)"),
    q_lora_rank=built("the query down projection (wq_a) and the indexer's query input"),
    o_groups=built("the grouped output projection's groups (split over TP: o_groups % TP == 0)"),
    o_lora_rank=built("each output group's width (wo_a)"),
    sliding_window=built("the keys of each layer's local window (itself and window - 1 before)"),
    layer_types=built("each layer's attention: sliding, compressed sparse (indexer) or heavily compressed"),
    compress_rates=built("tokens per compressed key of each compressed attention kind"),
    compress_rope_theta=built("the compress RoPE's base"),
    index_n_heads=built("the indexer's query heads"),
    index_head_dim=built("the indexer's head width"),
    index_topk=built("the compressed keys the indexer keeps per query"),
    hc_mult=built("the hyper-connection streams of the residual"),
    hc_sinkhorn_iters=built("Sinkhorn iterations of the stream mixing matrix"),
    hc_eps=built("the hyper-connections' floor"),
    mlp_layer_types=built("each layer's router: hash (tid2eid) or sqrt(softplus) top-k"),
    n_routed_experts=built("the routed experts"),
    num_experts_per_tok=built("the router's top-k"),
    moe_intermediate_size=built("each routed expert's and the shared expert's width"),
    n_shared_experts=checked("1 shared expert of moe_intermediate_size (what transformers' class builds)",
                             must_be(1, "transformers' class builds one shared expert"), 2),
    routed_scaling_factor=built("moe_router_topk_scaling_factor"),
    scoring_func=checked("sqrtsoftplus", must_be("sqrtsoftplus", "V4's router scores are sqrt(softplus)"), "sigmoid"),
    norm_topk_prob=ignored("transformers' class renormalises the top-k weights whatever it says (so does this one)"),
    swiglu_limit=built("activation_func_clamp_value of every expert's SwiGLU"),
    router_jitter_noise=ignored("transformers' class does not read it"),
    num_nextn_predict_layers=ignored("the checkpoint's MTP layers: transformers' class does not build them, nor does "
                                     "this builder (--mtp-num-layers is refused)"),
)


DEEPSEEK_V4 = register(ModelFamily(
    name="DeepSeek-V4",
    model_types=("deepseek_v4",),
    hf_fields=DEEPSEEK_V4_FIELDS,
    experts_key="n_routed_experts",
    rope_types=None,  # layers_of reads both RoPEs
    rope_parameters=main_rope_parameters,
    arch_overrides=arch_overrides,
    config_fields=config_fields,
    layer_config=layers_of,
    default_spec=deepseek_v4_spec,
    prepare_model=prepare_model,
    check_layout=check_layout,
    moe_architecture=moe_architecture,
    moe_names=moe_names,
    layer_names=layer_names,
    model_names=model_names,
    transformer_engine_spec=False,
    batched_generation=False,
))
