"""The critic's flags (--advantage-estimator ppo), checked before Ray starts: what the critic needs, and what
its ranks cannot run. Its own layout (--megatron-config-path, --critic-num-*) is checked by checks/roles.py."""
from __future__ import annotations

import argparse

from slime.config.errors import fail

CRITIC_ONLY_FLAGS = ("critic_load", "critic_save", "critic_lr", "critic_lr_warmup_iters", "critic_num_nodes",
                     "critic_num_gpus_per_node")


def check_critic(args: argparse.Namespace) -> None:
    if args.advantage_estimator != "ppo":
        used = [f"--{name.replace('_', '-')}" for name in CRITIC_ONLY_FLAGS if getattr(args, name) is not None]
        if args.num_critic_only_steps:
            used.append("--num-critic-only-steps")
        if used:
            fail(f"{', '.join(used)} configure the critic, which only --advantage-estimator ppo trains; drop them "
                 "or pass --advantage-estimator ppo")
        return
    if args.critic_load is None and args.load is None:
        fail("--advantage-estimator ppo trains a critic: pass --critic-load DIR (an HF checkpoint of the actor's "
             "architecture, e.g. the --hf-checkpoint itself, or a critic checkpoint saved by a ppo run)")
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
