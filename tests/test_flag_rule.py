"""Flag honesty and a --help a user can work from.

- every flag the parser accepts is read by the code, or sits in a registry (warned, refused, always honoured);
- every upstream slime flag is accepted (upstream's example scripts parse);
- flags that would change the maths without being implemented are refused at parse time;
- --help gives every flag a one-line meaning and its default; an unknown flag gets the closest known ones;
- errors about derived values say where the value came from, with flag names;
- --custom-config-path overrides flags from YAML.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from arg_testing import no_real_sglang, parse_error, parse_quiet  # noqa: F401 (fixture)
from slime.utils import arguments, sglang_passthrough
from slime.utils.arguments import build_parser

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_FLAGS = Path(__file__).with_name("upstream_slime_flags.txt")
MINIMAL = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
           "--train-backend-device", "cpu"]
TERSE_HELP = {"tp", "pp", "cp", "ep", "mode", "dir", "group", "project", "score", "server", "entity", "format",
              "norm", "bias", "drops", "balancing", "recompute", "recompute method", "optimizer"}


# ---------------------------------------------------------------- the flag rule


def _code_files() -> list[tuple[Path, str]]:
    files = [*ROOT.glob("slime/**/*.py"), *ROOT.glob("slime_plugins/**/*.py"),
             ROOT / "train.py"]
    return [(path, path.read_text()) for path in files]


def _declares_flags(path: Path) -> bool:
    """The parser's own modules: slime/config (flags, registries, checks) and its re-export slime/utils/arguments.py."""
    return path.name == "arguments.py" or (ROOT / "slime" / "config") in path.parents


def _code_text() -> str:
    texts = []
    for path, text in _code_files():
        if _declares_flags(path):  # the declarations themselves do not count as reads
            text = "\n".join(line for line in text.splitlines() if "add_argument(" not in line and "dest=" not in line)
        texts.append(text)
    return "\n".join(texts)


def test_every_accepted_flag_is_read_or_registered():
    parser = build_parser()
    code = _code_text()
    registered = ({e.flag for e in arguments.NOT_IMPLEMENTED_FLAGS} | {e.flag for e in arguments.REFUSED_FLAGS}
                  | set(arguments.ALWAYS_HONOURED_FLAGS))
    unread = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if any(o in registered for o in action.option_strings):
            continue
        if action.dest.startswith("sglang_") and action.dest not in sglang_passthrough.SLIME_OWN_SGLANG_DESTS:
            continue  # forwarded to SGLang's ServerArgs by sglang_passthrough.resolve_server_args
        if not re.search(rf"\.{action.dest}\b|[\"']{action.dest}[\"']", code):
            unread.append(action.option_strings[0])
    assert unread == [], f"accepted but never read and not in a registry: {unread}"


# Warned "no effect" flags that a function is handed for upstream's signature and ignores (its docstring says so).
HANDED_BUT_IGNORED = {"--loss-mask-type"}


def test_a_flag_warned_as_without_effect_is_read_nowhere():
    """The converse of the flag rule: a flag that --help calls "no effect" must not be read by the code."""
    parser = build_parser()
    code = "\n".join(text for path, text in _code_files()
                     if not _declares_flags(path) and path.name != "upstream_notes.py")
    read = []
    for entry in arguments.NOT_IMPLEMENTED_FLAGS:
        if entry.is_active is not None or entry.applies is not None or entry.flag in HANDED_BUT_IGNORED:
            continue  # an entry with a predicate has a value (or company) that does take effect
        dest = parser._option_string_actions[entry.flag].dest
        if re.search(rf"\.{dest}\b|[\"']{dest}[\"']", code):
            read.append(entry.flag)
    assert read == [], f"registered as no effect but read by the code: {read}"


def test_registries_name_real_flags_and_do_not_overlap():
    options = set(build_parser()._option_string_actions)
    warned = {e.flag for e in arguments.NOT_IMPLEMENTED_FLAGS}
    refused = {e.flag for e in arguments.REFUSED_FLAGS}
    honoured = set(arguments.ALWAYS_HONOURED_FLAGS)
    assert (warned | refused | honoured) - options == set()
    assert warned & refused == set() and honoured & (warned | refused) == set()


def test_every_upstream_flag_is_accepted():
    upstream = [line.strip() for line in UPSTREAM_FLAGS.read_text().splitlines() if line.startswith("--")]
    assert len(upstream) > 200
    options = set(build_parser()._option_string_actions)
    assert [f for f in upstream if f not in options] == []


