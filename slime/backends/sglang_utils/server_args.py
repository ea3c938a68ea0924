"""Render ServerArgs fields as `sglang.launch_server` flags, against SGLang's own launch parser.

Parsing and validation of the `--sglang-*` passthrough live in `slime/utils/sglang_passthrough.py`
(at argument-parsing time); here `{"mem_fraction_static": 0.7}` becomes `--mem-fraction-static 0.7`
the way the installed SGLang's parser reads it back:
- a BooleanOptionalAction field renders `--x` or `--no-x` (False is a value, not an absence);
- a switch (store_true) renders `--x` when True and nothing when False;
- a dict, or a list for a single-value option (JSON-typed fields), renders as JSON text;
- a list for a multi-value option renders one token per item.
Renamed fields are mapped to the name the installed SGLang has (sglang_passthrough.RENAMED_FIELDS).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from slime.utils.sglang_passthrough import actions_by_dest, apply_renames

def has_option(parser: argparse.ArgumentParser, option: str) -> bool:
    return any(option in action.option_strings for action in parser._actions)


def render_server_flags(server_args: dict[str, Any], parser: argparse.ArgumentParser) -> list[str]:
    """Turn {field: value} into `sglang.launch_server` tokens that `parser` parses back to the same values."""
    known = actions_by_dest(parser)
    tokens: list[str] = []
    for name, value in apply_renames(server_args, parser).items():
        action = known.get(name)
        if action is None:
            raise ValueError(f"SGLang's ServerArgs has no field {name!r} (flag --{name.replace('_', '-')})")
        tokens += _render_one(action, value)
    return tokens


def _render_one(action: argparse.Action, value: Any) -> list[str]:
    option = next(s for s in action.option_strings if s.startswith("--"))
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        return [option if value else "--no-" + option[2:]]
    if action.nargs == 0:  # store_true / store_const switches
        if not isinstance(value, bool):
            raise ValueError(f"{option} is a switch; got {value!r}")
        if not value and action.default:
            raise ValueError(f"{option} is on by default in SGLang and has no off form")
        return [option] if value else []
    if isinstance(value, dict) or (isinstance(value, (list, tuple)) and action.nargs in (None, "?")):
        return [option, json.dumps(value)]
    if isinstance(value, (list, tuple)):
        return [option, *(str(v) for v in value)]
    return [option, str(value)]
