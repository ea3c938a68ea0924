"""The critic's role in the run's flags (--advantage-estimator ppo), read by the driver and the pre-Ray checks
without torch: its flags (`critic_args`), where it resumes from and where it saves."""
from __future__ import annotations

import argparse
import os

from slime.config.layout import critic_world_size
from slime.config.run_config import build_run_config


CRITIC_ROLE = "critic"
VALUE_MODEL_PROVIDER = "slime.backends.megatron_utils.value_head.value_model_provider"
VALUE_HEAD_PARAM = r"^output_layer\.weight$"
"""The value head's megatron name (value_head.attach_value_head puts it in the vocabulary head's place), as a
--only-train-params-name-list pattern."""


def critic_resume_dir(args) -> str | None:
    """The critic's megatron checkpoint to resume from: --critic-load when it holds one, else <--load>/critic."""
    from slime.checkpoint.contents import latest_iteration

    if args.critic_load and latest_iteration(args.critic_load) is not None:
        return args.critic_load
    if args.load and latest_iteration(os.path.join(args.load, CRITIC_ROLE)) is not None:
        return os.path.join(args.load, CRITIC_ROLE)
    return None


def critic_save_dir(args) -> str | None:
    return args.critic_save or (os.path.join(args.save, CRITIC_ROLE) if args.save else None)


def critic_args(args) -> argparse.Namespace:
    """The critic's view of the run's flags: its learning rate, checkpoints and model, and its own layout,
    optimizer and batching from --megatron-config-path (checked by slime/config/checks/roles.py); no reference,
    teacher, KL term or HF export (those are the actor's)."""
    role = {**vars(args), **args.critic_overrides}
    critic = argparse.Namespace(**{
        **role,
        "role": CRITIC_ROLE,
        "only_train_params_name_list": _value_head_trained(role),
        "lr": args.critic_lr if args.critic_lr is not None else args.lr,
        "lr_warmup_iters": (args.critic_lr_warmup_iters if args.critic_lr_warmup_iters is not None
                            else args.lr_warmup_iters),
        "custom_model_provider_path": VALUE_MODEL_PROVIDER,
        "load": critic_resume_dir(args),
        "save": critic_save_dir(args),
        "save_hf": None,
        "use_kl_loss": False, "kl_coef": 0.0, "use_opd": False, "ref_update_interval": None,
        "custom_megatron_before_log_prob_hook_path": None, "custom_megatron_before_train_step_hook_path": None,
        "rollout_data_postprocess_path": None, "custom_advantage_function_path": None,
        "save_debug_train_data": None,
    })
    critic.run_config = build_run_config(critic, world_size=critic_world_size(args))  # its own layout and world
    return critic


def _value_head_trained(role: dict) -> list[str] | None:
    """The critic's --only-train-params-name-list: its value head always trains, beside LoRA's adapters (the base
    frozen) or beside what the run's list names; None (everything trains) when neither freezes anything."""
    names = role.get("only_train_params_name_list")
    if not names and not role.get("enable_lora"):
        return names
    return [*(names or ()), VALUE_HEAD_PARAM]
