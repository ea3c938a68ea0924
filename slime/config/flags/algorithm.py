"""Flags of the RL objective: advantages, losses, KL, importance sampling, distillation and rewards."""

from __future__ import annotations

import argparse

from slime.config.constants import ADVANTAGE_ESTIMATORS, KL_LOSS_TYPES, LOSS_TYPES


def add_algorithm_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("algorithm", "RL objective")
    g.add_argument("--advantage-estimator", type=str, default="grpo", choices=ADVANTAGE_ESTIMATORS,
                   help="how rewards become advantages (gspo: GRPO advantages with a sequence-level ratio; cispo: GRPO "
                        "advantages, the clipped importance weight times the log-prob gradient)")
    g.add_argument("--pg-loss-type", type=str, default=None, choices=["ppo", "reinforce"],
                   help="policy-gradient objective (default: the PPO-clip objective)")
    g.add_argument("--use-score-centering", action="store_true", default=False,
                   help="REINFORCE score-centering objective")
    g.add_argument("--score-centering-top-k", type=int, default=128, help="sampler top-k kept for score centering")
    g.add_argument("--loss-type", type=str, default="policy_loss", choices=LOSS_TYPES,
                   help="policy_loss (PPO-clip), sft_loss (negative log-likelihood), or custom_loss "
                        "(--custom-loss-function-path)")
    g.add_argument("--custom-loss-function-path", type=str, default=None,
                   help="fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics), with --loss-type custom_loss")
    g.add_argument("--disable-compute-advantages-and-returns", action="store_false",
                   dest="compute_advantages_and_returns",
                   help="do not compute advantages/returns (SFT or a custom loss that needs none)")
    g.add_argument("--custom-advantage-function-path", type=str, default=None,
                   help="fn(args, rollout_data) filling rollout_data['advantages'] and ['returns'] in place")
    g.add_argument("--eps-clip", type=float, default=0.2, help="PPO ratio clip below 1 (1 - eps); CISPO's weight clip below 1")
    g.add_argument("--eps-clip-high", type=float, default=None, help="PPO ratio clip above 1 (default: --eps-clip); CISPO's weight clip above 1")
    g.add_argument("--eps-clip-c", type=float, default=None, help="dual-clip bound on negative-advantage losses (> 1)")
    g.add_argument("--value-clip", type=float, default=0.2, help="clip of the critic's value loss (ppo)")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-reference penalty folded into the rewards")
    g.add_argument("--use-kl-loss", action="store_true", default=False, help="add a KL-to-reference term to the loss")
    g.add_argument("--kl-loss-coef", type=float, default=0.0, help="weight of the KL loss term")
    g.add_argument("--kl-loss-type", type=str, default="k1", choices=KL_LOSS_TYPES,
                   help="KL estimator (k1: log-ratio, k2: squared, k3 / low_var_kl: Schulman's k3)")
    g.add_argument("--use-unbiased-kl", action="store_true", default=False,
                   help="importance-weight the KL estimate by the current/old ratio")
    g.add_argument("--ref-update-interval", type=int, default=None,
                   help="replace the reference model by the actor every N rollouts (default: never)")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="weight of the entropy bonus")
    g.add_argument("--gamma", type=float, default=1.0, help="discount of token rewards (REINFORCE++)")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda of the critic's advantages (ppo)")
    g.add_argument("--normalize-advantages", action="store_true", default=False,
                   help="whiten advantages over every loss token of the rollout")
    g.add_argument("--disable-grpo-std-normalization", action="store_false", dest="grpo_std_normalization",
                   help="GRPO: subtract the group mean only, do not divide by its std (Dr. GRPO)")
    g.add_argument("--disable-rewards-normalization", action="store_false", dest="rewards_normalization",
                   help="use raw rewards as GRPO scores (no group centring)")
    g.add_argument("--use-rollout-entropy", action="store_true", default=False,
                   help="compute entropy in the log-prob passes as well")
    g.add_argument("--use-tis", action="store_true", default=False,
                   help="truncated importance sampling against the engines' log-probs")
    g.add_argument("--tis-clip", type=float, default=2.0, help="upper clip of the TIS ratio")
    g.add_argument("--tis-clip-low", type=float, default=0.0, help="lower clip of the TIS ratio")
    g.add_argument("--use-rollout-logprobs", action="store_true", default=False,
                   help="the engines' log-probs are the old policy (the trainer skips its old-policy forward)")
    g.add_argument("--get-mismatch-metrics", action="store_true", default=False,
                   help="also log train/rollout mismatch metrics (tis, tis_abs, tis_clipfrac, ois); loss unchanged")
    g.add_argument("--custom-tis-function-path", type=str, default=None,
                   help="fn(args=, pg_loss=, train_log_probs=, rollout_log_probs=, loss_masks=, total_lengths=, "
                        "response_lengths=) -> (pg_loss, loss_masks, metrics) replacing TIS (with --use-tis or "
                        "--get-mismatch-metrics)")
    g.add_argument("--custom-pg-loss-reducer-function-path", type=str, default=None,
                   help="fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer of the "
                        "policy-gradient loss (e.g. Dr. GRPO's constant)")
    g.add_argument("--reset-optimizer-states", action="store_true", default=False,
                   help="clear the optimizer state after every rollout")
    g.add_argument("--use-stateless-adam", action="store_true", default=False, help="Adam without moment estimates")
    g.add_argument("--use-opsm", action="store_true", default=False, help="off-policy sequence masking")
    g.add_argument("--opsm-delta", type=float, default=1e-4, help="threshold of off-policy sequence masking")
    g.add_argument("--num-critic-only-steps", type=int, default=0, help="first rollouts that train the critic only")
    g.add_argument("--critic-load", type=str, default=None,
                   help="the critic's start (ppo): an HF checkpoint of the actor's architecture, or a saved critic")
    g.add_argument("--critic-save", type=str, default=None, help="where --save writes the critic (default: <save>/critic)")
    g.add_argument("--critic-lr", type=float, default=None, help="the critic's learning rate (default: --lr)")
    g.add_argument("--critic-lr-warmup-iters", type=int, default=None,
                   help="the critic's warm-up steps (default: --lr-warmup-iters)")
    g.add_argument("--critic-num-nodes", type=int, default=None,
                   help="the critic's nodes (default: the actor's; counts other than the actor's put the critic "
                        "on bundles of its own)")
    g.add_argument("--critic-num-gpus-per-node", type=int, default=None,
                   help="the critic's GPUs per node (default: the actor's, sharing the actor's bundles; other "
                        "counts put the critic on bundles of its own)")
    g.add_argument("--megatron-config-path", type=str, default=None,
                   help="upstream's YAML of per-role Megatron overrides, e.g. megatron: [{name: default, role: critic, "
                        "overrides: {lr: 1e-5, tensor_model_parallel_size: 2}}]: a role's layout, optimizer, batching "
                        "and checkpoints (slime/config/megatron_config.py)")
    g.add_argument("--calculate-per-token-loss", action="store_true", default=False,
                   help="normalise the loss by the step's loss-token total instead of per sample")


