"""The model-family registry: an HF config.json's `model_type` -> the one `ModelFamily` that says how to build,
load, save and push that model. The builder, the HF weight mapping (load, save-hf, the weight push) and the MoE
config ask `family_of(hf_config)`; none of them names a family.

A family module describes its models with one frozen `ModelFamily` and calls `register` at import; the
built-in modules are listed in `_BUILTIN_MODULES` and imported on the first look-up. Importing this module
(and every family module's top level) needs neither torch nor megatron, so argument checking can ask
`supported_model_types()` cheaply.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from slime.models.hf_fields import ATTENTION_BIAS, CONFIG_OBJECT, DECODER, MLP_BIAS, FieldRule, table

# One module per family; adding a family is its module plus its line here.
_BUILTIN_MODULES = (
    "slime.models.qwen",
    "slime.models.llama",
    "slime.models.qwen3_moe",
    "slime.models.deepseek_v3",
    "slime.models.glm4",
    "slime.models.qwen3_5",
    "slime.models.glm4_moe",
    "slime.models.minimax_m2",
    "slime.models.glm_moe_dsa",
    "slime.models.mimo",
    "slime.models.deepseek_v4",
    "slime.models.gpt_oss",
    "slime.models.deepseek_v32",
    "slime.models.kimi_linear",
    "slime.models.qwen_vl",
    "slime.models.qwen3_vl_moe",
)

# What a model_type outside the registry is read as (arguments.py lets one through only with a custom model
# provider, whose weights still load through the HF mapping): the plain Llama-style dense layout.
_FALLBACK_MODEL_TYPE = "llama"


def _dense_layer_spec(config: Any) -> Any:
    from slime.models.local_spec import dense_layer_spec

    return dense_layer_spec(config)


def _no_fields(hf_config: Any) -> dict[str, Any]:
    return {}


def _no_names(prefix: str) -> dict[str, str]:
    return {}


def _no_layouts(prefix: str, hf_config: Any) -> dict[str, tuple]:
    return {}


# The fields of a Llama-style dense config (transformers' LlamaConfig): what a family declares when it adds none.
DENSE_FIELDS = table(CONFIG_OBJECT, DECODER, ATTENTION_BIAS, MLP_BIAS)


def _shared_moe_names(layer_suffix: str, prefix: str, global_expert: int | None, arch: Any) -> tuple[str, ...] | None:
    from slime.models.moe_hf import family_moe_names

    return family_moe_names(layer_suffix, prefix, global_expert, arch)


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """What one HF model family is in megatron's terms. Every layer is a pre-norm decoder layer with a SwiGLU
    MLP and RMSNorm (the generic part the builder and hf_weights.py handle); the fields say how this family
    differs from that."""

    name: str
    """Shown in messages (e.g. "DeepSeek-V3")."""
    model_types: tuple[str, ...]
    """The HF config.json `model_type` values this family builds."""
    composite_types: tuple[str, ...] = ()
    """model_types of vision + text checkpoints (config.text_config, weights under `model.language_model.`) whose
    text model this family trains; their vision tower is built only for a run that trains on images
    (`language_model_config`), else carried through unchanged."""
    composite_text_prefix: str = "model.language_model."
    """Where a composite checkpoint of this family keeps its text model's weights (Qwen2.5-VL's, written in
    Qwen2-VL's layout: `model.`; the output layer is `lm_head` either way)."""
    vision: Callable[[Any], Any] | None = None
    """composite hf_config -> its `vision_arch.VisionArch`: the family trains the vision tower with the text model on
    images (slime/models/vision_language.py); None: a run with images is refused."""
    hf_config_types: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """model_type -> the transformers model_type whose config class reads it, for a model_type transformers ships
    no class for (MiMo: Qwen2's; Kimi-K2: DeepSeek-V3's)."""

    # ---- HF config fields (hf_fields.py): every field of the family's config class, declared
    hf_fields: Mapping[str, FieldRule] = field(default_factory=lambda: DENSE_FIELDS)
    """config field -> how the builder treats it (built, checked against the one value built, or ignored with the
    reason); tests/test_hf_fields.py walks transformers' class of every model_type against it."""
    composite_fields: Mapping[str, FieldRule] = field(default_factory=lambda: MappingProxyType({}))
    """The same for the vision + text wrapper config of `composite_types` (its text_config is `hf_fields`')."""
    experts_key: str | None = None
    """The config key of the routed-expert count (n_routed_experts, num_experts, ...); None for a dense family."""
    attention_windows: Callable[[Any], tuple[int | None, ...] | None] | None = None
    """hf_config -> each layer's sliding key window (None for a full-attention layer), or None when no layer slides
    (hf_arch.sliding_windows reads transformers' Qwen2 / Qwen3 spelling); None: the family has no windows."""
    sglang_serves_windows: bool = False
    """SGLang's model of this family applies the windows (gpt-oss); False: SGLang 0.5 serves every layer with full
    attention (its qwen2 / qwen3 / mimo models), which the run warns of where a layer slides."""

    # ---- HF config -> TransformerConfig
    qk_layernorm: bool = False
    """RMSNorm on each head's q and k (Qwen3's q_norm / k_norm; MLA's latent q/kv norms)."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections only (Qwen2, GLM-4): HF's attention_bias is allowed."""
    rotary_interleaved: bool = False
    """RoPE on interleaved pairs of dimensions (GLM-4), not on two halves."""
    post_norms: bool = False
    """A norm on each branch's output before its residual add (GLM-4): what --post-self-attn-layernorm and
    --post-mlp-layernorm must agree with."""
    attention_output_gate: bool = False
    """A per-head sigmoid gate on the attention output before o_proj (HF q_proj rows per head: [q_h; gate_h]):
    what --attention-output-gate must agree with."""
    zero_centered_norms: bool = False
    """Every RMSNorm scales by 1 + weight (HF Qwen3-Next / Qwen3.5): what --apply-layernorm-1p must agree with."""
    rope_types: tuple[str, ...] | None = ("default", "llama3")
    """RoPE types the builder accepts; None: `config_fields` checks the RoPE itself."""
    rope_parameters: Callable[[Any], Mapping[str, Any]] | None = None
    """hf_config -> the RoPE parameters of megatron's GPT model where config.json spells them per rope kind
    (DeepSeek-V4's `main` / `compress`; its layers build both themselves); None: rope_parameters / rope_scaling."""
    arch_overrides: Callable[[Any], dict[str, Any]] = _no_fields
    """hf_config -> dense architecture fields this family sets otherwise (MLA: one kv head per query head)."""
    config_fields: Callable[[Any], dict[str, Any]] = _no_fields
    """hf_config -> further TransformerConfig fields (MLA: latent ranks, head dims, YaRN). With
    multi_latent_attention=True among them the builder makes an MLATransformerConfig."""
    config_flags: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """megatron flag dest -> key of `config_fields`: a flag the user passed must agree with the HF config."""

    # ---- layer spec
    layer_spec: Callable[..., Any] = _dense_layer_spec
    """config -> the local (no TransformerEngine) spec of one dense layer; MoE layers replace its MLP."""
    layer_kinds: Callable[[Any], tuple[str, ...]] | None = None
    """hf_config -> the kind of every layer's token mixer (hybrid stacks: Qwen3-Next's "linear_attention" /
    "full_attention"); None: every layer is `layer_spec`'s. Each pipeline stage builds its own layers' specs."""
    kind_layer_spec: Callable[[Any, str], Any] | None = None
    """(config, layer kind) -> the local spec of a dense layer of that kind (MoE layers replace its MLP)."""
    default_spec: Callable[..., Any] | None = None
    """The family's own `--spec` function (upstream's signature fn(args, config, vp_stage)), used when the
    user names none (GLM-4's post-norm layers)."""
    spec_plugins: tuple[str, ...] = ()
    """Upstream's `--spec MODULE FUNCTION` plug-ins that build this family's layers (aliases in slime_plugins)."""
    transformer_engine_spec: bool = True
    """Whether megatron's TransformerEngine layer spec (--transformer-impl transformer_engine) builds these layers;
    False: the family's local spec is built whatever that flag says (GLM-5's sparse attention)."""
    check_config: Callable[[Any], None] | None = None
    """hf_config (config.json's fields) -> None, or ValueError naming the fix: what the family refuses, checked
    before Ray starts (GLM-5's indexer settings)."""
    layer_config: Callable[[Any], Any] | None = None
    """hf_config -> a frozen record of the layer facts no TransformerConfig field holds, set on the
    TransformerConfig as `hf_layer_config` for the family's own layers (DeepSeek-V4's compression, indexer,
    hyper-connections)."""
    prepare_model: Callable[[Any], None] | None = None
    """Called on each GPTModel chunk the builder makes: a family whose layers read more of the forward's inputs
    than the hidden states (DeepSeek-V4's hash routers read the token ids) hooks them up here."""
    check_layout: Callable[[Any, Any], None] | None = None
    """(hf_config, args) -> None, or ValueError naming the fix: a pipeline split, recompute grouping or engine the
    family's layers cannot run under (GLM-5.2's shared indexer layers; gpt-oss's MXFP4 experts with SGLang
    engines), checked before Ray starts."""
    moe_architecture: Callable[[Any], Any] | None = None
    """hf_config -> MoEArchitecture of its MoE layers, or None when every layer is dense."""

    # ---- HF <-> megatron parameter names (hf_weights.py does the layouts)
    layer_names: Callable[[str], dict[str, str]] = _no_names
    """HF layer prefix ('model.layers.L.') -> {megatron layer suffix: HF name} for the parameters this family
    adds or names otherwise (taking precedence over the dense table)."""
    model_names: Callable[[str], dict[str, str]] = _no_names
    """HF text prefix ('model.') -> {megatron name: HF name} for parameters outside the layers that the family
    adds or names otherwise (DeepSeek-V4's hyper-connection head and `head.weight`)."""
    layer_layouts: Callable[[str, Any], dict[str, tuple]] = _no_layouts
    """(HF layer prefix, hf_config) -> {megatron layer suffix: (HF names, to_megatron, to_hf)} for parameters
    whose layout differs from HF's beyond a rename: to_megatron takes the HF tensors (a list) and gives the full
    megatron tensor, to_hf the inverse (a list, in HF-name order)."""
    dense_mlp_block: str = "mlp"
    """The checkpoint's module name of a dense layer's MLP (Kimi-Linear: block_sparse_moe, as its MoE block)."""
    fused_gate_up: Callable[[str], str] | None = None
    """HF layer prefix -> the name of the MLP's fused [gate; up] tensor, when HF stores them as one."""
    moe_names: Callable[[str, str, int | None, Any], tuple[str, ...] | None] = _shared_moe_names
    """(megatron layer suffix, HF layer prefix, global expert index, MoEArchitecture or None) -> the HF names
    of an MoE-layer parameter ((gate, up) for an fc1), None when it is not one. Default: the Qwen-MoE and
    DeepSeek-V3 spelling (moe_hf.py)."""

    batched_generation: bool = True
    """Whether the embedded engine may run several left-padded sequences in one forward; False where padding
    changes the maths (DeepSeek-V4's compressors window each row from its first position)."""
    stacked_experts: Callable[[str, str, int, Any], tuple | None] | None = None
    """(megatron layer suffix of a routed expert's parameter, HF layer prefix, expert-TP size, hf_config) -> (HF names
    (one), to_megatron, to_hf) of one expert's row of a tensor that stacks the layer's experts along dim 0, or None:
    checkpoints storing a layer's experts as one tensor (gpt-oss's mlp.experts.gate_up_proj [E, H, 2I])."""

    in_memory_target: Callable[[str, Any, Any], tuple[str, Any] | None] | None = None
    """(checkpoint tensor name, transformers' state names, hf_config) -> (the state name it lives in, the rows of it or
    a function giving the checkpoint-layout view of it), or None: where transformers' class keeps a checkpoint tensor
    it renames, stacks or transposes on load (Kimi-Linear's forget gate and per-projection convolutions, Qwen3-VL-MoE's
    fused experts), for the embedded engine's weight updates."""

    mtp_names: Callable[[Any, int], Any] | None = None
    """(hf_config, MTP layer index) -> `mtp.MTPLayerNames`, how the checkpoint spells its multi-token-prediction
    layers; None: the family has none this builder maps."""

    def layer_spec_at(self, config: Any, hf_config: Any, layer: int) -> Any:
        """The local spec of global layer `layer` before any MoE replacement."""
        if self.layer_kinds is None:
            return self.layer_spec(config)
        return self.kind_layer_spec(config, self.layer_kinds(hf_config)[layer])

    def moe(self, hf_config: Any) -> Any:
        """The MoEArchitecture of this HF config, or None for a dense model."""
        return self.moe_architecture(hf_config) if self.moe_architecture is not None else None


