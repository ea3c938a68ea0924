"""Multi-token prediction (MTP) layers: how many a checkpoint carries and how each family's checkpoint spells them.

megatron-core's MTP layer k (`mtp.layers.k.`) is enorm (the next token's embedding), hnorm (the previous depth's
hidden state), eh_proj (the two concatenated, 2h -> h), one transformer layer (`transformer_layer.`, named as a
decoder layer) and final_layernorm before the shared output layer. The checkpoints spell the same parts three ways:

- DeepSeek-V3, GLM-4.5 / 4.7: decoder layer `num_hidden_layers + k` (`model.layers.{N+k}.`) with enorm, hnorm,
  eh_proj, `shared_head.norm`, and copies of the embedding (`embed_tokens`) and output layer (`shared_head.head`);
- Qwen3-Next: `mtp.layers.k.` with `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc`, `mtp.norm`;
- MiMo: `model.mtp_layers.k.` with token_layernorm, hidden_layernorm, input_proj, final_layernorm; its input_proj
  takes [hidden; embedding], megatron's eh_proj [embedding; hidden] (the two column halves swap).

A family names its spelling with `ModelFamily.mtp_names`; hf_weights.py maps the transformer layer with the family's
decoder-layer table under the prefix given here. Importable without torch (argument checking counts the layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# config.json keys holding the MTP layer count (DeepSeek-V3, GLM, MiMo; Qwen3-Next)
_COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")

# megatron's own MTP parameters of one layer, besides its transformer layer
OWN_PARTS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight")


def checkpoint_mtp_layers(hf_config: Any) -> int:
    """How many MTP layers the HF config says its checkpoint carries (0: none). Reads a dict or a config object."""
    for key in _COUNT_KEYS:
        value = hf_config.get(key) if isinstance(hf_config, dict) else getattr(hf_config, key, None)
        if value:
            return int(value)
    return 0


@dataclass(frozen=True)
class MTPLayerNames:
    """The HF names of one MTP layer."""

    layer_prefix: str
    """Prefix of its transformer layer's tensors, spelt as a decoder layer's ('model.layers.61.')."""
    parts: dict[str, str]
    """{megatron part (OWN_PARTS): HF name}."""
    hidden_first: bool = False
    """The HF projection takes [hidden; embedding] (MiMo), megatron's eh_proj [embedding; hidden]."""
    embedding_copy: str | None = None
    """HF name of the layer's own copy of the embedding (DeepSeek-V3), written from the shared one."""
    output_copy: str | None = None
    """HF name of the layer's own copy of the output layer (DeepSeek-V3's shared_head.head)."""


def after_decoder_names(hf_config: Any, layer: int) -> MTPLayerNames:
    """DeepSeek-V3 / GLM-4.5 / GLM-4.7: MTP layer k is decoder layer num_hidden_layers + k."""
    prefix = f"model.layers.{hf_config.num_hidden_layers + layer}."
    parts = dict(zip(OWN_PARTS, ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")))
    return MTPLayerNames(prefix, {k: prefix + v for k, v in parts.items()},
                         embedding_copy=prefix + "embed_tokens.weight", output_copy=prefix + "shared_head.head.weight")


def qwen3_next_names(hf_config: Any, layer: int) -> MTPLayerNames:
    """Qwen3-Next: one projection and norms under `mtp.`, its layers under `mtp.layers.`."""
    if checkpoint_mtp_layers(hf_config) > 1:
        raise ValueError(f"Qwen3-Next: mtp_num_hidden_layers={checkpoint_mtp_layers(hf_config)}; its checkpoint "
                         "stacks those layers behind one projection, megatron builds one projection per layer: only "
                         "1 is mapped")
    parts = dict(zip(OWN_PARTS, ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "fc.weight",
                                 "norm.weight")))
    return MTPLayerNames(f"mtp.layers.{layer}.", {k: "mtp." + v for k, v in parts.items()})


def mimo_names(hf_config: Any, layer: int) -> MTPLayerNames:
    """MiMo (XiaomiMiMo/MiMo-7B, modeling_mimo.py): `model.mtp_layers.k.`."""
    prefix = f"model.mtp_layers.{layer}."
    parts = dict(zip(OWN_PARTS, ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
                                 "final_layernorm.weight")))
    return MTPLayerNames(prefix, {k: prefix + v for k, v in parts.items()}, hidden_first=True)


def check_mtp_layers(requested: int | None, hf_config: Any, family_name: str, has_names: bool,
                     pipeline: int = 1) -> None:
    """--mtp-num-layers against the checkpoint (and `pipeline`, the PP size): ValueError naming the fix when they
    disagree."""
    if not requested:
        return
    tied = hf_config.get("tie_word_embeddings") if isinstance(hf_config, dict) else \
        getattr(hf_config, "tie_word_embeddings", False)
    if pipeline > 1 and tied:  # the last stage would hold a tied output layer and the MTP embedding copy of one tensor
        raise ValueError(f"--mtp-num-layers {requested} with --pipeline-model-parallel-size {pipeline} and a "
                         "checkpoint that ties lm_head to embed_tokens (tie_word_embeddings=True) is not supported "
                         "here: train it at --pipeline-model-parallel-size 1")
    found = checkpoint_mtp_layers(hf_config)
    if not has_names:
        raise ValueError(f"--mtp-num-layers {requested}: {family_name} checkpoints carry no multi-token-prediction "
                         "layers this builder maps (DeepSeek-V3, GLM-4.5 / 4.7, MiMo and Qwen3-Next do); drop "
                         "--mtp-num-layers and --enable-mtp-training")
    if found == 0:
        raise ValueError(f"--mtp-num-layers {requested}: the checkpoint's config.json has no MTP layers "
                         f"(num_nextn_predict_layers / mtp_num_hidden_layers); drop --mtp-num-layers and "
                         "--enable-mtp-training, or use a checkpoint that carries MTP layers")
    if found != requested:
        raise ValueError(f"--mtp-num-layers {requested} contradicts the checkpoint, which carries {found} MTP "
                         f"layer(s); pass --mtp-num-layers {found}")
