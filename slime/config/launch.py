"""What a launch needs beyond parsing, checked before Ray starts: the launch-only flags and the HF
checkpoint (config.json against the model builder and the architecture flags, a tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from types import SimpleNamespace
from typing import Any

from slime.algorithms import estimator
from slime.config.checks.linear_attention import check_linear_attention
from slime.config.checks.lora import check_lora_against_config
from slime.config.checks.model import check_pipeline_layers
from slime.config.constants import DEFAULT_DATA_SOURCE_PATH, DEFAULT_ROLLOUT_FUNCTION_PATH
from slime.checkpoint.layout import check_resume_layout
from slime.config.critic_role import critic_checkpoint_mismatch, critic_resume_dir
from slime.config.errors import fail, require_path
from slime.models import family as model_family
from slime.models import supported_model_types
from slime.models.registry import language_model_config, routed_experts
from slime.models.hf_arch import HFArch, arch_contradictions, hf_arch, hf_config_from_dict, undeclared_fields
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
    if estimator(args.advantage_estimator).needs_critic and not args.debug_rollout_only:
        check_critic_checkpoint(args)
    check_resume_layout(args)  # --load saved at another layout: what cannot be restored (slime/checkpoint/layout.py)


# HF model_type values the model builder has a family for (slime/models registers them). Any other checkpoint would
# be built as a dense Qwen3/Llama and fail later, on the ranks, when its weights do not fit.
SUPPORTED_MODEL_TYPES = supported_model_types()


# HF config keys where the critic's checkpoint must match the actor's: the value model is the actor's
# architecture (the same model builder, parallel layout and packed batches) with a scalar head.
CRITIC_ARCH_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "vocab_size", "model_type")


def check_critic_checkpoint(args: argparse.Namespace) -> None:
    """--advantage-estimator ppo: the critic has weights to start from (--critic-load, or its checkpoint under
    --load), and an HF --critic-load has the actor's architecture."""
    if critic_resume_dir(args) is not None:  # a critic checkpoint saved by a ppo run of this architecture
        problem = critic_checkpoint_mismatch(args)
        if problem:
            fail(f"--advantage-estimator ppo: {problem}")
        return
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
    """The config of the text model the trainer builds: a composite (vision + text) checkpoint's text_config (its
    vision tower: checks/multimodal.py); any other checkpoint's whole config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def checkpoint_arch(whole: dict, config_path: str) -> tuple[Any, HFArch] | None:
    """(transformers' config object, the builder's record) of a registered family's config.json, as the ranks
    read it; None for a model_type no family builds (a --spec / --custom-model-provider-path plug-in's)."""
    if whole.get("model_type") not in SUPPORTED_MODEL_TYPES:
        return None
    try:
        whole_config = hf_config_from_dict(whole)
    except (ValueError, TypeError, KeyError) as exc:  # transformers' own validation of the config class
        fail(f"--hf-checkpoint: {config_path}: transformers' config class refuses it: {exc}")
    try:
        hf_config = language_model_config(whole_config)
        return hf_config, hf_arch(hf_config)
    except ValueError as exc:
        fail(f"--hf-checkpoint: {config_path}: {exc}")


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
        try:
            check_mtp_layers(args.mtp_num_layers, config, family.name, family.mtp_names is not None,
                             args.pipeline_model_parallel_size)
        except ValueError as exc:
            fail(f"--hf-checkpoint {config_path}: {exc}")
        hf_config, arch = checkpoint_arch(whole, config_path)
        contradictions = arch_contradictions(arch, args, family)
        if contradictions:
            fail(contradictions[0].before_ray(config_path))
        _check_split(args, arch, hf_config, config_path)
        _warn_unread_fields(hf_config, whole, family, config_path)
        _warn_windows(arch, config_path)
    check_lora_against_config(args, config, config_path)
    check_linear_attention(args, config, config_path)
    layers, pp = config.get("num_hidden_layers"), args.pipeline_model_parallel_size
    if args.num_layers is None and isinstance(layers, int) and pp > 1:
        args.num_layers = layers
        try:
            check_pipeline_layers(args)
        finally:
            args.num_layers = None


def _check_split(args: argparse.Namespace, arch: HFArch, hf_config: Any, config_path: str) -> None:
    """The heads over TP, the experts over EP and into the config's expert groups, the router."""
    tp = args.tensor_model_parallel_size
    if arch.num_attention_heads % tp:
        fail(f"--tensor-model-parallel-size {tp} does not divide the model's {arch.num_attention_heads} attention "
             f"heads (num_attention_heads in {config_path}); pick a TP size that divides {arch.num_attention_heads}")
    groups = arch.num_query_groups
    if groups % tp:
        fail(f"--tensor-model-parallel-size {tp} does not divide the model's {groups} key/value heads "
             f"(num_key_value_heads in {config_path}; megatron-core splits them over TP without replicating); "
             f"pick a TP size that divides {groups}")
    _check_expert_split(args, arch, hf_config, config_path)


def _warn_unread_fields(hf_config: Any, whole: dict, family: Any, config_path: str) -> None:
    """config.json keys in no field table of the family (slime/models/hf_fields.py): nothing here reads them."""
    unread = undeclared_fields(hf_config, family.hf_fields)
    if isinstance(whole.get("text_config"), dict):
        unread += [f"(outer) {name}" for name in sorted(set(whole) - set(family.composite_fields))]
    if unread:
        warnings.warn(f"--hf-checkpoint {config_path}: config.json has fields the {family.name} builder does not "
                      f"know: {', '.join(unread)}; nothing here reads them (nor does transformers' own class): if one "
                      "changes the model, the trained model is not the checkpoint's", stacklevel=2)


def _warn_windows(arch: HFArch, config_path: str) -> None:
    if arch.attention_windows is None or model_family(arch.model_type).sglang_serves_windows:
        return
    sliding = [w for w in arch.attention_windows if w is not None]
    warnings.warn(f"--hf-checkpoint {config_path}: {len(sliding)} of {arch.num_layers} layers attend to a sliding "
                  f"window of {max(sliding)} keys, built as transformers' {arch.family} class builds them; SGLang "
                  "0.5's qwen2 / qwen3 models serve every layer with full attention, so with SGLang engines a sequence "
                  "longer than the window gets other log-probs on the engines than in the trainer (the embedded "
                  "engine runs transformers' class and agrees)", stacklevel=2)


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


def _check_expert_split(args: argparse.Namespace, arch: HFArch, hf_config: Any, config_path: str) -> None:
    """The routed experts must split over EP, and into the config's expert groups (n_group / topk_group); the
    family's router mapping refuses what megatron-core cannot match."""
    if not arch.num_experts:
        return
    key, experts, ep = arch.experts_key, arch.num_experts, args.expert_model_parallel_size or 1
    if experts % ep:
        fail(f"--expert-model-parallel-size {ep} does not divide the model's {experts} experts ({key} in "
             f"{config_path}); pick an EP size that divides {experts}")
    n_group, topk_group = arch.expert_groups
    if isinstance(n_group, int) and isinstance(topk_group, int) and (experts % n_group or topk_group > n_group):
        fail(f"{config_path}: n_group={n_group}, topk_group={topk_group} with {key}={experts}: the experts must split "
             f"into n_group equal groups and topk_group <= n_group; set n_group to a divisor of {experts} and "
             "topk_group to at most n_group")
    try:
        model_family(arch.model_type).moe(hf_config)
    except ValueError as exc:
        fail(f"--hf-checkpoint: {config_path}: {exc}")


def _check_moe_tensor_parallel(args: argparse.Namespace, config_path: str) -> None:
    """megatron-core trains an MoE layer at TP > 1 only with sequence parallelism; say so before Ray starts
    rather than at the first training forward."""
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        fail(f"--hf-checkpoint: {config_path} is not readable JSON ({exc})")
    if args.debug_rollout_only:
        return  # no trainer model is built
    checkpoint = checkpoint_arch(config, config_path)
    experts = checkpoint[1].num_experts if checkpoint is not None else routed_experts(built_part(config))
    moe = experts > 0 or int(args.num_experts or 0) > 0
    if moe and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
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
