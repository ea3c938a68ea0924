"""Flags of the optimizer, learning-rate schedule and batch, and the per-rank Megatron plug-in hooks."""

from __future__ import annotations

import argparse


def add_megatron_training_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron optimizer/training", "optimizer, schedule and batch")
    g.add_argument("--train-backend", type=str, default="megatron", choices=["megatron"], help="training backend")
    g.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch (static batching)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step (default: a whole rollout, or set by --num-steps-per-rollout)")
    g.add_argument("--optimizer", type=str, default="adam", choices=["adam", "sgd"],
                   help="optimizer of the training step (adam only here)")
    g.add_argument("--lr", type=float, default=1e-6, help="learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="floor of the decayed learning rate")
    g.add_argument("--lr-decay-style", type=str, default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   help="learning-rate schedule after warm-up")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="optimizer steps of the decay (default: --train-iters)")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="optimizer steps of linear warm-up")
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="warm-up as a share of the decay steps")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of warm-up")
    g.add_argument("--train-iters", type=int, default=None, help="total optimizer steps the schedule is laid out for")
    g.add_argument("--weight-decay", type=float, default=0.01, help="decoupled weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's first-moment decay")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam's second-moment decay")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam's denominator epsilon")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true", default=False,
                   help="keep and reduce gradients in fp32")
    g.add_argument("--use-precision-aware-optimizer", action="store_true", default=False,
                   help="the optimizer, not megatron's distributed optimizer, holds the fp32 master weights; with "
                        "--optimizer-cpu-offload they live on the host beside Adam's moments (docs/gpu.md)")
    g.add_argument("--optimizer-cpu-offload", action="store_true", default=False,
                   help="Adam's state and update on the host: megatron-core's hybrid CPU/GPU optimizer, gradients "
                        "copied to the host and weights back at every step (needs --use-precision-aware-optimizer; "
                        "turns on --use-distributed-optimizer, as upstream always has it; docs/gpu.md)")
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                   help="with --optimizer-cpu-offload: the share of the parameters (by elements, in order) whose "
                        "state and update are on the host; the rest update on the device")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true", default=False,
                   help="with --optimizer-cpu-offload: one host optimizer per parameter, the gradient and weight "
                        "copies on side streams, so copies and host updates overlap")
    g.add_argument("--only-train-params-name-list", type=str, nargs="*", default=None,
                   help="regexes of parameter names to train; every other parameter is frozen (with "
                        "--enable-lora: trained in full beside the adapters; the critic's value head always trains)")
    g.add_argument("--freeze-params-name-list", type=str, nargs="*", default=None,
                   help="regexes of parameter names to freeze")
    g.add_argument("--recompute-loss-function", action="store_true", default=False,
                   help="recompute the loss in backward to save memory")
    g.add_argument("--force-fp8-ue8m0-scale", action="store_true", default=False,
                   help="quantize block-FP8 rollout weights with power-of-two scales")
    g.add_argument("--log-probs-chunk-size", type=int, default=-1,
                   help="tokens per chunk of the log-prob computation (-1: one chunk)")
    g.add_argument("--seed", type=int, default=1234, help="seed of weight init, dropout and sampling")
    add_lora_arguments(parser)


LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA", "low-rank adapters on the tensor-parallel linear layers; the base is frozen")
    g.add_argument("--enable-lora", action="store_true", default=False,
                   help="train LoRA adapters only (the base weights are frozen and hold no optimizer state); the "
                        "engines are served the merged weights W + alpha/rank * B @ A. Under --advantage-estimator "
                        "ppo the critic gets the same adapters, its value head trained in full beside them")
    g.add_argument("--lora-target-modules", type=str, nargs="+", default=list(LORA_TARGET_MODULES),
                   help=f"megatron linear layers that get an adapter (of {', '.join(LORA_TARGET_MODULES)}; "
                        "linear_fc1/linear_fc2 include each routed expert's), or all-linear (PEFT's and "
                        "Megatron-Bridge's name for every one of them, what the default also adapts)")
    g.add_argument("--lora-rank", type=int, default=32, help="rank r of each adapter")
    g.add_argument("--lora-alpha", type=float, default=32.0, help="adapter scale numerator: the update is alpha/r * B @ A")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapter's input (training only)")


def add_custom_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron plug-ins", "functions called on every training rank")
    g.add_argument("--custom-megatron-init-path", type=str, default=None,
                   help="fn(args) called once after megatron's process groups and RNG are set up")
    g.add_argument("--custom-megatron-before-log-prob-hook-path", type=str, default=None,
                   help="fn(args, model, store_prefix) before each log-prob pass ('' actor, 'ref_' reference)")
    g.add_argument("--custom-megatron-before-train-step-hook-path", type=str, default=None,
                   help="fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) before each step")
    g.add_argument("--megatron-deepgemm-forward-layers", type=int, nargs="+", default=None,
                   help="layers whose linears use TransformerEngine's DeepGEMM forward")
    g.add_argument("--megatron-deepgemm-forward-modules", type=str, nargs="+", default=None,
                   help="module-name suffixes replaced in those layers")
    g.add_argument("--megatron-deepgemm-moe-forward-layers", type=int, nargs="+", default=None,
                   help="MoE layers using the grouped DeepGEMM forward")
    g.add_argument("--megatron-deepgemm-moe-forward-modules", type=str, nargs="+", default=None,
                   help="MoE module-name suffixes replaced in those layers")
