"""argparse ``type=`` converters whose error message says what was expected."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1, with an error that says so."""
    return _bounded_int(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _bounded_int(text, 0, "a non-negative integer")


def _bounded_int(text: str, lowest: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"{value} is not {what}")
    return value