_FAMILIES: dict[str, ModelFamily] = {}
_LOADED = False


def register(family: ModelFamily) -> ModelFamily:
    """Make `family` the one that builds its model types (called by the family's module at import)."""
    for model_type in (*family.model_types, *family.composite_types):
        taken = _FAMILIES.get(model_type)
        if taken is not None and taken is not family:
            raise ValueError(f"model_type {model_type!r} is registered twice ({taken.name} and {family.name})")
        _FAMILIES[model_type] = family
    return family


def _load_builtin() -> None:
    global _LOADED
    if not _LOADED:
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)
        _LOADED = True


def supported_model_types() -> tuple[str, ...]:
    """Every HF model_type a registered family builds, in registration order."""
    _load_builtin()
    return tuple(_FAMILIES)


def registered_families() -> tuple[ModelFamily, ...]:
    """Every registered family once, in registration order."""
    _load_builtin()
    return tuple({id(family): family for family in _FAMILIES.values()}.values())


def _model_name_stem(name: str) -> str:
    return name.lower().removesuffix("_text").removesuffix("_moe")


def model_names() -> tuple[str, ...]:
    """What --model-name accepts: every registered model_type and its family name without the "_text" / "_moe"
    suffix (qwen3 for qwen3_moe, qwen3_5 for qwen3_5_moe_text)."""
    return tuple(dict.fromkeys(n for model_type in supported_model_types()
                               for n in (model_type, _model_name_stem(model_type))))


