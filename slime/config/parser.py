"""The argparse parser of ``train.py``: every flag group in ``--help`` order, with a one-line usage on errors."""

from __future__ import annotations

import argparse
from typing import Callable

from slime.config.flags import ARGUMENT_GROUPS
from slime.config.help import HELP_EPILOG, DefaultsHelpFormatter


class SlimeArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line usage on errors: the message naming the bad flag stays visible."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n(run with --help for the list of flags)\n")


def build_parser(
    add_custom_arguments: Callable[[argparse.ArgumentParser], argparse.ArgumentParser | None] | None = None,
    prog: str | None = None,
) -> argparse.ArgumentParser:
    """The full parser. ``add_custom_arguments(parser)`` adds extra flags first, as upstream allows."""
    parser = SlimeArgumentParser(
        prog=prog,
        usage="%(prog)s [flags]",
        description="slime-compatible RL training (upstream slime + Megatron flags)",
        allow_abbrev=False,  # a typo must be an error, never a silent prefix match
        formatter_class=DefaultsHelpFormatter,
        epilog=HELP_EPILOG,
    )
    if add_custom_arguments is not None:
        parser = add_custom_arguments(parser) or parser
    for add_group in ARGUMENT_GROUPS:
        add_group(parser)
    return parser
