"""``--custom-config-path``: YAML overrides of flags (upstream's semantics) and extra plug-in attributes."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from slime.config.errors import fail, require_path
from slime.utils.security import shown

logger = logging.getLogger(__name__)


def config_key_dest(key: str, parser: argparse.ArgumentParser) -> str | None:
    """The dest a --custom-config-path key names: '--flag-name', 'flag-name' or the attribute 'flag_name'."""
    for option in (key, "--" + key.lstrip("-"), "--" + key.lstrip("-").replace("_", "-")):
        if option in parser._option_string_actions:
            return parser._option_string_actions[option].dest
    dests = {action.dest for action in parser._actions}
    return key if key in dests else None


def coerce_config_value(action: argparse.Action, value: Any) -> Any:
    """A YAML value as the flag's own type would parse it (YAML leaves e.g. 1e-5 a string)."""
    convert = action.type if callable(action.type) and action.type is not json.loads else None
    if convert is None:
        return value
    if isinstance(value, list):
        return [convert(v) if isinstance(v, str) else v for v in value]
    return convert(value) if isinstance(value, str) else value


def apply_custom_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """--custom-config-path: a YAML mapping whose values override the command line (upstream's semantics).

    Keys naming a flag (as '--flag-name', 'flag-name' or 'flag_name') override it before validation, so
    derived values and checks see them; any other key becomes an attribute for plug-ins (custom functions).
    """
    path = args.custom_config_path
    if not path:
        return {}
    import yaml

    require_path("--custom-config-path", path, "file")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        fail(f"--custom-config-path {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    applied = {}
    for key, value in data.items():
        dest = config_key_dest(str(key), parser)
        if dest is None:
            if not str(key).isidentifier():
                fail(f"--custom-config-path {path}: key {key!r} is neither a flag nor a valid attribute name")
            dest = str(key)
        else:
            action = next(a for a in parser._actions if a.dest == dest)
            value = coerce_config_value(action, value)
        if hasattr(args, dest):
            logger.info("--custom-config-path %s: %s = %r (was %r)", path, dest, shown(dest, value),
                        shown(dest, getattr(args, dest)))
        setattr(args, dest, value)
        applied[dest] = shown(dest, value)  # kept with args: no secret in it
    return applied
