"""The critic's role in the run's flags (--advantage-estimator ppo), read by the driver and the pre-Ray checks
without torch: its flags (`critic_args`), where it resumes from, at which iteration (the actor's: the run's one
tracker) and where it saves."""
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
    iteration = critic_resume_iteration(args)
    for path in (args.critic_load, os.path.join(args.load, CRITIC_ROLE) if args.load else None):
        if path and _holds_critic_checkpoint(path, iteration):
            return path
    return None


def _holds_critic_checkpoint(path: str, iteration: int | None) -> bool:
    """A tracker, or the iteration the actor resumes at (a run stopped before the critic's tracker moved)."""
    from slime.checkpoint.contents import iteration_dir, latest_iteration

    if latest_iteration(path) is not None:
        return True
    return iteration is not None and os.path.isdir(iteration_dir(path, iteration))


def critic_resume_iteration(args) -> int | None:
    """The iteration the critic resumes at: the one the actor resumes at (the tracker under --load, the run's),
    whatever the critic's own tracker says (it moves after the actor's: a run stopped in between has the critic's
    ahead). None when the actor does not resume."""
    from slime.checkpoint.contents import latest_iteration

    return latest_iteration(args.load) if args.load else None


def critic_checkpoint_mismatch(args) -> str | None:
    """What keeps the critic from resuming with the actor, said with what to do (None: nothing)."""
    from slime.checkpoint.contents import iteration_dir, latest_iteration

    critic = critic_resume_dir(args)
    if critic is None:
        return None
    own = latest_iteration(critic)
    actor = critic_resume_iteration(args)
    if actor is None:
        return (f"the critic's checkpoint {critic} is at iteration {own}, but the actor starts fresh (no checkpoint "
                "under --load): pass the --load that critic was saved with, or an HF --critic-load to start the critic "
                "anew")
    if not os.path.isdir(iteration_dir(critic, actor)):
        return (f"the actor resumes at iteration {actor} (--load {args.load}), but the critic's checkpoint {critic} "
                f"has no {os.path.basename(iteration_dir(critic, actor))} (its tracker names {own}): the two roles "
                "were not saved together; point --critic-load at the critic saved with that iteration, or write an "
                f"iteration both hold into {args.load}/latest_checkpointed_iteration.txt")
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
        "resume_iteration": critic_resume_iteration(args),
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
