"""`--multimodal-keys` before Ray starts: the mapping, the checkpoint's image processing, every prompt row's images
(decoded, one `<image>` placeholder each), then whether the trainer builds the checkpoint's vision tower with the
run's other flags."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from slime.config.constants import DEFAULT_DATA_SOURCE_PATH, DEFAULT_ROLLOUT_FUNCTION_PATH
from slime.config.errors import fail


def check_multimodal(args: argparse.Namespace) -> None:
    from slime.rollout.prompt_media import parse_media_keys

    per_dataset = [spec for spec in args.eval_datasets if spec.multimodal_keys is not None]
    if args.multimodal_keys is None and not per_dataset:
        return
    try:
        keys = parse_media_keys(args.multimodal_keys)
        for spec in per_dataset:
            parse_media_keys(spec.multimodal_keys, f"--eval-config {spec.name}: multimodal_keys")
    except ValueError as exc:
        fail(str(exc))
    if not args.apply_chat_template:
        fail("--multimodal-keys needs --apply-chat-template: the chat template writes each image's placeholder "
             "tokens where the prompt text has <image>")
    _check_checkpoint(args)
    _check_rows(args, keys)
    if not args.debug_rollout_only:
        _check_trainer(args)


def _check_trainer(args: argparse.Namespace) -> None:
    """The trainer builds this checkpoint's vision tower, and the run's flags build beside it."""
    import json

    from slime.algorithms import estimator
    from slime.models.hf_arch import hf_config_from_dict
    from slime.models.registry import language_model_config

    path = os.path.join(args.hf_checkpoint or "", "config.json")
    if not os.path.isfile(path):
        return  # check_launch_inputs names it
    with open(path) as f:
        whole = json.load(f)
    try:
        language_model_config(hf_config_from_dict(whole), vision=True)
    except (KeyError, ValueError) as exc:
        fail(f"--multimodal-keys: --hf-checkpoint {args.hf_checkpoint}: {exc.args[0] if exc.args else exc}")
    if args.custom_model_provider_path:
        fail(f"--multimodal-keys with --custom-model-provider-path {args.custom_model_provider_path}: the vision tower is "
             "put in front of the text model by the project's builder, so a provider's model would not take the "
             "images; drop the provider (upstream's --spec slime_plugins.models.qwen3_5_vl names are accepted)")
    if estimator(args.advantage_estimator).needs_critic:
        fail(f"--multimodal-keys with --advantage-estimator {args.advantage_estimator}: the critic is not built with "
             "a vision tower here; use a critic-free estimator (grpo, gspo, reinforce_plus_plus, ...)")


def _check_checkpoint(args: argparse.Namespace) -> None:
    """A vision + text checkpoint whose image processor is one the rollout side runs; a checkpoint directory
    without config.json is check_launch_inputs' to name."""
    from slime.utils.vision_processor import PREPROCESSOR_FILE, has_vision, load_vision_processor

    path = args.hf_checkpoint
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return
    if not has_vision(path):
        fail(f"--multimodal-keys: --hf-checkpoint {path} is not a vision + text checkpoint (it needs a vision_config "
             f"in config.json and an image processor in {PREPROCESSOR_FILE})")
    try:
        load_vision_processor(path)
    except (ValueError, OSError) as exc:
        fail(f"--multimodal-keys: {exc}")


def _check_rows(args: argparse.Namespace, keys) -> None:
    from slime.rollout.prompt_media import check_media_rows, parse_media_keys
    from slime.rollout.prompt_rows import read_rows

    files = []
    if args.prompt_data is not None and not args.debug_train_only and keys is not None \
            and args.data_source_path == DEFAULT_DATA_SOURCE_PATH:
        files.append((args.prompt_data, "--prompt-data", args.input_key, keys))
    if args.eval_function_path == DEFAULT_ROLLOUT_FUNCTION_PATH:
        flag = "--eval-config" if args.eval_config else "--eval-prompt-data"
        for spec in args.eval_datasets:
            dataset_keys = parse_media_keys(spec.multimodal_keys) if spec.multimodal_keys is not None else keys
            if dataset_keys is not None:
                files.append((spec.path, f"{flag} {spec.name}",
                              spec.input_key or args.eval_input_key or args.input_key, dataset_keys))
    for path, flag, input_key, dataset_keys in files:
        if not Path(path).is_file():
            continue  # check_paths names it
        try:
            check_media_rows(read_rows(path, flag), dataset_keys, flag, path, input_key)
        except ValueError as exc:
            fail(str(exc))
