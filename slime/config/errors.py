"""The errors a bad flag combination raises, and the helpers that word them.

``fail`` raises ``ArgumentValidationError``; ``derive`` records how a value the user did not pass was
derived, so that ``named`` can say it in a later error; ``require_path`` raises ``MissingPathError``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


class ArgumentValidationError(ValueError):
    """A flag combination that cannot run; the message says which flags and what to change."""


class MissingPathError(ArgumentValidationError, FileNotFoundError):
    """A flag points at a file, directory or module that does not exist."""


class NotImplementedFlagWarning(UserWarning):
    """An accepted flag whose behaviour this project does not (yet) provide."""


def fail(message: str) -> None:
    raise ArgumentValidationError(message)


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def derive(args: argparse.Namespace, dest: str, value: Any, how: str) -> None:
    """Set a value the user did not pass, remembering how it was derived (for error messages)."""
    setattr(args, dest, value)
    args.derived_values[dest] = how


def named(args: argparse.Namespace, dest: str) -> str:
    """'--flag value', with where the value came from when the user did not pass it."""
    how = args.derived_values.get(dest)
    text = f"{flag_name(dest)} {getattr(args, dest)}"
    return text if how is None else f"{text} (not passed: {how})"


def require_path(flag: str, path: str, kind: str = "path") -> None:
    if not os.path.exists(path):
        raise MissingPathError(f"{flag}: {kind} {path!r} does not exist")
