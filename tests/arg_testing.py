"""Helpers shared by the parser tests (test_arguments.py, test_flag_rule.py)."""
from __future__ import annotations

import warnings

import pytest

from slime.utils import sglang_passthrough
from slime.utils.arguments import parse_args


@pytest.fixture(autouse=True)
def no_real_sglang(monkeypatch):
    """Default: sglang treated as not importable, so results do not depend on what the venv holds."""
    monkeypatch.setattr(sglang_passthrough, "server_args_parser", lambda: None)


def parse_quiet(argv):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parse_args(argv)


def parse_error(argv, capsys) -> str:
    """The parser's message for argv, which must be refused with exit code 2."""
    with pytest.raises(SystemExit) as info:
        parse_quiet(argv)
    assert info.value.code == 2
    return capsys.readouterr().err
