"""The architecture the builder builds from an HF config, as one frozen record (`HFArch`), and the one map of the
megatron flags that must agree with it.

Both sides read the same record: the pre-Ray check turns config.json into transformers' own config object of the
family (`hf_config_from_dict`, as the ranks' AutoConfig does) and the rank-side builder
(slime/backends/megatron_utils/model.py) gets that object from AutoConfig; `hf_arch` runs every checked field
of the family's table (hf_fields.py), the RoPE and window checks, and gives the record; `arch_contradictions` names
every flag that says otherwise. Importing this module needs neither torch, megatron nor transformers
(`hf_config_from_dict` imports transformers when it runs).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from slime.models.hf_fields import CHECKED
from slime.models.registry import TEXT_PREFIX_ATTRIBUTE, ModelFamily, family_of, names_model_type
from slime.models.vision_arch import VISION_ATTRIBUTE

# megatron-core's Llama-3 RoPE scaling (RotaryEmbedding): only the factor is a parameter, the rest is fixed.
MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True, kw_only=True)
class YaRN:
    """YaRN's frequency interpolation and attention factor, as transformers' _compute_yarn_parameters reads them
    (megatron-core's YarnRotaryEmbedding builds the same: `yarn_*` fields of the TransformerConfig)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float | None
    mscale_all_dim: float | None
    truncate: bool
    """Whether the correction range is rounded to whole dimensions (transformers' default; gpt-oss: false)."""

    def megatron_fields(self) -> dict[str, Any]:
        return dict(yarn_rotary_scaling_factor=self.factor,
                    yarn_original_max_position_embeddings=self.original_max_position_embeddings,
                    yarn_beta_fast=self.beta_fast, yarn_beta_slow=self.beta_slow, yarn_mscale=self.mscale,
                    yarn_mscale_all_dim=self.mscale_all_dim, yarn_correction_range_round_to_int=self.truncate)


@dataclass(frozen=True, kw_only=True)
class RoPE:
    """The rotary embedding of the dense attention (multi-latent attention's is in HFArch.family_fields)."""

    type: str
    """"default", "llama3" or "yarn" (or what the family's config_fields reads, when its rope_types is None)."""
    base: float
    percent: float
    """The rotated fraction of each head's dimensions (partial_rotary_factor)."""
    llama3_factor: float | None = None
    yarn: YaRN | None = None
    """YaRN's parameters, for a family whose rope_types has "yarn" (gpt-oss)."""


@dataclass(frozen=True, kw_only=True)
class HFArch:
    """What the builder builds from one HF config: the dense TransformerConfig fields, the family's own fields, the
    layers' kinds and attention windows, and what the pre-Ray checks split over the parallel layout."""

    family: str
    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int | None
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    layernorm_epsilon: float
    qk_layernorm: bool
    add_qkv_bias: bool
    rotary_interleaved: bool
    attention_output_gate: bool
    layernorm_zero_centered_gamma: bool
    post_norms: bool
    rope: RoPE
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    initializer_range: float
    family_fields: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """ModelFamily.config_fields: further TransformerConfig fields (MLA's latent ranks, the DeltaNet's sizes)."""
    layer_kinds: tuple[str, ...] | None = None
    attention_windows: tuple[int | None, ...] | None = None
    """Per layer, the keys a query sees (itself and the window - 1 before it), None for all earlier keys; None
    when no layer slides."""
    num_experts: int = 0
    experts_key: str | None = None
    """The config key of the routed-expert count (named in messages)."""
    expert_groups: tuple[int, int] = (1, 1)
    """(n_group, topk_group): the groups the experts split into and those a token may use (DeepSeek-style
    group-limited routing; (1, 1) without)."""

    @property
    def multi_latent_attention(self) -> bool:
        return bool(self.family_fields.get("multi_latent_attention", False))

    @property
    def rotary_base(self) -> float:
        return self.rope.base

    @property
    def rotary_percent(self) -> float:
        return self.rope.percent

    def transformer_fields(self) -> dict[str, Any]:
        """The dense TransformerConfig fields (the family's own are family_fields)."""
        return {name: getattr(self, name) for name in _TRANSFORMER_FIELDS}


_TRANSFORMER_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                       "kv_channels", "layernorm_epsilon", "qk_layernorm", "add_qkv_bias", "rotary_interleaved",
                       "attention_output_gate", "layernorm_zero_centered_gamma")


