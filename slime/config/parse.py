"""``parse_args``: parse, apply ``--custom-config-path``, name every missing flag at once, validate, and warn
once per accepted-but-unimplemented flag.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from slime.config.checks.engines import check_engine_span
from slime.config.checks.rollout import check_rollout_backend
from slime.config.custom_config import apply_custom_config
from slime.config.errors import ArgumentValidationError, fail
from slime.config.help import unknown_flags_report
from slime.config.launch import launch_missing_flags
from slime.config.parser import build_parser
from slime.config.registries import resolve_train_device, warn_not_implemented
from slime.config.run_config import build_run_config
from slime.config.validate import validate_args
from slime.utils import sglang_passthrough
from slime.utils.security import resolve_api_key


def _check_required(args: argparse.Namespace, required: Sequence[argparse.Action]) -> None:
    """Every flag the run cannot do without, named in one error: the parser's required ones, --num-rollout or
    --num-epoch, and, when any of those is missing, what the launch will need too (check_launch_inputs)."""
    missing = [f"{action.option_strings[0]} is required: {action.help}" for action in required
               if getattr(args, action.dest) is None]
    if args.num_rollout is None and args.num_epoch is None:
        missing.append("--num-rollout N (rollout steps) or --num-epoch N is required")
    if missing:
        fail("; ".join([*missing, *launch_missing_flags(args)]))


def apply_sglang_server_args(args: argparse.Namespace, passthrough: list[tuple[str, list[str]]]) -> None:
    """``args.sglang_server_args``: the ServerArgs overrides the user asked for (sglang_passthrough), each mirrored
    as ``args.sglang_<name>`` too (upstream code reads them that way)."""
    args.sglang_server_args = sglang_passthrough.resolve_server_args(args, passthrough)
    for name, value in args.sglang_server_args.items():
        setattr(args, "sglang_" + name, value)


def parse_args(
    argv: Sequence[str] | None = None,
    add_custom_arguments: Callable[[argparse.ArgumentParser], argparse.ArgumentParser | None] | None = None,
) -> argparse.Namespace:
    """Parse ``argv`` (default: sys.argv[1:]), apply --custom-config-path, validate, build ``args.run_config``
    (slime/config/run_config.py), and warn about accepted-but-unimplemented flags.

    Unknown flags (answered with the closest known ones), refused flags and invalid combinations exit
    with status 2 and a message naming the flags.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(add_custom_arguments)
    known_sglang = sglang_passthrough.registered_sglang_flags(parser)
    remaining, passthrough = sglang_passthrough.split_passthrough(argv, known_sglang)
    # Unknown flags before argparse (which would report a missing required flag instead), after what the
    # registries say of the known ones: an upstream job learns why its refused flags cannot run first.
    unknown = [a.split("=", 1)[0] for a in remaining
               if a.startswith("--") and a.split("=", 1)[0] not in parser._option_string_actions]
    if unknown:
        parser.error(unknown_flags_report(remaining, unknown, parser))
    required = [action for action in parser._actions if action.required]
    for action in required:  # checked below with every other missing flag, so that one run names them all
        action.required = False
    try:
        args = parser.parse_args(remaining)
    finally:
        for action in required:
            action.required = True
    try:
        args.custom_config_overrides = apply_custom_config(args, parser)
        _check_required(args, required)
        try:  # once, in the driver: every server of the run gets it
            args.api_key = resolve_api_key(args.api_key)
        except ValueError as exc:
            raise ArgumentValidationError(f"--api-key: {exc}") from None
        apply_sglang_server_args(args, passthrough)
        device = resolve_train_device(args)
        validate_args(args, parser, device)
        check_rollout_backend(args)
        check_engine_span(args)
        args.run_config = build_run_config(args)  # last: from the checked, derived flags
    except (ArgumentValidationError, sglang_passthrough.SGLangArgumentError) as exc:
        parser.error(str(exc))
    args.not_implemented_flags = tuple(warn_not_implemented(args, parser, device))
    return args
