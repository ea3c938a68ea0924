"""Upstream slime's remaining non-model flags: --disable-rollout-global-dataset and --log-interval work; every
other one is warned (no effect on the maths) or refused with its reason, never silently accepted."""
from __future__ import annotations

import warnings

import pytest

from arg_testing import no_real_sglang, parse_error, parse_quiet  # noqa: F401 (fixture)
from slime.utils import arguments
from slime.utils.arguments import NotImplementedFlagWarning, parse_args

MINIMAL = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
           "--train-backend-device", "cpu"]
NAMED = ("--disable-rollout-global-dataset", "--keep-old-actor", "--prefill-num-servers", "--profile-target",
         "--sglang-config", "--custom-update-weight-post-write-path", "--slime-router-middleware-paths",
         "--log-interval")


def _value_for(flag: str) -> list[str]:
    kwargs = arguments._UPSTREAM_COMPAT_FLAGS[flag]
    if kwargs.get("action") == "store_true":
        return [flag]
    if "choices" in kwargs:
        return [flag, [c for c in kwargs["choices"] if c != kwargs["default"]][0]]
    return [flag, {int: "2", float: "0.5"}.get(kwargs["type"], "some/value")]


def test_every_named_upstream_flag_is_accepted():
    options = arguments.build_parser()._option_string_actions
    assert [f for f in NAMED if f not in options] == []


@pytest.mark.parametrize("flag", sorted(arguments._UPSTREAM_COMPAT_FLAGS))
def test_each_upstream_flag_is_warned_refused_or_honoured(flag, capsys):
    refused = {e.flag: e.reason for e in arguments.REFUSED_FLAGS}
    warned = {e.flag: e.reason for e in arguments.NOT_IMPLEMENTED_FLAGS}
    argv = MINIMAL + _value_for(flag)
    if flag in refused:
        assert refused[flag] in parse_error(argv, capsys)
    elif flag in warned:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args = parse_args(argv)
        assert flag in args.not_implemented_flags
        assert any(issubclass(w.category, NotImplementedFlagWarning) and flag in str(w.message) for w in caught)
    else:
        assert flag in arguments.ALWAYS_HONOURED_FLAGS and parse_quiet(argv)
    # --help says what the flag does here: its registry mark, with the reason
    parser = arguments.build_parser()
    shown = " ".join(parser._get_formatter()._format_action(parser._option_string_actions[flag]).split())
    assert "upstream slime's flag" in shown and any(m in shown for m in ("[no effect: ", "[refused", "[always on: "))


def test_disable_rollout_global_dataset_leaves_the_prompts_to_the_rollout_function(tmp_path):
    from slime.rollout.data_source import RolloutDataSource
    from slime.rollout.sft_rollout import generate_rollout

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "x"}\n')
    args = parse_quiet(MINIMAL + ["--disable-rollout-global-dataset", "--prompt-data", str(prompts)])
    assert args.rollout_global_dataset is False
    source = RolloutDataSource(args)  # reads nothing: no tokenizer, no prompt file
    assert source.dataset is None and len(source.get_samples(2)) == 2
    with pytest.raises(ValueError, match="remove --disable-rollout-global-dataset"):
        generate_rollout(args, 0, source)
    assert parse_quiet(MINIMAL).rollout_global_dataset is True


def test_log_interval_must_be_positive(capsys):
    assert parse_quiet(MINIMAL + ["--log-interval", "5"]).log_interval == 5
    assert "--log-interval must be positive" in parse_error(MINIMAL + ["--log-interval", "0"], capsys)