def names_model_type(model_name: str, model_type: str) -> bool:
    """Whether --model-name names this model_type (either of them may carry the suffixes)."""
    return _model_name_stem(model_name) == _model_name_stem(model_type)


def expert_count_keys() -> tuple[str, ...]:
    """Every registered family's config key of the routed-expert count."""
    return tuple(dict.fromkeys(f.experts_key for f in registered_families() if f.experts_key))


def routed_experts(config: Mapping[str, Any]) -> int:
    """The routed-expert count a config.json dict gives under any registered family's key (0 for a dense model):
    what a checkpoint of a model_type outside the registry is taken to have."""
    return max((int(config.get(key) or 0) for key in expert_count_keys()), default=0)


def spec_plugins() -> tuple[str, ...]:
    """Upstream's `--spec` plug-ins the registered families build."""
    return tuple(plugin for family in registered_families() for plugin in family.spec_plugins)


def family(model_type: str) -> ModelFamily:
    """The family registered for an HF model_type (KeyError when none is)."""
    _load_builtin()
    if model_type not in _FAMILIES:
        raise KeyError(f"no model family builds model_type {model_type!r}; supported: {', '.join(_FAMILIES)}")
    return _FAMILIES[model_type]


# A composite checkpoint's text weights: `model.language_model.X` for the text model's `model.X` (transformers'
# composite classes keep them there in memory; ModelFamily.composite_text_prefix says where a checkpoint does).
COMPOSITE_TEXT_PREFIX = "model.language_model."
TEXT_PREFIX_ATTRIBUTE = "slime_text_weight_prefix"
"""Set on the text config `language_model_config` returns: where its weights sit in the checkpoint."""


