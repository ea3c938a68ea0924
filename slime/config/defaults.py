"""Arguments without a command line: every flag at the parser's default, with overrides.

For code and tests that call a function taking ``args`` without going through ``parse_args``: the namespace has
every flag (so the code reads ``args.flag`` and never needs a fallback), but no derived value and no check."""

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
    return argparse.Namespace(**{**defaults, **overrides})

