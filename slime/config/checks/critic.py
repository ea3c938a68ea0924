"""The critic's flags (--advantage-estimator ppo), checked before Ray starts: what the critic needs, and what
its ranks cannot run. Its own layout (--megatron-config-path, --critic-num-*) is checked by checks/roles.py."""
from __future__ import annotations

import argparse

from slime.algorithms import estimator
from slime.checkpoint.contents import latest_iteration
from slime.config.critic_role import critic_resume_dir
from slime.config.errors import derive, fail

CRITIC_ONLY_FLAGS = ("critic_load", "critic_save", "critic_lr", "critic_lr_warmup_iters", "critic_num_nodes",
                     "critic_num_gpus_per_node")


def check_critic(args: argparse.Namespace) -> None:
    if not estimator(args.advantage_estimator).needs_critic:
        used = [f"--{name.replace('_', '-')}" for name in CRITIC_ONLY_FLAGS if getattr(args, name) is not None]
        if args.num_critic_only_steps:
            used.append("--num-critic-only-steps")
        if used:
            fail(f"{', '.join(used)} configure the critic, which only --advantage-estimator ppo trains; drop them "
                 "or pass --advantage-estimator ppo")
        return
    resolve_critic_start(args)
    for flag, count in (("--critic-num-nodes", args.critic_num_nodes),
                        ("--critic-num-gpus-per-node", args.critic_num_gpus_per_node)):
        if count is not None and count <= 0:
            fail(f"{flag} {count} must be positive (or left out: the critic then shares the actor's bundles)")
    if args.enable_mtp_training:
        fail("--enable-mtp-training with --advantage-estimator ppo is not implemented: the critic's value model has "
             "no MTP loss; drop --enable-mtp-training (--mtp-num-layers alone carries the layers, untrained)")
    if args.kl_coef:
        fail("--kl-coef (a KL reward term) with --advantage-estimator ppo is not implemented: the critic's returns "
             "are computed without the actor's reference log-probs; use --use-kl-loss --kl-loss-coef instead")
    if args.num_critic_only_steps < 0:
        fail(f"--num-critic-only-steps {args.num_critic_only_steps} must be >= 0")
    if args.num_critic_only_steps and args.save_interval and args.save_interval <= args.num_critic_only_steps:
        fail(f"--save-interval {args.save_interval} saves during the first --num-critic-only-steps "
             f"{args.num_critic_only_steps} rollouts, which do not train (nor wake) the actor; set --save-interval "
             "above --num-critic-only-steps")
    if args.num_rollout is not None and args.num_critic_only_steps >= args.num_rollout:
        fail(f"--num-critic-only-steps {args.num_critic_only_steps} leaves no rollout of --num-rollout "
             f"{args.num_rollout} to train the actor")


def resolve_critic_start(args: argparse.Namespace) -> None:
    """Where the critic's weights come from when no critic flag says: as upstream's critic, which inherits the run's
    checkpoint flags, it starts from the shared checkpoint, --hf-checkpoint (with a zero value head). A critic
    checkpoint under --load (or --critic-load) is resumed instead (critic_role.critic_resume_dir)."""
    if args.critic_load is not None or critic_resume_dir(args) is not None:
        return
    if args.load is not None and latest_iteration(args.load) is not None:
        fail(f"--advantage-estimator ppo: --load {args.load} holds the actor's checkpoint but no critic checkpoint "
             "(critic/); upstream's critic would start from those actor weights, which this project does not load "
             "into a value model: pass --critic-load DIR (an HF checkpoint of the actor's architecture, e.g. the "
             "--hf-checkpoint itself)")
    if args.hf_checkpoint is not None:
        derive(args, "critic_load", args.hf_checkpoint,
               "--hf-checkpoint: the critic starts from the run's checkpoint, as upstream's critic inherits it")
