"""Checks of the RL objective: KL and advantage combinations, plug-in companions and distillation."""

from __future__ import annotations

import argparse

from slime.algorithms import estimator
from slime.config.errors import fail, require_path


def check_algorithm(args: argparse.Namespace) -> None:
    if args.kl_coef != 0 and args.kl_loss_coef != 0:
        fail("--kl-coef (reward shaping) and --kl-loss-coef (loss term) cannot both be non-zero; pick one")
    check_estimator(args)
    if args.save_interval is not None and args.save is None:
        fail("--save-interval needs --save DIR")
    if args.save_hf and not (args.save and args.save_interval):
        fail("--save-hf is written with each checkpoint: add --save DIR --save-interval N")


def check_estimator(args: argparse.Namespace) -> None:
    """What the run's estimator record (slime/algorithms) requires and refuses."""
    record = estimator(args.advantage_estimator)
    if record.always_whitened and not args.normalize_advantages:
        fail(f"--advantage-estimator {record.name} requires --normalize-advantages")
    if record.check_flags is not None:
        try:
            record.check_flags(args)
        except ValueError as error:
            fail(str(error))


def check_plugins(args: argparse.Namespace) -> None:
    """Plug-in flags that would silently do nothing without their companion flag."""
    if args.loss_type == "custom_loss" and not args.custom_loss_function_path:
        fail("--loss-type custom_loss needs --custom-loss-function-path pkg.module.fn")
    if args.custom_loss_function_path and args.loss_type != "custom_loss":
        fail("--custom-loss-function-path is used with --loss-type custom_loss only; add it")
    if args.custom_tis_function_path and not (args.use_tis or args.get_mismatch_metrics):
        fail("--custom-tis-function-path replaces TIS: add --use-tis (or --get-mismatch-metrics, as upstream)")
    if args.only_train_params_name_list and args.freeze_params_name_list:
        fail("pass one of --only-train-params-name-list and --freeze-params-name-list, not both")
    if args.ref_update_interval is not None and not (args.use_kl_loss or args.kl_coef):
        fail("--ref-update-interval refreshes the reference model, which only --use-kl-loss or --kl-coef use")


def check_opd(args: argparse.Namespace) -> None:
    """Upstream's rules for the on-policy distillation flags."""
    if not args.use_opd:
        if args.opd_teacher_load is not None:
            fail("--opd-teacher-load is set but --use-opd is not; add --use-opd --opd-type megatron")
        if args.opd_type is not None:
            fail(f"--opd-type {args.opd_type} has no effect without --use-opd; add --use-opd")
        return
    if args.opd_type is None:
        fail("--use-opd needs --opd-type sglang (a teacher engine) or --opd-type megatron (a teacher checkpoint)")
    if args.opd_type == "megatron":
        if args.opd_teacher_load is None:
            fail("--opd-type megatron needs --opd-teacher-load DIR (the teacher's checkpoint)")
        require_path("--opd-teacher-load", args.opd_teacher_load, "checkpoint")
    elif args.opd_teacher_load is not None:
        fail("--opd-teacher-load is for --opd-type megatron; with --opd-type sglang the teacher engine at --rm-url "
             "scores the samples")
    if args.opd_teacher_ckpt_step is not None and args.opd_type != "megatron":
        fail("--opd-teacher-ckpt-step picks an iteration of --opd-teacher-load (--opd-type megatron)")
    if args.loss_type != "policy_loss":
        fail(f"--use-opd shapes the advantages of --loss-type policy_loss; --loss-type {args.loss_type} has none")
    if not args.compute_advantages_and_returns:
        fail("--use-opd adds its penalty to the advantages: remove --disable-compute-advantages-and-returns")
    if args.custom_advantage_function_path:
        fail("--use-opd adds its penalty to the built-in advantages, which --custom-advantage-function-path "
             "replaces: drop one of them (or add the teacher term inside the custom function)")
