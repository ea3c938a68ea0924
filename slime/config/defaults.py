"""Arguments without a command line: every flag at the parser's default, with overrides.

For code and tests that call a function taking ``args`` without going through ``parse_args``: the namespace has
every flag (so the code reads ``args.flag`` and never needs a fallback), but no derived value and no check."""

from __future__ import annotations

import argparse
from typing import Any, Iterable

from slime.config.parser import build_parser


def defaults_namespace(*, only: Iterable[str] | None = None, **overrides: Any) -> argparse.Namespace:
    """The parser's defaults (converted by each flag's type, as parsing does), then ``overrides``.

    ``only``: keep just these flags' defaults (e.g. ``LAYOUT_FLAGS``), for a caller whose other reads are its own."""
    parser = build_parser()
    for action in parser._actions:
        action.required = False
    defaults = vars(parser.parse_args([]))
    if only is not None:
        defaults = {dest: defaults[dest] for dest in only}
    return argparse.Namespace(**{**defaults, **overrides})


def with_defaults(args: Any, dests: Iterable[str]) -> argparse.Namespace:
    """``args`` with the parser's default for each of ``dests`` it lacks: for entry points that also take
    arguments built by hand (benchmarks, tool scripts), so that they read ``args.flag`` with one source of
    defaults, the parser's."""
    missing = [dest for dest in dests if not hasattr(args, dest)]
    given = vars(args)
    return defaults_namespace(only=missing, **given) if missing else argparse.Namespace(**given)
