"""Arguments without a command line: every flag at the parser's default, with overrides.

For code and tests that call a function taking ``args`` without going through ``parse_args``: the namespace has
every flag (so the code reads ``args.flag`` and never needs a fallback), completed as parse_args completes it
(``complete_unset``), but with no other derived value and no check."""

from __future__ import annotations

import argparse
from typing import Any

from slime.config.parser import build_parser


def defaults_namespace(**overrides: Any) -> argparse.Namespace:
    """The parser's defaults (converted by each flag's type, as parsing does), then ``overrides``."""
    parser = build_parser()
    for action in parser._actions:
        action.required = False
    defaults = vars(parser.parse_args([]))
    args = argparse.Namespace(**{**defaults, **overrides})
    complete_unset(args)
    return args


DEFAULT_TENSORBOARD_DIR = "tensorboard_log"  # upstream's, when TensorBoard is on and no directory is named


def complete_unset(args: Any) -> None:
    """The flags left unset whose value follows from other flags (parse_args runs this too): the TensorBoard
    directory is --tensorboard-dir, else --tb-project-name (upstream's name), else the default with
    --use-tensorboard (unset: TensorBoard is off)."""
    if args.tensorboard_dir is None and args.tb_project_name is not None:
        args.tensorboard_dir = args.tb_project_name
    if args.tensorboard_dir is None and args.use_tensorboard:
        args.tensorboard_dir = DEFAULT_TENSORBOARD_DIR

