"""Helpers shared by the parser tests (test_arguments.py, test_flag_rule.py) and by the driver tests that run
without a command line."""
from __future__ import annotations

import argparse
import warnings

import pytest

from slime.config import defaults_namespace
from slime.config.run_config import build_run_config
from slime.utils import sglang_passthrough
from slime.utils.arguments import parse_args


@pytest.fixture(autouse=True)
def no_real_sglang(monkeypatch):
    """Default: sglang treated as not importable, so results do not depend on what the venv holds."""
    monkeypatch.setattr(sglang_passthrough, "server_args_parser", lambda: None)


def driver_args(**flags) -> argparse.Namespace:
    """The parser's defaults with ``flags``, and the run config parse_args builds from them (args.run_config); flags
    copied from another namespace (``vars(args)``) leave its run config and run state behind, as a new parse would."""
    flags = {k: v for k, v in flags.items() if k not in ("run_config", "run_state")}
    args = defaults_namespace(**flags)
    args.run_config = build_run_config(args)
    return args


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