def add_opd_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("on-policy distillation",
                                  "a per-token reverse-KL penalty towards a teacher, added to the advantages")
    g.add_argument("--use-opd", action="store_true", default=False,
                   help="enable on-policy distillation (needs --opd-type)")
    g.add_argument("--opd-type", type=str, default=None, choices=["sglang", "megatron"],
                   help="sglang: a teacher engine scores each sample (slime.rollout.on_policy_distillation as "
                        "--custom-rm-path / --custom-reward-post-process-path, the engine at --rm-url); megatron: "
                        "the trainer loads the teacher from --opd-teacher-load")
    g.add_argument("--opd-kl-coef", type=float, default=1.0, help="weight of the reverse KL in the advantages")
    g.add_argument("--opd-teacher-load", type=str, default=None,
                   help="teacher checkpoint (megatron or HF directory, the model's architecture) with --opd-type megatron")
    g.add_argument("--opd-teacher-ckpt-step", type=int, default=None,
                   help="iteration of the --opd-teacher-load checkpoint (default: its latest)")


def add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("reward model", "rewards of generated samples")
    g.add_argument("--rm-type", type=str, default=None,
                   help="built-in reward: math, deepscaler, dapo, f1, gpqa, remote_rm, random (0 or 1 at random, a "
                        "baseline); boxed_<type>: the boxed answer only")
    g.add_argument("--rm-url", type=str, default=None, help="endpoint of --rm-type remote_rm")
    g.add_argument("--reward-key", type=str, default=None, help="key of the reward when the reward is a dict")
    g.add_argument("--eval-reward-key", type=str, default=None, help="--reward-key for eval (default: --reward-key)")
    g.add_argument("--group-rm", action="store_true", default=False, help="reward each group in one call")
    g.add_argument("--custom-rm-path", type=str, default=None,
                   help="async fn(args, sample) -> reward (with --group-rm: fn(args, samples) -> rewards)")
    g.add_argument("--custom-reward-post-process-path", type=str, default=None,
                   help="fn(args, samples) -> (raw rewards, rewards) replacing the GRPO group normalisation")
    g.add_argument("--custom-convert-samples-to-train-data-path", type=str, default=None,
                   help="fn(args, samples) -> dict of per-sample lists (tokens, response_lengths, rewards, raw_reward, "
                        "truncated, sample_indices, loss_masks) replacing the default conversion")
