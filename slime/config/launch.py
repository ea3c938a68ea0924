"""What a launch needs beyond parsing, checked before Ray starts: the launch-only flags and the HF
checkpoint (config.json against the model builder and the architecture flags, a tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

from slime.config.checks.linear_attention import check_linear_attention
from slime.config.checks.lora import check_lora_against_config
from slime.config.checks.model import check_pipeline_layers, check_rope_scaling
from slime.config.constants import DEFAULT_DATA_SOURCE_PATH, DEFAULT_ROLLOUT_FUNCTION_PATH
from slime.config.critic_role import critic_resume_dir
from slime.config.errors import fail, flag_name, require_path
from slime.models import family as model_family
from slime.models import supported_model_types
from slime.models.mtp import check_mtp_layers


# What an HF checkpoint directory must hold for the trainer (config) and the engines and data (tokenizer).
HF_CONFIG_FILE = "config.json"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def launch_missing_flags(args: argparse.Namespace) -> list[str]:
    """Flags a launch cannot do without, each as 'FLAG is required: why', for those not given."""
    missing = []
    if not args.hf_checkpoint:
        missing.append("--hf-checkpoint DIR is required: the Hugging Face checkpoint (config.json and tokenizer) "
                       "the trainer builds its model from and the engines serve")
    reads_prompts = (args.data_source_path == DEFAULT_DATA_SOURCE_PATH
                     and args.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION_PATH and not args.debug_train_only)
    if reads_prompts and not args.prompt_data:
        missing.append("--prompt-data FILE is required: the prompts (JSONL or parquet) the default rollout "
                       "generates from")
    return missing


def check_launch_inputs(args: argparse.Namespace) -> None:
    """What a launch needs before Ray starts, beyond what parse_args checks: the flags only a launch needs
    (all of them named at once) and the HF checkpoint."""
    missing = launch_missing_flags(args)
    if missing:
        fail("; ".join(missing))
    path = args.hf_checkpoint
    require_path("--hf-checkpoint", path, "directory")
    if not os.path.isfile(os.path.join(path, HF_CONFIG_FILE)):
        fail(f"--hf-checkpoint {path}: no {HF_CONFIG_FILE} (is it a Hugging Face checkpoint directory?)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in HF_TOKENIZER_FILES):
        fail(f"--hf-checkpoint {path}: no tokenizer (none of {', '.join(HF_TOKENIZER_FILES)})")
    _check_moe_tensor_parallel(args, os.path.join(path, HF_CONFIG_FILE))
    if args.advantage_estimator == "ppo" and not args.debug_rollout_only:
        check_critic_checkpoint(args)


MOE_CONFIG_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


# HF model_type values the model builder has a family for (slime/models registers them). Any other checkpoint would
# be built as a dense Qwen3/Llama and fail later, on the ranks, when its weights do not fit.
SUPPORTED_MODEL_TYPES = supported_model_types()


# Megatron flag dest -> the HF config key that gives the same number (the model is built from the config).
CONFIG_ARCH_KEYS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
                    "num_attention_heads": "num_attention_heads", "ffn_hidden_size": "intermediate_size",
                    "num_query_groups": "num_key_value_heads"}


# HF config keys where the critic's checkpoint must match the actor's: the value model is the actor's
# architecture (the same model builder, parallel layout and packed batches) with a scalar head.
CRITIC_ARCH_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "vocab_size", "model_type")


def check_critic_checkpoint(args: argparse.Namespace) -> None:
    """--advantage-estimator ppo: the critic has weights to start from (--critic-load, or its checkpoint under
    --load), and an HF --critic-load has the actor's architecture."""
    if critic_resume_dir(args) is not None:
        return  # a critic checkpoint saved by a ppo run of this architecture
    if args.critic_load is None:
        fail(f"--advantage-estimator ppo: --load {args.load} holds no critic checkpoint (critic/); pass --critic-load "
             "DIR (an HF checkpoint of the actor's architecture, e.g. the --hf-checkpoint itself)")
    require_path("--critic-load", args.critic_load, "directory")
    config_path = os.path.join(args.critic_load, HF_CONFIG_FILE)
    if not os.path.isfile(config_path):
        fail(f"--critic-load {args.critic_load}: neither a critic checkpoint (no tracker file) nor an HF checkpoint "
             f"(no {HF_CONFIG_FILE})")
    critic = built_part(_read_hf_config(config_path))
    actor = built_part(_read_hf_config(os.path.join(args.hf_checkpoint, HF_CONFIG_FILE)))
    differ = [f"{key} {critic.get(key)} (actor {actor.get(key)})" for key in CRITIC_ARCH_KEYS
              if critic.get(key) != actor.get(key)]
    if differ:
        fail(f"--critic-load {args.critic_load}: the critic is the actor's architecture with a value head, but its "
             f"config differs from --hf-checkpoint's: {', '.join(differ)}; pass a critic checkpoint of the actor's "
             "shape (the --hf-checkpoint itself starts one with a zero head)")


