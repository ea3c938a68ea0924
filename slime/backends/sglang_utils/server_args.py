"""`--sglang-<server-arg>` passthrough: split them out of argv, validate, render for the launcher.

A flag `--sglang-mem-fraction-static 0.7` becomes `{"mem_fraction_static": "0.7"}` and, at
launch, `--mem-fraction-static 0.7` on `sglang.launch_server`. Names are checked against
SGLang's ServerArgs when SGLang can be imported (the cluster path); otherwise they pass
through unchecked and SGLang itself rejects unknown ones when it starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, Collection

SGLANG_FLAG_PREFIX = "--sglang-"

# slime's own flags that share the prefix but are not SGLang server args.
SLIME_OWN_SGLANG_FLAGS = frozenset(
    {"router_ip", "router_port", "router_policy", "router_request_timeout_secs", "server_concurrency"}
)


def flag_to_field(flag: str) -> str:
    """'--sglang-mem-fraction-static' -> 'mem_fraction_static'."""
    return flag[len(SGLANG_FLAG_PREFIX) :].replace("-", "_")


def field_to_server_flag(name: str) -> str:
    """'mem_fraction_static' -> '--mem-fraction-static' (sglang.launch_server's spelling)."""
    return "--" + name.replace("_", "-")


def split_sglang_args(
    argv: list[str], reserved: Collection[str] = SLIME_OWN_SGLANG_FLAGS
) -> tuple[dict[str, Any], list[str]]:
    """Pull `--sglang-*` server args out of argv.

    Returns ({field: value}, remaining argv). A flag followed by another flag (or nothing) is a
    boolean switch (value True); several values give a list. `reserved` names stay in argv
    for slime's own parser.
    """
    collected: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = flag_to_field(token.split("=", 1)[0]) if token.startswith(SGLANG_FLAG_PREFIX) else None
        if name is None or name in reserved:
            rest.append(token)
            i += 1
            continue
        if "=" in token:
            collected[name] = token.split("=", 1)[1]
            i += 1
            continue
        values = []
        i += 1
        while i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        collected[name] = True if not values else values[0] if len(values) == 1 else values
    return collected, rest


@functools.lru_cache(maxsize=1)
def sglang_server_arg_names() -> frozenset[str] | None:
    """Field names of SGLang's ServerArgs (plus its CLI dests), or None when SGLang can't be imported."""
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception:  # sglang absent or missing its GPU dependencies: no local validation
        return None
    names: set[str] = set()
    if dataclasses.is_dataclass(ServerArgs):
        names |= {f.name for f in dataclasses.fields(ServerArgs)}
    parser = argparse.ArgumentParser(add_help=False)
    try:
        ServerArgs.add_cli_args(parser)
        names |= {action.dest for action in parser._actions}
    except Exception:
        pass
    return frozenset(names) if names else None


def validate_sglang_server_args(server_args: dict[str, Any], known: frozenset[str] | None = None) -> None:
    """Raise ValueError naming every `--sglang-*` flag that SGLang's ServerArgs doesn't have."""
    known = known if known is not None else sglang_server_arg_names()
    if known is None:
        return
    unknown = sorted(name for name in server_args if name not in known)
    if unknown:
        flags = ", ".join(SGLANG_FLAG_PREFIX + n.replace("_", "-") for n in unknown)
        raise ValueError(f"unknown SGLang server argument(s): {flags} (not fields of sglang ServerArgs)")


def render_server_flags(server_args: dict[str, Any]) -> list[str]:
    """Turn {field: value} into `sglang.launch_server` command-line tokens."""
    tokens: list[str] = []
    for name, value in server_args.items():
        if value is False or value is None:
            continue
        tokens.append(field_to_server_flag(name))
        if value is True:
            continue
        if isinstance(value, (list, tuple)):
            tokens.extend(str(v) for v in value)
        else:
            tokens.append(str(value))
    return tokens
