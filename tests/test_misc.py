"""slime.utils.misc: hook loading with clear errors, singleton metaclass, integer helpers."""

from __future__ import annotations

import os.path
import sys

import pytest

from slime.utils.misc import SingletonMeta, ceil_div, load_function, module_is_findable, round_up, split_function_path


def test_load_function_dotted_path():
    assert load_function("os.path.join") is os.path.join


def test_load_function_file_path(tmp_path):
    hook = tmp_path / "my_hook.py"
    hook.write_text("def reward(args, sample):\n    return 0.5\n")
    fn = load_function(f"{hook}:reward")
    assert fn(None, None) == 0.5


def test_missing_module_error_names_the_path():
    with pytest.raises(ModuleNotFoundError, match=r"no_such_pkg_abc\.mod\.fn.*no_such_pkg_abc"):
        load_function("no_such_pkg_abc.mod.fn")


def test_missing_attribute_error_names_module_and_attribute():
    with pytest.raises(AttributeError, match=r"'os\.path\.no_such_fn'.*'os\.path'.*'no_such_fn'"):
        load_function("os.path.no_such_fn")


def test_missing_file_error_names_the_file(tmp_path):
    with pytest.raises(ModuleNotFoundError, match="missing_hook.py"):
        load_function(f"{tmp_path}/missing_hook.py:fn")


def test_import_error_inside_the_module_is_not_masked(tmp_path, monkeypatch):
    (tmp_path / "broken_hook_mod.py").write_text("import definitely_missing_dependency_q\ndef fn(): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        load_function("broken_hook_mod.fn")
    assert info.value.name == "definitely_missing_dependency_q"


@pytest.mark.parametrize("bad", ["", "nodots", "pkg.", ":fn"])
def test_malformed_paths_are_rejected(bad):
    with pytest.raises(ValueError, match="function path"):
        split_function_path(bad)


def test_module_is_findable(tmp_path):
    assert module_is_findable("os.path.join")
    assert not module_is_findable("no_such_pkg_abc.sub.fn")
    assert not module_is_findable(f"{tmp_path}/nope.py:fn")


def test_singleton_meta_returns_one_instance_until_reset():
    class Registry(metaclass=SingletonMeta):
        def __init__(self, value):
            self.value = value

    first = Registry(1)
    assert Registry(2) is first and first.value == 1
    SingletonMeta.reset(Registry)
    assert Registry(3).value == 3


def test_integer_helpers():
    assert [ceil_div(a, 4) for a in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert [round_up(a, 8) for a in (0, 1, 8, 40001)] == [0, 8, 8, 40008]


def test_configure_logger_stamps_role_once(capsys, monkeypatch):
    import logging

    from slime.utils import logging_utils

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # restored after the test: no handler leaks
    monkeypatch.setattr(logging_utils, "_configured", False)
    monkeypatch.setattr(root, "level", root.level)
    try:
        logging_utils.configure_logger(logging.INFO, role="rank 3")
        logging_utils.configure_logger(logging.INFO, role="rank 9")  # second call adds no second handler
        logging.getLogger("slime.test").info("hello from the test")
    finally:
        logging.captureWarnings(False)
    err = capsys.readouterr().err
    assert err.count("hello from the test") == 1 and "rank 3" in err


def test_file_hook_is_executed_once_and_keeps_its_state(tmp_path):
    # a hook with module state (a counter of its calls, and of the times its file ran)
    hook = tmp_path / "stateful_hook.py"
    hook.write_text("import builtins\n"
                    "builtins.__dict__.setdefault('_stateful_hook_runs', []).append(1)\n"
                    "CALLS = []\n"
                    "def count(args):\n    CALLS.append(args)\n    return len(CALLS)\n")
    import builtins

    first = load_function(f"{hook}:count")
    assert first(1) == 1
    again = load_function(f"{hook}:count")
    assert again is first
    assert again(2) == 2  # the state of the first call survived the second load
    assert builtins._stateful_hook_runs == [1]  # the file ran once
    module = sys.modules[first.__module__]
    assert module.CALLS == [1, 2]
    # another spelling of the same file is the same module
    assert load_function(f"{tmp_path}/./stateful_hook.py:count") is first


def test_file_hook_that_fails_to_load_is_not_cached(tmp_path):
    hook = tmp_path / "broken_hook.py"
    hook.write_text("raise RuntimeError('not yet')\n")
    with pytest.raises(RuntimeError, match="not yet"):
        load_function(f"{hook}:fn")
    hook.write_text("def fn():\n    return 'fixed'\n")
    assert load_function(f"{hook}:fn")() == "fixed"