def _script_fixture(tmp_path: Path) -> list[str]:
    """Flag lists of upstream's scripts/run-qwen3-0.6B-single-gpu.sh and run-glm4-9B.sh (our own paths)."""
    for name in ("hf", "ref", "ckpt"):
        (tmp_path / name).mkdir()
    for name in ("train.parquet", "test.parquet"):
        (tmp_path / name).write_text("")
    return (
        f"--actor-num-nodes 1 --actor-num-gpus-per-node 1 --colocate --hf-checkpoint {tmp_path / 'hf'} "
        f"--ref-load {tmp_path / 'ref'} --load {tmp_path / 'ckpt'} --save {tmp_path / 'ckpt'} --save-interval 5 "
        f"--prompt-data {tmp_path / 'train.parquet'} --input-key messages --label-key label --apply-chat-template "
        "--rollout-shuffle --rm-type math --num-rollout 10 --rollout-batch-size 2 --n-samples-per-prompt 4 "
        "--global-batch-size 8 --rollout-max-response-len 512 --rollout-temperature 0.8 --rollout-top-p 0.95 "
        f"--eval-interval 10 --skip-eval-before-train --eval-prompt-data gsm8k {tmp_path / 'test.parquet'} "
        "--n-samples-per-eval-prompt 1 --eval-max-response-len 512 --eval-top-k 1 --advantage-estimator grpo "
        "--calculate-per-token-loss --use-kl-loss --kl-loss-coef 0.0 --kl-loss-type low_var_kl --eps-clip 0.2 "
        "--eps-clip-high 0.28 --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 "
        "--adam-beta1 0.9 --adam-beta2 0.98 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
        "--context-parallel-size 1 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1 "
        "--use-dynamic-batch-size --max-tokens-per-gpu 4096 --rollout-num-gpus-per-engine 1 "
        "--sglang-mem-fraction-static 0.45 --sglang-cuda-graph-max-bs 8 --sglang-enable-deterministic-inference "
        "--sglang-attention-backend fa3 --attention-dropout 0.0 --hidden-dropout 0.0 "
        "--accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 --attention-backend flash "
        "--use-wandb --wandb-project slime-dev --wandb-group qwen3-test --wandb-key k --balance-data "
        "--train-backend-device cpu"
    ).split()


def test_upstream_example_script_flags_parse(tmp_path):
    args = parse_quiet(_script_fixture(tmp_path))
    assert args.global_batch_size == 8 and args.eval_datasets[0].name == "gsm8k"
    assert args.sglang_server_args["enable_deterministic_inference"] is True
    assert args.not_implemented_flags == ("--attention-backend",)


# ---------------------------------------------------------------- refused at parse time


REFUSED_CASES = [
    (["--num-experts", "6", "--expert-model-parallel-size", "4", "--actor-num-gpus-per-node", "4"],
     "--expert-model-parallel-size 4 does not divide --num-experts 6; use a divisor of 6"),
    (["--expert-model-parallel-size", "2"], "is not divisible by --expert-model-parallel-size 2"),
    (["--num-experts", "4", "--moe-router-topk", "8"], "--moe-router-topk 8 is above --num-experts 4"),
    (["--optimizer", "sgd"], "only --optimizer adam is implemented"),
    (["--ckpt-format", "torch"], "dist_checkpointing (torch_dist) only"),
    (["--flush-cache-interval", "4"], "a longer interval is not implemented"),
    (["--loss-type", "custom_loss"], "--loss-type custom_loss needs --custom-loss-function-path"),
    (["--custom-tis-function-path", "slime.rollout.rm_hub.async_rm"], "add --use-tis (or --get-mismatch-metrics"),
    (["--mask-offpolicy-in-partial-rollout"], "add --partial-rollout"),
    (["--rm-type", "maht"], "--rm-type maht is not a built-in reward (did you mean math?)"),
    (["--save-hf", "/tmp/hf"], "--save-hf is written with each checkpoint: add --save DIR --save-interval N"),
    (["--ref-update-interval", "2"], "only --use-kl-loss or --kl-coef use"),
    (["--finetune"], "--finetune loads the weights of --load DIR"),
    (["--model-name", "gpt2"], "--model-name gpt2 is not supported"),
]


@pytest.mark.parametrize("extra, message", REFUSED_CASES, ids=[c[0][0] for c in REFUSED_CASES])
def test_unsupported_choices_are_refused_at_parse_time(extra, message, capsys):
    assert message in parse_error(MINIMAL + extra, capsys)


# ---------------------------------------------------------------- --help and unknown flags


def test_help_gives_every_flag_a_meaning_and_its_default_once():
    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        help_text = (action.help or "").strip().lower()
        assert len(help_text.split()) >= 2 and help_text not in TERSE_HELP, f"{action.option_strings}: {action.help!r}"
        shown = " ".join(parser._get_formatter()._format_action(action).split())
        if action.option_strings[0] in arguments.REQUIRED_FLAGS:
            assert "[required]" in shown and "default" not in shown.lower(), shown
        else:
            assert shown.lower().count("default") == 1, shown  # stated once: by the help text or appended
    flat = " ".join(text.split())
    assert "samples per optimizer step (default: a whole rollout, or set by --num-steps-per-rollout)" in flat
    assert "--tensor-model-parallel-size TENSOR_MODEL_PARALLEL_SIZE tensor-parallel (TP) ranks" in flat