# ---------------------------------------------------------------- config.json -> transformers' config object
def hf_config_from_dict(whole: dict) -> Any:
    """transformers' config object of a registered family from config.json's dict, as the ranks get it from
    AutoConfig: the family's own class, or the class that reads a model_type transformers ships none for
    (ModelFamily.hf_config_types). registry.language_model_config gives the config the builder builds."""
    from transformers import CONFIG_MAPPING

    from slime.models.registry import family as family_named

    model_type = whole["model_type"]
    reference = family_named(model_type).hf_config_types.get(model_type, model_type)
    config = CONFIG_MAPPING[reference].from_dict(dict(whole))
    config.model_type = model_type  # the checkpoint's own, for a class read in its stead
    return config


# ---------------------------------------------------------------- the record
def check_fields(hf_config: Any, rules: Mapping[str, Any]) -> None:
    """Every checked field of `rules` the config has: ValueError naming the first value not built here."""
    for name, rule in rules.items():
        if rule.how == CHECKED and hasattr(hf_config, name):
            value = getattr(hf_config, name)
            problem = rule.check(value, hf_config)
            if problem:
                raise ValueError(f"config.json {name}={value!r}: {problem}")


def undeclared_fields(hf_config: Any, rules: Mapping[str, Any]) -> list[str]:
    """The config's fields that `rules` does not declare (config.json keys no table knows)."""
    aliases = getattr(type(hf_config), "attribute_map", None) or {}
    return sorted(name for name in vars(hf_config) if not name.startswith("_") and name not in rules
                  and name not in aliases and name not in (TEXT_PREFIX_ATTRIBUTE, VISION_ATTRIBUTE))


def _rope_params(hf_config: Any) -> dict:
    """rope_parameters (transformers 5) or rope_scaling (transformers 4.x spelling)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"rope_parameters per layer type ({sorted(params)}) are not built here; one RoPE for every "
                         "layer is")
    return dict(params)


def rope_of(hf_config: Any, family: ModelFamily) -> RoPE:
    """The dense attention's RoPE, read from either spelling; a type or a Llama-3 factor not built is refused."""
    params = dict(family.rope_parameters(hf_config)) if family.rope_parameters else _rope_params(hf_config)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if family.rope_types is not None and rope_type not in family.rope_types:
        raise ValueError(f"config.json has rope type {rope_type!r} (rope_parameters / rope_scaling), which the "
                         f"{family.name} builder does not build; it builds {' and '.join(family.rope_types)}")
    theta = params.get("rope_theta")
    theta = getattr(hf_config, "rope_theta", None) if theta is None else theta  # 4.x: beside rope_scaling
    percent = params.get("partial_rotary_factor") or getattr(hf_config, "partial_rotary_factor", 1.0)
    rope = RoPE(type=rope_type, base=float(theta if theta is not None else 10000.0), percent=float(percent or 1.0))
    if rope_type == "yarn" and family.rope_types is not None:
        return RoPE(type=rope_type, base=rope.base, percent=rope.percent, yarn=_yarn(params, hf_config))
    if rope_type != "llama3":
        return rope
    if params.get("factor") is None:
        raise ValueError("llama3 RoPE without its factor (rope_parameters.factor); fix config.json")
    differ = {key: params.get(key) for key, built in MEGATRON_LLAMA3.items()
              if params.get(key) is None or float(params[key]) != built}
    if differ:
        raise ValueError(f"llama3 RoPE with {differ}: megatron-core builds Llama-3's scaling with low_freq_factor 1, "
                         "high_freq_factor 4 and original_max_position_embeddings 8192 only (every released Llama 3.x)")
    return RoPE(type=rope_type, base=rope.base, percent=rope.percent, llama3_factor=float(params["factor"]))


def _yarn(params: dict, hf_config: Any) -> YaRN:
    """YaRN's parameters; an explicit attention_factor other than the one derived from the factor is refused
    (megatron-core derives it, as transformers does without one)."""
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("yarn RoPE without original_max_position_embeddings (rope_parameters); fix config.json")
    factor = params.get("factor") or hf_config.max_position_embeddings / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    derived = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
               else _yarn_mscale(factor, 1.0))
    given = params.get("attention_factor")
    if given is not None and abs(float(given) - derived) > 1e-9:
        raise ValueError(f"yarn RoPE with attention_factor {given}: megatron-core derives it from the factor and "
                         f"mscale ({derived:g}); drop attention_factor from rope_parameters or set it to that")
    return YaRN(factor=float(factor), original_max_position_embeddings=int(original),
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                mscale=float(mscale) if mscale and mscale_all_dim else None,
                mscale_all_dim=float(mscale_all_dim) if mscale and mscale_all_dim else None,
                truncate=bool(params.get("truncate", True)))


