"""Render `--sglang-<server-arg>` values for `sglang.launch_server`.

Parsing and validation of the passthrough flags live in `slime/utils/sglang_passthrough.py`
(at argument-parsing time); here `{"mem_fraction_static": 0.7}` only becomes
`--mem-fraction-static 0.7` on the server's command line.
"""

from __future__ import annotations

from typing import Any


def render_server_flags(server_args: dict[str, Any]) -> list[str]:
    """Turn {field: value} into `sglang.launch_server` command-line tokens."""
    tokens: list[str] = []
    for name, value in server_args.items():
        if value is False or value is None:
            continue
        tokens.append("--" + name.replace("_", "-"))
        if value is True:
            continue
        if isinstance(value, (list, tuple)):
            tokens.extend(str(v) for v in value)
        else:
            tokens.append(str(value))
    return tokens
