"""How ``--help`` and unknown flags read: registry marks, defaults shown once, the epilog, and did-you-mean
answers that first say what the registries make of the known flags.
"""

from __future__ import annotations

import argparse
import copy
import difflib
from typing import Sequence

from slime.config.constants import REQUIRED_FLAGS
from slime.config import registries
from slime.config.registries import active_not_implemented_flags, refusal_messages, resolve_train_device


HELP_EPILOG = """\
This project's own flags (hang-proof step) are in the groups "fencing (this project)" and "rollout deadlines and
fault tolerance": --fence-timeout, --ledger-dir, --ledger-record-sequence, --rollout-timeout,
--rollout-no-progress-timeout, --use-fault-tolerance; --distributed-timeout-minutes (group "cluster") is derived
from --fence-timeout.
Where every rank is in a running or stopped job: python -m slime.distributed.hang_report LEDGER_DIR
Whether every rank ran the same collectives in the same order: python -m slime.distributed.order_proof LEDGER_DIR
Marks: [required] must be given; [refused] stops at parse time with the reason; [no effect] accepted with a
warning, changes nothing; [always on] asks for what this project always does."""


# Flags a run needs in some cases only (parse_args names them when missing): their mark says when.
REQUIRED_WHEN: dict[str, str] = {
    "--prompt-data": "[required with the default data source and rollout function] ",
    "--num-rollout": "[required: this or --num-epoch] ",
    "--num-epoch": "[required: this or --num-rollout] ",
}


def registry_mark(flag: str) -> str:
    """How a flag's help line starts: what the registries say of it ('' for an ordinary flag)."""
    if flag in REQUIRED_FLAGS:
        return "[required] "
    if flag in REQUIRED_WHEN:
        return REQUIRED_WHEN[flag]
    for entry in registries.REFUSED_FLAGS:
        if entry.flag == flag:
            return "[refused: some values] " if entry.is_active else f"[refused: {entry.reason}] "
    for entry in registries.NOT_IMPLEMENTED_FLAGS:
        if entry.flag == flag:
            return f"[no effect: {entry.reason}] "
    if flag in registries.ALWAYS_HONOURED_FLAGS:
        return f"[always on: {registries.ALWAYS_HONOURED_FLAGS[flag]}] "
    return ""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every flag's help line starts with its registry mark and ends with its default, once."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings:
            return text
        text = registry_mark(action.option_strings[0]) + text
        flag = action.option_strings[0]
        refused_values = [e.reason for e in registries.REFUSED_FLAGS if e.flag == flag and e.is_active]
        if refused_values:
            text += f" (refused values: {'; '.join(refused_values)})"
        if (action.default is argparse.SUPPRESS or "%(default)" in text or "default" in text.lower()
                or action.option_strings[0] in REQUIRED_FLAGS):
            return text
        return f"{text} (default: %(default)s)"

    def _format_text(self, text: str) -> str:
        # The epilog keeps its lines (one command per line); the description is one paragraph.
        return text + "\n" if text and "\n" in text else super()._format_text(text)


def closest_flags(flag: str, parser: argparse.ArgumentParser, n: int = 3) -> list[str]:
    """Known flags that look like a mistyped one."""
    return difflib.get_close_matches(flag, list(parser._option_string_actions), n=n, cutoff=0.6)


def unknown_flags_message(flags: Sequence[str], parser: argparse.ArgumentParser) -> str:
    described = []
    for flag in flags:
        close = closest_flags(flag, parser)
        described.append(f"{flag} (did you mean {' or '.join(close)}?)" if close else flag)
    return "unrecognized arguments: " + "; ".join(described)


def unknown_flags_report(argv: Sequence[str], unknown: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """The refusals and no-effect warnings of argv's known flags, then every unknown flag with did-you-mean."""
    lenient = copy.deepcopy(parser)
    for action in lenient._actions:
        action.required = False
    try:
        known, _ = lenient.parse_known_args(list(argv))
    except SystemExit:  # a known flag's own value is malformed: report the unknown ones alone
        return unknown_flags_message(unknown, parser)
    device = resolve_train_device(known)
    parts = [f"refused: {m}" for m in refusal_messages(known, parser, device)]
    parts += [f"accepted without effect: {e.flag} ({e.reason})"
              for e in active_not_implemented_flags(known, parser, device)]
    return "\n".join([*parts, unknown_flags_message(unknown, parser)])