def _yarn_mscale(factor: float, mscale: float | None) -> float:
    return 1.0 if factor <= 1 else 0.1 * (mscale or 0.0) * math.log(factor) + 1.0


def sliding_windows(hf_config: Any) -> tuple[int | None, ...] | None:
    """Each layer's key window as transformers' Qwen2 / Qwen3 configs give it: `sliding_window` on the layers whose
    `layer_types` entry is "sliding_attention" (transformers derives the list from use_sliding_window and
    max_window_layers, and unsets sliding_window without use_sliding_window); None when no layer slides."""
    kinds = list(getattr(hf_config, "layer_types", None) or ())
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"config.json layer_types has {unknown}, which no layer here builds; the supported kinds "
                         "are full_attention and sliding_attention")
    if len(kinds) not in (0, hf_config.num_hidden_layers):
        raise ValueError(f"config.json layer_types lists {len(kinds)} layers, num_hidden_layers is "
                         f"{hf_config.num_hidden_layers}")
    if "sliding_attention" not in kinds:
        return None
    window = getattr(hf_config, "sliding_window", None)
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json layer_types has sliding_attention layers but sliding_window is {window!r} "
                         "(use_sliding_window unset?); set use_sliding_window and a positive sliding_window, or make "
                         "every layer full_attention")
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def _dense_fields(hf_config: Any, family: ModelFamily) -> dict[str, Any]:
    heads = hf_config.num_attention_heads
    fields = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=getattr(hf_config, "intermediate_size", None),
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        layernorm_epsilon=hf_config.rms_norm_eps,
        qk_layernorm=family.qk_layernorm,
        add_qkv_bias=family.qkv_bias,
        rotary_interleaved=family.rotary_interleaved,
        attention_output_gate=family.attention_output_gate,
        layernorm_zero_centered_gamma=family.zero_centered_norms,
    )
    overrides = family.arch_overrides(hf_config)
    unknown = set(overrides) - set(fields)
    if unknown:
        raise TypeError(f"{family.name}'s arch_overrides sets {sorted(unknown)}, which are not dense fields")
    return {**fields, **overrides}


def hf_arch(hf_config: Any) -> HFArch:
    """The record of an HF config of a registered family (a config outside the registry is read as Llama's);
    ValueError naming what config.json says that is not built here."""
    family = family_of(hf_config)
    check_fields(hf_config, family.hf_fields)
    windows = family.attention_windows(hf_config) if family.attention_windows is not None else None
    experts = int(getattr(hf_config, family.experts_key, 0) or 0) if family.experts_key else 0
    return HFArch(
        family=family.name,
        model_type=getattr(hf_config, "model_type", "") or "",
        **_dense_fields(hf_config, family),
        post_norms=family.post_norms,
        rope=rope_of(hf_config, family),
        vocab_size=hf_config.vocab_size,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=getattr(hf_config, "max_position_embeddings", None),
        initializer_range=getattr(hf_config, "initializer_range", 0.02),
        family_fields=MappingProxyType(dict(family.config_fields(hf_config))),
        layer_kinds=family.layer_kinds(hf_config) if family.layer_kinds is not None else None,
        attention_windows=windows,
        num_experts=experts,
        experts_key=family.experts_key if experts else None,
        expert_groups=(getattr(hf_config, "n_group", None) or 1, getattr(hf_config, "topk_group", None) or 1),
    )


# ---------------------------------------------------------------- the flags against the record
# megatron flag dest -> (HFArch attribute, the HF config key it comes from, None for a property of the family's
# layers): the model is built from the config, so a flag the user passed must agree with it.
ARCH_FLAGS: Mapping[str, tuple[str, str | None]] = MappingProxyType({
    "num_layers": ("num_layers", "num_hidden_layers"),
    "hidden_size": ("hidden_size", "hidden_size"),
    "ffn_hidden_size": ("ffn_hidden_size", "intermediate_size"),
    "num_attention_heads": ("num_attention_heads", "num_attention_heads"),
    "num_query_groups": ("num_query_groups", "num_key_value_heads"),
    "kv_channels": ("kv_channels", "head_dim"),
    "norm_epsilon": ("layernorm_epsilon", "rms_norm_eps"),
    "qk_layernorm": ("qk_layernorm", None),
    "add_qkv_bias": ("add_qkv_bias", None),
    "rotary_base": ("rotary_base", "rope_theta"),
    "rotary_percent": ("rotary_percent", "partial_rotary_factor"),
    "rotary_interleaved": ("rotary_interleaved", None),
    "post_self_attn_layernorm": ("post_norms", None),
    "post_mlp_layernorm": ("post_norms", None),
    "attention_output_gate": ("attention_output_gate", None),
    "apply_layernorm_1p": ("layernorm_zero_centered_gamma", None),
})


