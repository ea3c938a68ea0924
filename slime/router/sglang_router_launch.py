"""`python -m slime.router.sglang_router_launch <sglang-router flags>`: sglang-router with the run's key taken from
the environment ($SLIME_API_KEY), not from the command line.

sglang-router (0.3.2) reads its `--api-key` from argv only, where every local user can read it
(/proc/<pid>/cmdline, `ps`). This launcher hands the key to sglang-router's own argument parser inside the
process, so the process's command line never holds it; everything else is sglang-router's launcher as it is.
"""
from __future__ import annotations

import sys

from slime.utils.security import server_key


def router_argv(argv: list[str], key: str) -> list[str]:
    """What sglang-router's parser is given: the flags, then the key (never passed in by the caller)."""
    if any(token == "--api-key" or token.startswith("--api-key=") for token in argv):
        raise SystemExit("--api-key on the command line is what this launcher exists to avoid: export "
                         "SLIME_API_KEY instead")
    return [*argv, "--api-key", key]


def main(argv: list[str] | None = None) -> None:
    from sglang_router.launch_router import launch_router, parse_router_args

    argv = sys.argv[1:] if argv is None else argv
    launch_router(parse_router_args(router_argv(list(argv), server_key().reveal())))


if __name__ == "__main__":
    main()