def language_model_config(hf_config: Any, vision: bool = False) -> Any:
    """The HF config the trainer builds: a composite (vision + text) checkpoint's text_config, marked with the
    prefix of its weights in the checkpoint (hf_weights.py reads it) and, with `vision` (the run trains on images),
    with its VisionArch (vision_arch.VISION_ATTRIBUTE: the builder puts the vision tower in front); any other config
    as it is. ValueError when `vision` is asked of a checkpoint whose family builds no vision tower."""
    from slime.models.hf_arch import check_fields
    from slime.models.vision_arch import VISION_ATTRIBUTE

    _load_builtin()
    family = _FAMILIES.get(getattr(hf_config, "model_type", "") or "")
    if family is None or hf_config.model_type not in family.composite_types:
        if vision:
            raise ValueError(f"model_type {getattr(hf_config, 'model_type', None)!r} is no vision + text checkpoint "
                             f"a family here trains with its vision tower (those: {', '.join(vision_model_types())})")
        return hf_config
    check_fields(hf_config, family.composite_fields)
    text = hf_config.text_config
    setattr(text, TEXT_PREFIX_ATTRIBUTE, family.composite_text_prefix)
    if hasattr(hf_config, "tie_word_embeddings"):  # transformers' composite class ties by its own config's
        text.tie_word_embeddings = hf_config.tie_word_embeddings
    if vision:
        if family.vision is None:
            raise ValueError(f"{family.name} ({hf_config.model_type}): its vision tower is not built here, so it "
                             f"trains on text only (vision + text checkpoints trained on images: "
                             f"{', '.join(vision_model_types())})")
        setattr(text, VISION_ATTRIBUTE, family.vision(hf_config))
    return text


def vision_model_types() -> tuple[str, ...]:
    """The composite model_types whose family trains the vision tower on images."""
    _load_builtin()
    return tuple(t for f in registered_families() if f.vision is not None for t in f.composite_types)


def family_of(hf_config: Any) -> ModelFamily:
    """The family of an HF config (its model_type); outside the registry, the plain Llama-style dense one."""
    _load_builtin()
    return _FAMILIES.get(getattr(hf_config, "model_type", "") or "", _FAMILIES[_FALLBACK_MODEL_TYPE])