def _read_hf_config(config_path: str) -> dict:
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        fail(f"--hf-checkpoint: {config_path} is not readable JSON ({exc})")
    if not isinstance(config, dict):
        fail(f"--hf-checkpoint: {config_path} holds a JSON {type(config).__name__}, not an object")
    return config


def built_part(config: dict) -> dict:
    """The config of the model the trainer builds: a composite (vision + text) checkpoint's text_config, trained
    text-only; any other checkpoint's whole config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def check_hf_config(args: argparse.Namespace, config_path: str) -> None:
    """The checkpoint's config.json against the model builder and the architecture flags, before Ray starts."""
    if args.debug_rollout_only:
        return  # no trainer model is built
    whole = _read_hf_config(config_path)
    model_type, config = whole.get("model_type"), built_part(whole)
    custom_builder = args.spec or args.custom_model_provider_path
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES and not custom_builder:
        fail(f"--hf-checkpoint: {config_path} has model_type {model_type!r}, which no model family here builds "
             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}; docs/model-families.md); a --spec or "
             "--custom-model-provider-path plug-in may build others")
    if model_type in SUPPORTED_MODEL_TYPES:
        _check_layer_kinds(config, config_path)
        _check_family_layout(args, config, config_path)
        family = model_family(config.get("model_type", model_type))
        _check_family_flags(args, family, config_path)
        try:
            check_mtp_layers(args.mtp_num_layers, config, family.name, family.mtp_names is not None,
                             args.pipeline_model_parallel_size)
        except ValueError as exc:
            fail(f"--hf-checkpoint {config_path}: {exc}")
    heads = config.get("num_attention_heads")
    mla = (model_type in ("deepseek_v3", "deepseek_v2", "kimi_k2", "glm4_moe_lite", "glm_moe_dsa")
           and config.get("kv_lora_rank") is not None)
    arch = {dest: config.get(key) for dest, key in CONFIG_ARCH_KEYS.items()}
    arch["num_query_groups"] = heads if mla else (config.get("num_key_value_heads") or heads)
    for dest, value in arch.items():
        given = getattr(args, dest)
        if given is not None and value is not None and given != value:
            fail(f"{flag_name(dest)} {given} contradicts {config_path} ({CONFIG_ARCH_KEYS[dest]} = {value}); the model "
                 f"is built from the config: drop the flag or pass {flag_name(dest)} {value}")
    tp = args.tensor_model_parallel_size
    if isinstance(heads, int) and heads % tp:
        fail(f"--tensor-model-parallel-size {tp} does not divide the model's {heads} attention heads "
             f"(num_attention_heads in {config_path}); pick a TP size that divides {heads}")
    groups = arch["num_query_groups"]
    if isinstance(groups, int) and groups % tp:
        fail(f"--tensor-model-parallel-size {tp} does not divide the model's {groups} key/value heads "
             f"(num_key_value_heads in {config_path}; megatron-core splits them over TP without replicating); "
             f"pick a TP size that divides {groups}")
    _check_expert_split(args, config, config_path)
    check_lora_against_config(args, config, config_path)
    check_linear_attention(args, config, config_path)
    check_rope_scaling(args, config, config_path)
    layers, pp = config.get("num_hidden_layers"), args.pipeline_model_parallel_size
    if args.num_layers is None and isinstance(layers, int) and pp > 1:
        args.num_layers = layers
        try:
            check_pipeline_layers(args)
        finally:
            args.num_layers = None


