"""The flags that functions plug-ins call themselves (the data source, the rewards, a sample's sampling seed) read
from `args`: the run's value, or the parser's default when a hand-built args object lacks the field.

Upstream's plug-in tests call these with a small namespace of the fields upstream reads there; this project reads a
few more (--seed for the sampling seed and `--rm-type random`, the data source's prompt and shuffle flags), which
such a namespace never set. Everywhere else code reads `args.flag` (docs/architecture.md).
"""
from __future__ import annotations

import functools
from typing import Any


def flag(args: Any, name: str) -> Any:
    """args.<name>, else the parser's default of that flag."""
    try:
        return getattr(args, name)
    except AttributeError:
        return _parser_defaults()[name]


@functools.cache
def _parser_defaults() -> dict[str, Any]:
    from slime.config.defaults import defaults_namespace  # the whole parser, built once, only for such an args

    return vars(defaults_namespace())
