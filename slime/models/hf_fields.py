"""Every field of an HF model config, declared: how the model builder treats it.

A family's `ModelFamily.hf_fields` maps each field of its transformers config class (and the config.json keys its
released checkpoints add) to one `FieldRule`:

- built: the field sets what the builder builds (a TransformerConfig field, a layer kind, a window, a name);
- checked: the builder builds one value of it; `check(value, hf_config)` names any other, and the config is refused
  before Ray starts and again on the ranks (`hf_arch.hf_arch` runs every check);
- ignored: the field does not change the log-probs or the gradient of the model this project trains (token ids,
  `use_cache`, HF's own training-mode knobs), with the reason.

tests/test_hf_fields.py walks transformers' own config class of every registered family and fails on a field that
is not declared here; a config.json key that is in no table is named by a warning before Ray starts. Importing this
module needs neither torch, megatron nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

BUILT, CHECKED, IGNORED = "built", "checked", "ignored"


@dataclass(frozen=True)
class FieldRule:
    how: str
    """BUILT, CHECKED or IGNORED."""
    note: str
    """What the builder does with the field (BUILT), the one value built (CHECKED), or why it changes nothing
    trained here (IGNORED)."""
    check: Callable[[Any, Any], str | None] | None = None
    """CHECKED: (value, hf_config) -> what is wrong with the value and how to fix it, or None."""
    refuses: Any = None
    """CHECKED: one value `check` refuses (the field-table test tries it)."""


def built(note: str) -> FieldRule:
    return FieldRule(BUILT, note)


def ignored(note: str) -> FieldRule:
    return FieldRule(IGNORED, note)


def checked(note: str, check: Callable[[Any, Any], str | None], refuses: Any) -> FieldRule:
    return FieldRule(CHECKED, note, check, refuses)


def table(*parts: Mapping[str, FieldRule], **rules: FieldRule) -> Mapping[str, FieldRule]:
    """One read-only table from shared parts and a family's own rules (later ones win)."""
    merged: dict[str, FieldRule] = {}
    for part in parts:
        merged.update(part)
    merged.update(rules)
    return MappingProxyType(merged)


# ---------------------------------------------------------------- checks shared by several families
def must_be(expected: Any, why: str) -> Callable[[Any, Any], str | None]:
    """A check that accepts `expected` only (None counts as absent when `expected` is falsy)."""

    def check(value: Any, hf_config: Any) -> str | None:
        if value == expected or (not expected and value is None):
            return None
        return f"{value!r} is not built here ({why}); only {expected!r} is"

    return check


def _no_quantization(value: Any, hf_config: Any) -> str | None:
    if not value:
        return None
    method = value.get("quant_method", "?") if isinstance(value, dict) else type(value).__name__
    return (f"quantized weights ({method}) are not dequantised on load here; point --hf-checkpoint at the bf16 or "
            "fp32 weights of the model")


# ---------------------------------------------------------------- the tables every family starts from
CONFIG_OBJECT = table(
    model_type=built("picks the family (slime/models/registry.py)"),
    architectures=ignored("the HF class names; the family is picked by model_type"),
    dtype=ignored("the checkpoint's storage dtype; the trainer's is --bf16 / fp32"),
    torch_dtype=ignored("the legacy spelling of dtype"),
    id2label=ignored("classification heads' labels; a causal LM has none"),
    label2id=ignored("classification heads' labels; a causal LM has none"),
    problem_type=ignored("classification heads' loss; a causal LM has none"),
    output_hidden_states=ignored("what HF's forward returns, not what it computes"),
    output_attentions=ignored("what HF's forward returns, not what it computes"),
    return_dict=ignored("what HF's forward returns, not what it computes"),
    chunk_size_feed_forward=ignored("HF's memory-saving chunking of the MLP: the same result"),
    is_encoder_decoder=checked("a decoder-only model", must_be(False, "an encoder-decoder model"), True),
    transformers_version=ignored("the version that wrote the file"),
    use_cache=ignored("the KV cache of generation: the engines' concern, not the maths"),
    bos_token_id=ignored("a token id: the tokenizer's and the rollout's concern"),
    eos_token_id=ignored("a token id: the tokenizer's and the rollout's concern"),
    pad_token_id=ignored("a token id: the tokenizer's and the rollout's concern"),
    tokenizer_class=ignored("the tokenizer's concern"),
    auto_map=ignored("where remote code lives; the family's module is this project's"),
    initializer_range=built("init_method_std; every weight is then loaded from the checkpoint"),
    quantization_config=checked("unquantized weights", _no_quantization, {"quant_method": "fp8"}),
)
"""Fields of every transformers config object (PreTrainedConfig's own and the common token ids)."""

DECODER = table(
    vocab_size=built("the embedding and output rows (padded per --make-vocab-size-divisible-by x TP, masked)"),
    hidden_size=built("hidden_size"),
    intermediate_size=built("ffn_hidden_size of the dense MLPs"),
    num_hidden_layers=built("num_layers"),
    num_attention_heads=built("num_attention_heads"),
    num_key_value_heads=built("num_query_groups (grouped-query attention)"),
    head_dim=built("kv_channels (hidden_size // num_attention_heads when unset)"),
    hidden_act=checked("the SwiGLU MLP", must_be("silu", "the MLP is SwiGLU"), "gelu"),
    rms_norm_eps=built("layernorm_epsilon of every RMSNorm"),
    max_position_embeddings=built("max_sequence_length (--max-position-embeddings overrides it)"),
    tie_word_embeddings=built("share_embeddings_and_output_weights"),
    rope_parameters=built("RoPE: rope_type among the family's, rope_theta, partial_rotary_factor, llama3's factor "
                          "(its other factors checked against megatron's)"),
    rope_theta=built("rotary_base (transformers 4.x spelling, outside rope_parameters)"),
    rope_scaling=built("the RoPE scaling (transformers 4.x spelling of rope_parameters)"),
    partial_rotary_factor=built("rotary_percent (transformers 4.x spelling, outside rope_parameters)"),
    attention_dropout=ignored("dropout of HF's own training mode; --attention-dropout sets the trainer's"),
    pretraining_tp=ignored("transformers' own model does not read it (a matmul split of the original training)"),
    ignore_keys_at_rope_validation=ignored("which RoPE keys transformers' validation skips"),
)
"""The generic pre-norm decoder every family's builder starts from (slime/models/hf_arch.py)."""


def _no_bias(what: str) -> FieldRule:
    return checked(f"no bias on {what}", must_be(False, f"bias on {what}"), True)


ATTENTION_BIAS = table(attention_bias=_no_bias("the attention projections"))
MLP_BIAS = table(mlp_bias=_no_bias("the MLP projections"))

SLIDING_WINDOW = table(
    use_sliding_window=built("whether sliding_window applies (transformers sets sliding_window to none/0 without "
                             "it)"),
    sliding_window=built("the key window of each sliding layer (ContextParallelAttention's window)"),
    max_window_layers=built("which layers slide (transformers derives layer_types from it)"),
    layer_types=built("each layer's attention: full_attention or sliding_attention"),
)
"""Sliding-window attention as transformers' Qwen2 / Qwen3 configs spell it (hf_arch.sliding_windows)."""

ROUTER_TRAINING = table(
    output_router_logits=ignored("whether HF's forward returns router logits (its aux loss); megatron's aux loss "
                                 "is --moe-aux-loss-coeff"),
    router_aux_loss_coef=ignored("the load-balancing loss of HF's own training; --moe-aux-loss-coeff sets the "
                                 "trainer's"),
)