def test_help_marks_refused_no_effect_and_required_flags_and_names_the_tools():
    parser = build_parser()
    flat = " ".join(parser.format_help().split())

    def line(flag):
        action = parser._option_string_actions[flag]
        return " ".join(parser._get_formatter()._format_action(action).split())

    for entry in arguments.REFUSED_FLAGS:
        assert "[refused" in line(entry.flag), entry.flag
    for entry in arguments.NOT_IMPLEMENTED_FLAGS:
        assert f"[no effect: {entry.reason}]" in line(entry.flag), entry.flag
    assert "[required]" in line("--hf-checkpoint") and "[required]" in line("--rollout-batch-size")
    assert "[required with the default data source and rollout function]" in line("--prompt-data")
    assert "[required: this or --num-epoch]" in line("--num-rollout")
    assert "[refused: some values]" in line("--optimizer")
    assert "[refused" not in line("--advantage-estimator") and "ppo" in line("--advantage-estimator")
    assert "[" not in line("--fence-timeout").split("--fence-timeout", 1)[1]  # an ordinary flag has no mark
    assert "python -m slime.distributed.hang_report" in flat and "python -m slime.distributed.order_proof" in flat


def test_help_says_each_registry_reason_once():
    parser = build_parser()

    def squeezed(text):  # argparse wraps lines at spaces and hyphens
        return "".join(text.split())

    reasons = [(e.flag, e.reason) for e in (*arguments.REFUSED_FLAGS, *arguments.NOT_IMPLEMENTED_FLAGS)]
    for flag, reason in [*reasons, *arguments.ALWAYS_HONOURED_FLAGS.items()]:
        shown = parser._get_formatter()._format_action(parser._option_string_actions[flag])
        assert squeezed(shown).count(squeezed(reason)) == 1, shown


def test_the_help_footer_names_groups_that_exist():
    parser = build_parser()
    groups = {group.title for group in parser._action_groups}
    named = re.findall(r'"([^"]+)"', " ".join(parser.epilog.split()))
    assert named and set(named) <= groups, (named, groups)


def test_unknown_flag_is_answered_with_the_closest_known_ones(capsys):
    err = parse_error(MINIMAL + ["--rollout-temprature", "0.7", "--tensor-parallel-size", "2"], capsys)
    assert "--rollout-temprature (did you mean --rollout-temperature" in err
    assert "--tensor-parallel-size (did you mean --tensor-model-parallel-size" in err
    assert "--zzz-unknown" in parse_error(MINIMAL + ["--zzz-unknown"], capsys)


# ---------------------------------------------------------------- derived values


def test_errors_about_derived_values_say_where_they_came_from(capsys):
    err = parse_error(["--rollout-batch-size", "3", "--n-samples-per-prompt", "1", "--num-rollout", "1",
                  "--actor-num-gpus-per-node", "2", "--train-backend-device", "cpu"], capsys)
    assert ("--global-batch-size 3 (not passed: one step per rollout = --rollout-batch-size 3 x "
            "--n-samples-per-prompt 1) is not divisible by the data-parallel size 2 (= actor world 2 / "
            "(--tensor-model-parallel-size 1 x --context-parallel-size 1 x --pipeline-model-parallel-size 1))") in err
    assert "rollout_batch_size" not in err and "data_parallel_size" not in err
    err = parse_error(MINIMAL + ["--n-samples-per-prompt", "3", "--num-steps-per-rollout", "4"], capsys)
    assert "the rollout's 6 samples (--rollout-batch-size 2 x --n-samples-per-prompt 3)" in err


def test_derived_values_are_recorded():
    args = parse_quiet(MINIMAL + ["--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2"])
    assert args.global_batch_size == 4
    assert args.derived_values["global_batch_size"] == \
        "--rollout-batch-size 2 x --n-samples-per-prompt 4 // --num-steps-per-rollout 2"
    assert args.derived_values["eps_clip_high"] == "--eps-clip 0.2"


# ---------------------------------------------------------------- --custom-config-path


def test_custom_config_overrides_flags_and_adds_plugin_attributes(tmp_path, capsys):
    config = tmp_path / "overrides.yaml"
    config.write_text("lr: 1e-5\n--n-samples-per-prompt: 4\nnum-steps-per-rollout: 2\nmy_plugin_temperature: 0.3\n"
                      "eval_prompt_data: null\n")
    args = parse_quiet(MINIMAL + ["--lr", "3e-4", "--custom-config-path", str(config)])
    assert args.lr == 1e-5 and isinstance(args.lr, float)  # YAML's '1e-5' string is converted by the flag's type
    assert args.n_samples_per_prompt == 4 and args.global_batch_size == 4  # validation saw the override
    assert args.my_plugin_temperature == 0.3
    assert args.custom_config_overrides["lr"] == 1e-5
    config.write_text("- not a mapping\n")
    assert "expected a mapping" in parse_error(MINIMAL + ["--custom-config-path", str(config)], capsys)
    config.write_text("rollout_batch_size: 0\n")  # overrides are validated like flags
    assert "--rollout-batch-size must be positive" in parse_error(MINIMAL + ["--custom-config-path", str(config)], capsys)
