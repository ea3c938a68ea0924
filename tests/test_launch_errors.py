"""What fails before Ray starts fails at parse time, with the fix; what fails after ends in one line.

A misspelled hook, a hook path without a module, a missing or incomplete --hf-checkpoint and
--colocate across nodes are refused before any process starts; any error of a started run ends
in its traceback and one `training stopped:` line; a run that ends cleanly removes the temp ledger
directory it made, a failed one keeps it.
"""
from __future__ import annotations

import json
import logging
import os

import pytest

import train
from arg_testing import no_real_sglang, parse_error  # noqa: F401 (fixture)
from slime.utils.arguments import ArgumentValidationError, check_launch_inputs

BASE = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
        "--train-backend-device", "cpu"]


@pytest.mark.parametrize("path, says", [
    ("examples.counting_reward.rewrd", "has no attribute 'rewrd'"),
    ("no_dots", "must look like 'pkg.module.func' or 'file.py:func'"),
    ("examples.no_such_module.reward", "cannot find the module"),
    ("examples.counting_reward.CREDIT_RANGE", "of type int, not a function or class"),
])
def test_a_hook_that_does_not_resolve_to_a_callable_is_refused_at_parse_time(path, says, capsys):
    err = parse_error([*BASE, "--custom-rm-path", path], capsys)
    assert "--custom-rm-path" in err and says in err
    assert "Traceback" not in err


def test_colocate_across_nodes_is_refused_with_what_to_use_instead(capsys):
    err = parse_error([*BASE, "--actor-num-nodes", "2", "--colocate"], capsys)
    assert "--colocate with --actor-num-nodes 2" in err and "--rollout-num-gpus" in err


def _hf_dir(tmp_path, files):
    path = tmp_path / "hf"
    path.mkdir()
    for name in files:
        (path / name).write_text(json.dumps({}))
    return str(path)


@pytest.mark.parametrize("files, says", [
    (None, "--hf-checkpoint DIR is required"),
    ([], "no config.json"),
    (["config.json"], "no tokenizer"),
])
def test_an_unusable_hf_checkpoint_is_named_before_start(files, says, tmp_path):
    import types

    path = None if files is None else _hf_dir(tmp_path, files)
    with pytest.raises(ArgumentValidationError, match=says):
        check_launch_inputs(types.SimpleNamespace(hf_checkpoint=path, num_experts=None, tensor_model_parallel_size=1,
                                                  sequence_parallel=False, debug_rollout_only=False))
    if files is None:
        with pytest.raises(ArgumentValidationError, match="does not exist"):
            check_launch_inputs(types.SimpleNamespace(hf_checkpoint=str(tmp_path / "missing")))


def test_train_py_without_a_checkpoint_exits_2_before_ray(capsys, monkeypatch):
    monkeypatch.setattr(train, "train", lambda args: pytest.fail("must not start"))
    assert train.main(BASE) == 2
    assert "--hf-checkpoint DIR is required" in capsys.readouterr().err


@pytest.fixture
def launchable(tmp_path):
    return [*BASE, "--hf-checkpoint", _hf_dir(tmp_path, ["config.json", "tokenizer.json"])]


def test_an_unexpected_error_after_start_ends_in_its_traceback_and_one_line(launchable, monkeypatch, caplog):
    made = {}

    def broken(args):
        train.resolve_ledger_dir(args)
        made["dir"] = args.ledger_dir
        raise KeyError("reward")

    monkeypatch.setattr(train, "train", broken)
    with caplog.at_level(logging.INFO):
        assert train.main(launchable) == 1
    stopped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training stopped:")]
    assert stopped == [f"training stopped: KeyError: 'reward' (ledger dir {made['dir']})"]
    assert any(r.exc_info and r.exc_info[0] is KeyError for r in caplog.records)
    assert os.path.isdir(made["dir"])  # kept for the post-mortem


def test_a_clean_run_removes_the_temp_ledger_dir_it_made(launchable, monkeypatch, tmp_path):
    made = {}

    def fine(args):
        train.resolve_ledger_dir(args)
        made["dir"] = args.ledger_dir

    monkeypatch.setattr(train, "train", fine)
    assert train.main(launchable) == 0
    assert not os.path.exists(made["dir"])
    own = tmp_path / "mine"
    own.mkdir()
    assert train.main([*launchable, "--ledger-dir", str(own)]) == 0
    assert own.is_dir()  # a directory the user named is never removed


def test_moe_at_tensor_parallel_without_sequence_parallel_is_refused_before_start(tmp_path):
    import types

    path = _hf_dir(tmp_path, ["config.json", "tokenizer.json"])
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"num_experts": 8}))
    args = dict(hf_checkpoint=path, num_experts=None, tensor_model_parallel_size=2, sequence_parallel=False,
                debug_rollout_only=False)
    with pytest.raises(ArgumentValidationError, match="add it"):
        check_launch_inputs(types.SimpleNamespace(**args))
    check_launch_inputs(types.SimpleNamespace(**{**args, "sequence_parallel": True}))
    check_launch_inputs(types.SimpleNamespace(**{**args, "tensor_model_parallel_size": 1}))
