"""Flags of experiment tracking (wandb, TensorBoard) and train-phase debugging."""

from __future__ import annotations

import argparse


def add_tracking_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("wandb/tensorboard", "experiment tracking")
    g.add_argument("--use-wandb", action="store_true", default=False, help="log to Weights & Biases")
    g.add_argument("--wandb-project", type=str, default=None, help="Weights & Biases project name")
    g.add_argument("--wandb-group", type=str, default=None, help="Weights & Biases run group")
    g.add_argument("--wandb-key", type=str, default=None, help="Weights & Biases API key")
    g.add_argument("--wandb-host", type=str, default=None, help="Weights & Biases server URL")
    g.add_argument("--wandb-team", type=str, default=None, help="Weights & Biases entity (team)")
    g.add_argument("--wandb-mode", type=str, default=None, choices=["online", "offline", "disabled"],
                   help="Weights & Biases mode")
    g.add_argument("--wandb-dir", type=str, default=None, help="local directory of Weights & Biases files")
    g.add_argument("--wandb-run-id", type=str, default=None, help="resume this Weights & Biases run")
    g.add_argument("--disable-wandb-random-suffix", action="store_false", dest="wandb_random_suffix",
                   help="no random suffix on the Weights & Biases run name")
    g.add_argument("--wandb-always-use-train-step", action="store_true", default=False,
                   help="use the optimizer step as the Weights & Biases x-axis for every metric")
    g.add_argument("--log-multi-turn", action="store_true", default=False, help="log multi-turn rollout statistics")
    g.add_argument("--log-passrate", action="store_true", default=False, help="log pass@k of the rollout")
    g.add_argument("--log-reward-category", type=str, default=None,
                   help="reward-dict key whose values are counted per rollout")
    g.add_argument("--log-correct-samples", action="store_true", default=False, help="log the correct responses")
    g.add_argument("--use-tensorboard", action="store_true", default=False, help="log to TensorBoard")
    g.add_argument("--tensorboard-dir", type=str, default=None, help="TensorBoard log directory (Megatron's name)")
    g.add_argument("--tb-project-name", type=str, default=None, help="TensorBoard log directory (upstream's name)")
    g.add_argument("--tb-experiment-name", type=str, default=None,
                   help="TensorBoard run name: a sub-directory of the TensorBoard log dir")


def add_debug_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("debug", "reproduce train-phase problems without engines")
    g.add_argument("--save-debug-rollout-data", type=str, default=None,
                   help="save every rollout's samples to this path ('{rollout_id}' template)")
    g.add_argument("--load-debug-rollout-data", type=str, default=None,
                   help="train on saved rollouts instead of generating (implies --debug-train-only)")
    g.add_argument("--load-debug-rollout-data-subsample", type=float, default=None,
                   help="share of each saved rollout to replay")
    g.add_argument("--load-forge-rollout-data", type=str, default=None,
                   help="replay saved rollouts while the engines stay live")
    g.add_argument("--save-debug-train-data", type=str, default=None,
                   help="save the train batch (with log-probs and advantages) per rollout ('{rollout_id}', '{rank}')")
    g.add_argument("--dump-details", type=str, default=None,
                   help="directory for both the rollout and the train data of every rollout")
    g.add_argument("--debug-train-only", action="store_true", default=False, help="no engines; train only")
    g.add_argument("--debug-rollout-only", action="store_true", default=False, help="no training; rollout only")
    g.add_argument("--check-weight-update-equal", action="store_true", default=False,
                   help="compare the engines' weights with the trainer's after a sync")
    g.add_argument("--memory-snapshot-dir", type=str, default=".", help="directory of memory snapshots")
    g.add_argument("--memory-snapshot-num-steps", type=int, default=None, help="steps recorded in a memory snapshot")
    g.add_argument("--memory-recorder", type=str, default="torch", choices=["torch", "memray"],
                   help="memory recorder")
    g.add_argument("--record-memory-history", action="store_true", default=False, help="record allocation history")
    g.add_argument("--http-proxy", type=str, default=None, help="proxy for the rollout's HTTP requests")
    g.add_argument("--use-distributed-post", action="store_true", default=False,
                   help="spread rollout HTTP requests over Ray workers")
    g.add_argument("--ci-test", action="store_true", default=False, help="upstream CI assertions")
    g.add_argument("--ci-disable-kl-checker", action="store_true", default=False, help="skip upstream's CI KL check")
    g.add_argument("--ci-train-rollout-logprob-abs-diff-threshold", type=float, default=0.1,
                   help="upstream CI bound on train/train_rollout_logprob_abs_diff")
    g.add_argument("--ci-save-grad-norm", type=str, default=None, help="file to save grad norms to (CI)")
    g.add_argument("--ci-load-grad-norm", type=str, default=None, help="file of grad norms to compare with (CI)")
