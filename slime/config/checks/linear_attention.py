"""Pre-Ray checks of a hybrid (gated delta-net + full attention) checkpoint, Qwen3.5 / Qwen3-Next: the HF
config's layer pattern and delta-net heads against the builder, TP and CP, and megatron's linear-attention
flags (upstream's launchers pass them) against the config the model is built from.
"""

from __future__ import annotations

import argparse
import ast

from slime.config.errors import fail, flag_name

# HF layer_types entries -> megatron's pattern value (1: linear attention, 0: full attention).
LAYER_TYPE_PATTERN = {"linear_attention": 1, "full_attention": 0}

# megatron's DeltaNet size flags (checked against the config with the other architecture flags: slime.models.hf_arch).
LINEAR_SHAPE_KEYS = {"linear_conv_kernel_dim": "linear_conv_kernel_dim", "linear_key_head_dim": "linear_key_head_dim",
                     "linear_value_head_dim": "linear_value_head_dim", "linear_num_key_heads": "linear_num_key_heads",
                     "linear_num_value_heads": "linear_num_value_heads"}


def layer_pattern(config: dict) -> tuple[int, ...] | None:
    """The config's layer_types as megatron's pattern; None for a model without them or with a kind outside
    LAYER_TYPE_PATTERN (the family's own layer_kinds refuses such a stack by name, launch.py)."""
    layer_types = config.get("layer_types")
    if layer_types is None or any(kind not in LAYER_TYPE_PATTERN for kind in layer_types):
        return None
    return tuple(LAYER_TYPE_PATTERN[kind] for kind in layer_types)


def pattern_of_flag(value: str, num_layers: int) -> tuple[int, ...]:
    """--linear-attention-freq as megatron reads it: an int N puts full attention on every N-th layer, a python
    list gives the pattern (1 linear, 0 full) layer by layer."""
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        fail(f"--linear-attention-freq {value!r}: expected an int or a python list of 0/1 per layer")
    if isinstance(parsed, int) and parsed >= 1:
        return tuple(0 if (i + 1) % parsed == 0 else 1 for i in range(num_layers))
    if isinstance(parsed, list) and all(v in (0, 1) for v in parsed):
        return tuple(parsed)
    fail(f"--linear-attention-freq {value!r}: expected a positive int or a python list of 0/1 per layer")


def check_linear_attention(args: argparse.Namespace, config: dict, config_path: str) -> None:
    """A hybrid checkpoint against the flags, TP and CP; the linear-attention flags refused on any other."""
    check_frozen_indexer(args, config, config_path)
    pattern = layer_pattern(config)
    hybrid = pattern is not None and any(pattern)
    if not hybrid:
        dsa = args.experimental_attention_variant == "dsa"
        if dsa and not config.get("index_topk"):
            fail(f"--experimental-attention-variant dsa contradicts {config_path}: it has no DeepSeek sparse "
                 "attention indexer (index_topk); drop the flag")
        loss_flags = [flag_name(dest) for dest in ("dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss")
                      if getattr(args, dest)]
        if loss_flags and not config.get("index_topk"):
            fail(f"{', '.join(loss_flags)}: {config_path} has no DeepSeek sparse attention indexer (index_topk) to "
                 "train; drop the flag")
        if args.dsa_indexer_use_sparse_loss and not args.dsa_indexer_loss_coeff:
            fail("--dsa-indexer-use-sparse-loss without --dsa-indexer-loss-coeff: the indexer's loss is off; set the "
                 "coefficient or drop the flag")
        given = [flag_name(dest) for dest in ("experimental_attention_variant", "linear_attention_freq",
                                               *LINEAR_SHAPE_KEYS)
                 if getattr(args, dest) is not None and not (dsa and dest == "experimental_attention_variant")]
        if given:
            fail(f"{', '.join(given)} describe gated delta-net (linear attention) layers, but {config_path} has none; "
                 "drop them")
        return
    if args.experimental_attention_variant not in (None, "gated_delta_net"):
        fail(f"--experimental-attention-variant {args.experimental_attention_variant} contradicts {config_path} "
             "(gated delta-net layers); pass gated_delta_net or drop the flag")
    if args.linear_attention_freq is not None and pattern_of_flag(args.linear_attention_freq, len(pattern)) != pattern:
        fail(f"--linear-attention-freq {args.linear_attention_freq} contradicts the layer_types of {config_path} "
             f"({list(pattern)} as 1 linear / 0 full); drop the flag or pass that list")
    _check_linear_heads_split(args, config, config_path)


def check_frozen_indexer(args: argparse.Namespace, config: dict, config_path: str) -> None:
    """--freeze-indexer (upstream's): the indexer is frozen here unless its loss trains it, so the flag asks for
    what the builder does; it names an indexer the checkpoint must have and contradicts the loss that trains it."""
    if not args.freeze_indexer:
        return
    if not config.get("index_topk"):
        fail(f"--freeze-indexer: {config_path} has no DeepSeek sparse attention indexer (index_topk) to freeze; "
             "drop the flag")
    if args.dsa_indexer_loss_coeff:
        fail(f"--freeze-indexer contradicts --dsa-indexer-loss-coeff {args.dsa_indexer_loss_coeff} (the indexer's "
             "loss trains it); drop one of them")


def _check_linear_heads_split(args: argparse.Namespace, config: dict, config_path: str) -> None:
    tp = args.tensor_model_parallel_size
    for key in ("linear_num_key_heads", "linear_num_value_heads"):
        heads = config.get(key)
        if isinstance(heads, int) and heads % tp:
            fail(f"--tensor-model-parallel-size {tp} does not divide the model's {heads} linear-attention "
                 f"{key.removeprefix('linear_num_').replace('_', ' ')} ({key} in {config_path}); pick a TP size "
                 f"that divides {heads}")