@dataclass(frozen=True)
class Contradiction:
    """A flag the user passed that the HF config contradicts."""

    dest: str
    given: Any
    value: Any
    """What the flag would have to be; None for a flag that can only be dropped."""
    reason: str
    """What the config says (e.g. "num_hidden_layers = 4", "Qwen3 layers have no such thing")."""

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    def on_rank(self) -> str:
        said = self.flag if self.value is None else f"{self.flag}={self.given}"
        return f"{said} contradicts the HF config ({self.reason})"

    def before_ray(self, config_path: str) -> str:
        if self.value is None or isinstance(self.given, bool):
            return (f"{self.flag} contradicts {config_path} ({self.reason}); the model is built from the config: "
                    "drop the flag")
        given, value = (f"{v:g}" if isinstance(v, float) else v for v in (self.given, self.value))
        return (f"{self.flag} {given} contradicts {config_path} ({self.reason}); the model is built from the "
                f"config: drop the flag or pass {self.flag} {value}")


def _same(given: Any, value: Any) -> bool:
    return abs(given - value) <= 1e-12 if isinstance(value, float) else given == value


def _valued(dest: str, given: Any, value: Any, key: str | None, family: str) -> Contradiction | None:
    if given is None or value is None or (isinstance(given, bool) and not given):
        return None  # not given (store_true flags default to False), or nothing to compare with
    if _same(given, value):
        return None
    reason = f"{key} = {value}" if key else (f"{family} layers have no such thing" if value is False else str(value))
    return Contradiction(dest, given, value, reason)


def arch_contradictions(arch: HFArch, args: Any, family: ModelFamily) -> list[Contradiction]:
    """Every flag of `args` the record contradicts: the architecture flags (ARCH_FLAGS), the family's own
    (ModelFamily.config_flags over its config_fields), Llama-3's --use-rope-scaling / --rotary-scaling-factor,
    --multi-latent-attention, the embedding tying, a --spec plug-in or MTP layers beside sliding windows, and
    --model-name."""
    found = []
    for dest, (attribute, key) in ARCH_FLAGS.items():
        if dest == "add_qkv_bias" and arch.multi_latent_attention:
            if args.add_qkv_bias:  # upstream's GLM-4.7-Flash launcher passes it
                warnings.warn("--add-qkv-bias has no effect with multi-latent attention: megatron-core's MLA "
                              "projections take no q/k/v bias, and the HF config has none (attention_bias=false is "
                              "checked)", stacklevel=3)
            continue
        found.append(_valued(dest, getattr(args, dest), getattr(arch, attribute), key, arch.family))
    for dest, key in family.config_flags.items():
        found.append(_valued(dest, getattr(args, dest), arch.family_fields.get(key), key, arch.family))
    if not arch.multi_latent_attention:  # MLA's --rotary-scaling-factor is its YaRN factor (config_flags)
        if args.use_rope_scaling and arch.rope.type != "llama3":
            found.append(Contradiction("use_rope_scaling", True, None, f"it asks for Llama-3 RoPE scaling, but the "
                                       f"config's rope type is {arch.rope.type!r}"))
        if arch.rope.yarn is not None:
            found.append(_valued("rotary_scaling_factor", args.rotary_scaling_factor, arch.rope.yarn.factor,
                                 "yarn rope factor", arch.family))
        else:
            found.append(_valued("rotary_scaling_factor", args.rotary_scaling_factor, arch.rope.llama3_factor,
                                 "llama3 rope factor", arch.family))
    if args.multi_latent_attention and not arch.multi_latent_attention:
        found.append(Contradiction("multi_latent_attention", True, None,
                                   f"model_type {arch.model_type}, no latent attention"))
    if args.untie_embeddings_and_output_weights and arch.tie_word_embeddings:
        found.append(Contradiction("untie_embeddings_and_output_weights", True, None, "tie_word_embeddings=True"))
    if arch.attention_windows is not None:
        if args.spec:
            found.append(Contradiction("spec", " ".join(args.spec), None, "sliding-window layers, which the built-in "
                                       "layer spec builds and a plug-in's attention would not"))
        if args.mtp_num_layers:
            found.append(Contradiction("mtp_num_layers", args.mtp_num_layers, None,
                                       "sliding-window layers: the MTP layers' windows are not built here"))
    if args.model_name and not names_model_type(args.model_name, arch.model_type):
        found.append(Contradiction("model_name", args.model_name, arch.model_type, f"model_type {arch.model_type}"))
    return [c for c in found if c is not None]