def _check_layer_kinds(config: dict, config_path: str) -> None:
    """A hybrid stack (layer_types): one kind per layer, every one a kind the family builds; a sparse-attention
    indexer (GLM-5) that the family builds."""
    family = model_family(config.get("model_type"))
    if family.check_config is not None:
        try:
            family.check_config(SimpleNamespace(**config))
        except ValueError as exc:
            fail(f"--hf-checkpoint: {config_path}: {exc}")
    if family.layer_kinds is None:
        return
    try:
        family.layer_kinds(SimpleNamespace(**config))
    except ValueError as exc:
        fail(f"--hf-checkpoint: {config_path}: {exc}")


def _check_family_layout(args: argparse.Namespace, config: dict, config_path: str) -> None:
    """The pipeline split and recompute grouping against what the family's layers need (ModelFamily.check_layout)."""
    family = model_family(config.get("model_type"))
    if family.check_layout is None:
        return
    try:
        family.check_layout(SimpleNamespace(**config), args)
    except ValueError as exc:
        fail(f"--hf-checkpoint: {config_path}: {exc}")


# store_true flag dest -> the ModelFamily field that says whether the family's layers have it
FAMILY_FLAGS = {"attention_output_gate": "attention_output_gate", "apply_layernorm_1p": "zero_centered_norms"}


def _check_family_flags(args: argparse.Namespace, family, config_path: str) -> None:
    """A layer-kind flag the checkpoint's family does not have (a gated attention output, zero-centred norms)."""
    for dest, field in FAMILY_FLAGS.items():
        if getattr(args, dest) and not getattr(family, field):
            fail(f"{flag_name(dest)} contradicts {config_path}: {family.name} layers have no such thing; the model is "
                 "built from the config: drop the flag")


def _check_expert_split(args: argparse.Namespace, config: dict, config_path: str) -> None:
    """The routed experts must split over EP, and into the config's expert groups (n_group / topk_group)."""
    key = next((k for k in MOE_CONFIG_KEYS if isinstance(config.get(k), int) and config[k] > 0), None)
    if key is None:
        return
    experts, ep = config[key], args.expert_model_parallel_size or 1
    if experts % ep:
        fail(f"--expert-model-parallel-size {ep} does not divide the model's {experts} experts ({key} in "
             f"{config_path}); pick an EP size that divides {experts}")
    n_group, topk_group = config.get("n_group") or 1, config.get("topk_group") or 1
    if not isinstance(n_group, int) or not isinstance(topk_group, int):
        return
    if experts % n_group or topk_group > n_group:
        fail(f"{config_path}: n_group={n_group}, topk_group={topk_group} with {key}={experts}: the experts must split "
             f"into n_group equal groups and topk_group <= n_group; set n_group to a divisor of {experts} and "
             "topk_group to at most n_group")


def _check_moe_tensor_parallel(args: argparse.Namespace, config_path: str) -> None:
    """megatron-core trains an MoE layer at TP > 1 only with sequence parallelism; say so before Ray starts
    rather than at the first training forward."""
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        fail(f"--hf-checkpoint: {config_path} is not readable JSON ({exc})")
    config = built_part(config)
    moe = any(int(config.get(key) or 0) > 0 for key in MOE_CONFIG_KEYS) or int(args.num_experts or 0) > 0
    if moe and args.tensor_model_parallel_size > 1 and not args.sequence_parallel and not args.debug_rollout_only:
        fail(f"the checkpoint is an MoE model and --tensor-model-parallel-size is "
             f"{args.tensor_model_parallel_size}: megatron-core trains MoE layers at TP > 1 only with "
             "--sequence-parallel; add it (or use --expert-model-parallel-size instead of TP)")
    etp = args.expert_tensor_parallel_size
    if moe and args.tensor_model_parallel_size > 1 and args.expert_model_parallel_size == 1 and etp == 1:
        # megatron then treats the experts as data-parallel weights: no reduction sums their gradients over the
        # TP ranks, which saw different tokens, so the copies drift apart
        fail(f"--expert-tensor-parallel-size 1 with --tensor-model-parallel-size {args.tensor_model_parallel_size} "
             "and --expert-model-parallel-size 1 is not supported: the experts' gradients would not be summed over "
             "the TP ranks; drop --expert-tensor-parallel-size (it defaults to TP) or set "
             "--expert-model-parallel-size above 1")
