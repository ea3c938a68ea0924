"""The argument parser: upstream flag names and defaults, validation messages, SGLang passthrough, warnings."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from arg_testing import no_real_sglang, parse_error, parse_quiet  # noqa: F401 (fixture)
from slime.config import ParallelLayout, registries
from slime.config.run_config import RunRoles
from slime.utils import arguments, sglang_passthrough
from slime.utils.arguments import (
    EvalDatasetSpec,
    NotImplementedFlag,
    NotImplementedFlagWarning,
    build_parser,
    parse_args,
)
from slime.utils.deadlines import DeadlineModel

REPO_ROOT = Path(__file__).resolve().parents[1]
FLAGS_REFERENCE = Path(__file__).with_name("flags_reference.txt")

ISSUE_FLAGS = (
    "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 "
    "--context-parallel-size 4 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1 "
    "--rollout-batch-size 16 --n-samples-per-prompt 64 --rollout-max-response-len 40000 "
    "--num-steps-per-rollout 1 --colocate --use-dynamic-batch-size --max-tokens-per-gpu 32768 "
    "--calculate-per-token-loss --use-slime-router --rollout-num-gpus-per-engine 1 "
    "--sglang-mem-fraction-static 0.7"
).split()

# The smallest command line that passes validation: the rest of each test adds what it checks.
MINIMAL = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
           "--train-backend-device", "cpu"]


def test_issue_configuration_parses_with_upstream_meaning():
    args = parse_quiet(ISSUE_FLAGS + ["--num-rollout", "3", "--train-backend-device", "cpu"])
    assert (args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size) == (2, 4, 1)
    assert args.sequence_parallel and args.colocate and args.use_dynamic_batch_size and args.calculate_per_token_loss
    assert args.use_slime_router
    assert args.global_batch_size == 16 * 64 and args.num_steps_per_rollout == 1
    assert args.rollout_num_gpus == 8  # colocate: the actor's 8 GPUs
    assert args.data_parallel_size == 1 and args.world_size == 8
    assert args.offload_train and args.offload_rollout
    assert args.log_probs_max_tokens_per_gpu == 32768
    assert args.sglang_server_args == {"mem_fraction_static": 0.7}
    assert args.sglang_mem_fraction_static == 0.7
    assert args.not_implemented_flags == ()


def test_the_run_config_is_built_once_from_the_checked_flags():
    args = parse_quiet(ISSUE_FLAGS + ["--num-rollout", "3", "--train-backend-device", "cpu", "--fence-timeout", "30"])
    run = args.run_config
    assert run.layout == ParallelLayout(tp=2, pp=1, cp=4, ep=1, etp=1, world_size=8, sequence_parallel=True)
    assert run.layout.dp == args.data_parallel_size == 1
    # the group timeout parse_args derived (--distributed-timeout-minutes 2), above the first set-up's window
    assert run.deadlines == DeadlineModel(no_progress_s=30.0, group_timeout_s=120.0)
    assert run.roles == RunRoles(trainer_ranks=8, critic_ranks=0, critic_own_bundles=False, engines=8,
                                 gpus_per_engine=1, colocate=True)
    assert (run.rollout.prompts, run.rollout.samples_per_prompt, run.rollout.samples) == (16, 64, 1024)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.roles.engines = 1
    rollout_only = parse_quiet(MINIMAL + ["--debug-rollout-only", "--rollout-num-gpus", "2"]).run_config.roles
    assert (rollout_only.trainer_ranks, rollout_only.engines, rollout_only.colocate) == (0, 2, False)


def test_defaults_follow_upstream():
    args = parse_quiet(MINIMAL)
    expected = {
        "eps_clip": 0.2, "eps_clip_high": 0.2, "kl_loss_coef": 0.0, "kl_loss_type": "k1", "use_kl_loss": False,
        "entropy_coef": 0.0, "advantage_estimator": "grpo", "rollout_temperature": 1.0, "input_key": "input",
        "label_key": None, "n_samples_per_prompt": 1, "seed": 1234, "lr": 1e-6, "micro_batch_size": 1,
        "clip_grad": 1.0, "rollout_function_path": "slime.rollout.sglang_rollout.generate_rollout",
        "fence_timeout": 180.0, "rollout_backend": "auto", "recreate_process_groups_on_wake": False,
        "metrics_jsonl": None, "add_bias_linear": True, "normalization": "RMSNorm", "position_embedding_type": "rope", "rotary_base": None,
        "attention_backend": "auto", "optimizer": "adam", "lr_decay_style": "linear", "weight_decay": 0.01,
        "adam_beta1": 0.9, "adam_beta2": 0.999, "colocate": False, "offload_train": False,
        "rollout_num_gpus_per_engine": 1, "sglang_server_args": {}, "global_batch_size": 2,
        "expert_tensor_parallel_size": 1, "grpo_std_normalization": False,  # n_samples_per_prompt == 1
    }
    assert {k: getattr(args, k) for k in expected} == expected


def _touch(path: Path, text: str = "") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def _dense_grpo_command(tmp_path: Path) -> list[str]:
    hf = tmp_path / "Qwen3-4B"
    hf.mkdir()
    ref = tmp_path / "ref"
    ref.mkdir()
    prompts = _touch(tmp_path / "prompts.jsonl", '{"prompt": "1+1?", "label": "2"}\n')
    aime = _touch(tmp_path / "aime.jsonl", '{"prompt": "x", "label": "1"}\n')
    _touch(tmp_path / "hooks" / "my_hooks.py", "def rm(args, sample): return 1.0\n"
           "def gen(args, sample, params): return sample\ndef rollout(*a, **k): return []\n")
    return (
        "--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
        "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128 "
        "--qk-layernorm --untie-embeddings-and-output-weights --add-qkv-bias --position-embedding-type rope "
        "--max-position-embeddings 40960 --rotary-percent 1.0 "
        f"--hf-checkpoint {hf} --ref-load {ref} --load {tmp_path / 'ckpt'} --save {tmp_path / 'ckpt'} "
        "--save-interval 20 "
        f"--prompt-data {prompts} --input-key prompt --label-key label --apply-chat-template --rollout-shuffle "
        "--rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8 "
        "--rollout-max-response-len 8192 --rollout-temperature 0.8 --global-batch-size 256 --balance-data "
        "--custom-rm-path my_hooks.rm --custom-generate-function-path my_hooks.gen "
        "--rollout-function-path my_hooks.rollout "
        f"--eval-interval 20 --eval-prompt-data aime {aime} --n-samples-per-eval-prompt 16 "
        "--eval-max-response-len 16384 --eval-top-p 0.7 "
        "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 "
        "--context-parallel-size 2 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1 "
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --micro-batch-size 1 "
        "--use-dynamic-batch-size --max-tokens-per-gpu 9216 "
        "--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl "
        "--entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28 --calculate-per-token-loss --use-tis "
        "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 "
        "--adam-beta2 0.98 --use-precision-aware-optimizer --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d "
        "--rollout-num-gpus-per-engine 2 --rollout-num-gpus 8 --sglang-mem-fraction-static 0.7 "
        "--sglang-cuda-graph-bs 1 2 4 8 --sglang-log-level warning "
        "--actor-num-nodes 1 --actor-num-gpus-per-node 8 "
        "--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 "
        "--attention-softmax-in-fp32 --attention-backend flash --use-wandb --wandb-project slime "
        "--wandb-group qwen3-4b --wandb-key k --seed 42 "
        f"--save-debug-rollout-data {tmp_path / 'dbg'}/{{rollout_id}}.pt "
        "--train-backend-device cpu"
    ).split()


def test_full_dense_grpo_command_line_parses(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "hooks"))
    args = parse_quiet(_dense_grpo_command(tmp_path))
    assert args.position_embedding_type == "rope" and args.add_bias_linear is False
    assert args.normalization == "RMSNorm" and args.num_query_groups == 8 and args.kv_channels == 128
    assert args.global_batch_size == 256 and args.num_steps_per_rollout == 1
    assert args.data_parallel_size == 2 and args.eps_clip_high == 0.28 and args.kl_loss_type == "low_var_kl"
    assert args.eval_datasets == (EvalDatasetSpec("aime", str(tmp_path / "aime.jsonl")),)
    assert args.sglang_server_args == {"cuda_graph_bs": [1, 2, 4, 8], "log_level": "warning",
                                       "mem_fraction_static": 0.7}
    assert args.recompute_granularity == "full" and args.seed == 42
    assert set(args.not_implemented_flags) == {"--attention-backend"}
    assert args.optimizer_cpu_offload and args.use_precision_aware_optimizer and args.use_distributed_optimizer


def test_every_reference_flag_is_a_parser_option():
    flags = [line.strip() for line in FLAGS_REFERENCE.read_text().splitlines() if line.startswith("--")]
    assert len(flags) > 90
    options = set(build_parser()._option_string_actions)
    assert [f for f in flags if f not in options] == []


@pytest.mark.timeout(120)
def test_help_lists_every_reference_flag():
    proc = subprocess.run([sys.executable, "-m", "slime.utils.arguments", "--help"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    flags = [line.strip() for line in FLAGS_REFERENCE.read_text().splitlines() if line.startswith("--")]
    for group in ("cluster", "rollout", "megatron parallel", "fencing (this project)", "sglang", "debug"):
        assert f"\n{group}:" in proc.stdout
    assert [f for f in flags if f not in proc.stdout.split()] == []


@pytest.mark.timeout(120)
def test_unknown_flag_exits_nonzero_naming_it():
    proc = subprocess.run([sys.executable, "-m", "slime.utils.arguments", *MINIMAL, "--not-a-real-flag", "3"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2
    assert "--not-a-real-flag" in proc.stderr


def test_flag_prefix_is_not_silently_expanded(capsys):
    err = parse_error(MINIMAL + ["--rollout-temp", "0.5"], capsys)
    assert "--rollout-temp" in err


VALIDATION_CASES = [
    (["--actor-num-gpus-per-node", "6", "--tensor-model-parallel-size", "4"], "not divisible by TP*CP*PP"),
    (["--use-dynamic-batch-size"], "--use-dynamic-batch-size needs --max-tokens-per-gpu"),
    (["--n-samples-per-prompt", "3", "--global-batch-size", "4"], "not a multiple of --global-batch-size 4"),
    (["--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2", "--global-batch-size", "8"], "contradicts"),
    (["--n-samples-per-prompt", "3", "--num-steps-per-rollout", "4"], "--num-steps-per-rollout 4"),
    (["--actor-num-gpus-per-node", "4"], "data-parallel size 4"),
    (["--actor-num-gpus-per-node", "2", "--context-parallel-size", "2", "--seq-length", "10"], "multiple of 2*CP = 4"),
    (["--prompt-data", "/nonexistent/prompts.jsonl"], "--prompt-data: file '/nonexistent/prompts.jsonl'"),
    (["--hf-checkpoint", "/nonexistent/model"], "--hf-checkpoint: directory '/nonexistent/model'"),
    (["--load-debug-rollout-data", "/nonexistent/r.pt"], "--load-debug-rollout-data: file '/nonexistent/r.pt'"),
    (["--load-debug-rollout-data", "/nonexistent/d/{rollout_id}.pt"], "--load-debug-rollout-data: directory"),
    (["--custom-rm-path", "no_such_pkg_xyz.rm"], "--custom-rm-path: cannot find the module of 'no_such_pkg_xyz.rm'"),
    (["--eval-prompt-data", "a", "x.jsonl", "b"], "NAME PATH pairs"),
    (["--eval-interval", "5"], "--eval-interval needs --eval-prompt-data"),
    (["--kl-loss-type", "k4"], "invalid choice: 'k4'"),
    (["--advantage-estimator", "dpo"], "invalid choice: 'dpo'"),
    (["--debug-train-only"], "--load-debug-rollout-data"),
    (["--debug-train-only", "--debug-rollout-only"], "cannot both be set"),
    (["--bf16", "--fp16"], "--fp16 is not supported"),
    (["--save-interval", "5"], "--save-interval needs --save"),
    (["--advantage-estimator", "reinforce_plus_plus"], "requires --normalize-advantages"),
    (["--advantage-estimator", "cispo", "--eps-clip-c", "3"], "CISPO does not use; drop it"),
    (["--kl-coef", "0.1", "--kl-loss-coef", "0.1"], "cannot both be non-zero"),
    (["--fence-timeout", "0"], "--fence-timeout must be positive"),
    (["--rollout-temperature", "0"], "--rollout-temperature must be > 0"),
    (["--num-attention-heads", "6", "--group-query-attention", "--num-query-groups", "4"], "--num-query-groups 4"),
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "--rollout-num-gpus 3"),
]


@pytest.mark.parametrize("extra, message", VALIDATION_CASES, ids=[m for _, m in VALIDATION_CASES])
def test_validation_error_names_what_to_fix(extra, message, capsys):
    err = parse_error(MINIMAL + extra, capsys)
    assert message in err


def test_missing_num_rollout_is_an_error(capsys):
    err = parse_error(["--rollout-batch-size", "2", "--actor-num-gpus-per-node", "1"], capsys)
    assert "--num-rollout" in err


def test_validate_args_raises_typed_errors(tmp_path):
    parser = build_parser()
    args = parser.parse_args(MINIMAL + ["--prompt-data", str(tmp_path / "missing.jsonl")])
    args.sglang_server_args = {}
    with pytest.raises(FileNotFoundError, match="--prompt-data"):
        arguments.validate_args(args, parser)


def test_sequence_parallel_with_tp1_warns_and_is_disabled():
    with pytest.warns(UserWarning, match="--sequence-parallel has no effect"):
        args = parse_args(MINIMAL + ["--sequence-parallel"])
    assert args.sequence_parallel is False


def test_colocate_keeps_an_explicit_rollout_gpu_count():
    args = parse_quiet(MINIMAL + ["--colocate", "--rollout-num-gpus", "4"])
    assert args.rollout_num_gpus == 4 and args.offload_rollout


def test_load_debug_rollout_data_implies_train_only(tmp_path):
    data = _touch(tmp_path / "rollout_0.pt")
    args = parse_quiet(MINIMAL + ["--load-debug-rollout-data", data])
    assert args.debug_train_only and args.skip_engines


def test_eval_prompt_data_pairs_and_legacy_single_path(tmp_path):
    a, b = _touch(tmp_path / "a.jsonl"), _touch(tmp_path / "b.jsonl")
    args = parse_quiet(MINIMAL + ["--eval-prompt-data", "A", a, "B", b])
    assert args.eval_datasets == (EvalDatasetSpec("A", a), EvalDatasetSpec("B", b))
    args = parse_quiet(MINIMAL + ["--eval-prompt-data", a])
    assert args.eval_datasets == (EvalDatasetSpec("aime", a),)


def test_function_path_in_file_form_is_found(tmp_path):
    hook = _touch(tmp_path / "hook.py", "def rm(args, sample): return 0.0\n")
    args = parse_quiet(MINIMAL + ["--custom-rm-path", f"{hook}:rm"])
    assert args.custom_rm_path == f"{hook}:rm"


# ---------------------------------------------------------------- SGLang passthrough


def test_sglang_passthrough_without_sglang_types_values_by_shape():
    args = parse_quiet(MINIMAL + ["--sglang-chunked-prefill-size", "4096", "--sglang-enable-metrics",
                                   "--sglang-schedule-conservativeness=0.5", "--sglang-attention-backend", "triton",
                                   "--sglang-cuda-graph-max-bs", "-1", "--sglang-disable-radix-cache", "false",
                                   "--rollout-temperature", "0.9"])
    assert args.sglang_server_args == {
        "attention_backend": "triton", "chunked_prefill_size": 4096, "cuda_graph_max_bs": -1,
        "disable_radix_cache": False, "enable_metrics": True, "schedule_conservativeness": 0.5,
    }
    assert args.rollout_temperature == 0.9  # the flag after a passthrough switch is still parsed by us
    assert args.sglang_chunked_prefill_size == 4096


def _fake_server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None)
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--log-level", type=str, default="info")
    for action in parser._actions:
        action.required = False
    return parser


def test_sglang_passthrough_with_server_args_types_and_validates(monkeypatch, capsys):
    monkeypatch.setattr(sglang_passthrough, "server_args_parser", _fake_server_parser)
    args = parse_quiet(MINIMAL + ["--sglang-enable-metrics", "--sglang-log-level", "debug",
                                   "--sglang-mem-fraction-static", "0.5", "--sglang-cuda-graph-bs", "1", "2"])
    assert args.sglang_server_args == {"cuda_graph_bs": [1, 2], "enable_metrics": True, "log_level": "debug",
                                       "mem_fraction_static": 0.5}
    err = parse_error(MINIMAL + ["--sglang-not-a-server-arg", "1"], capsys)
    assert "--sglang-not-a-server-arg" in err
    err = parse_error(MINIMAL + ["--sglang-log-level"], capsys)
    assert "--sglang-log-level" in err  # missing value is reported with the user's spelling


def test_sglang_fields_owned_by_slime_are_refused(capsys):
    err = parse_error(MINIMAL + ["--sglang-tp-size", "2"], capsys)
    assert "--sglang-tp-size" in err and "--rollout-num-gpus-per-engine" in err


def test_sglang_passthrough_matches_the_installed_sglang(monkeypatch, capsys):
    """With the real loader: unknown names fail when sglang imports here, and pass through when it does not."""
    monkeypatch.undo()
    sglang_passthrough.server_args_parser.cache_clear()
    real = sglang_passthrough.server_args_parser()
    argv = MINIMAL + ["--sglang-definitely-not-an-sglang-arg", "1"]
    assert "--sglang-definitely-not-an-sglang-arg" in parse_error(argv, capsys)  # with or without sglang
    if real is None:
        assert parse_quiet(MINIMAL + ["--sglang-log-level", "warning"]).sglang_server_args == {"log_level": "warning"}


def test_a_mistyped_sglang_flag_is_refused_with_the_closest_names_without_sglang(capsys):
    err = parse_error(MINIMAL + ["--sglang-mem-fracton-static", "0.7", "--sglang-disable-radix-cach"], capsys)
    assert "--sglang-mem-fracton-static: SGLang has no server argument --mem-fracton-static" in err
    assert "did you mean --sglang-mem-fraction-static" in err
    assert "did you mean --sglang-disable-radix-cache" in err
    assert "checked against SGLang" in err


def test_the_sglang_option_list_names_the_supported_releases():
    from sglang_files import supported_versions
    from slime.utils.sglang_server_options import SERVER_OPTIONS, VERSIONS

    assert VERSIONS == supported_versions()  # regenerate: python tests/sglang_files.py --write-server-options
    assert "--mem-fraction-static" in SERVER_OPTIONS and "--model-path" in SERVER_OPTIONS


# ---------------------------------------------------------------- accepted-but-unimplemented flags


def test_not_implemented_flag_warns_once_naming_it():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = parse_args(MINIMAL + ["--use-rollout-entropy", "--attention-backend", "local"])
    ours = [w for w in caught if issubclass(w.category, NotImplementedFlagWarning)]
    assert len(ours) == 1 and "--use-rollout-entropy" in str(ours[0].message)
    assert args.not_implemented_flags == ("--use-rollout-entropy",)


def test_not_implemented_registry_respects_device(monkeypatch):
    cuda_only = NotImplementedFlag(flag="--use-distributed-optimizer", reason="test", devices=frozenset({"cuda"}))
    monkeypatch.setattr(registries, "NOT_IMPLEMENTED_FLAGS", (cuda_only,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu_args = parse_args(MINIMAL + ["--use-distributed-optimizer"])
        cuda_args = parse_args([*MINIMAL[:-1], "cuda", "--use-distributed-optimizer"])
    assert cpu_args.not_implemented_flags == ()
    assert cuda_args.not_implemented_flags == ("--use-distributed-optimizer",)
    assert sum(issubclass(w.category, NotImplementedFlagWarning) for w in caught) == 1


def test_registry_entries_name_real_flags():
    parser = build_parser()
    assert [e.flag for e in arguments.NOT_IMPLEMENTED_FLAGS if e.flag not in parser._option_string_actions] == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = parse_args(MINIMAL)
    assert args.not_implemented_flags == () and caught == []  # defaults never warn
    args = parse_quiet(MINIMAL + ["--disable-wandb-random-suffix", "--tb-project-name", "/tmp/tb"])
    assert args.not_implemented_flags == ("--disable-wandb-random-suffix",)
    assert args.tensorboard_dir == "/tmp/tb"


def test_custom_arguments_hook_adds_flags():
    def add_custom(parser):
        parser.add_argument("--my-extra", type=int, default=7)
        return parser

    args = arguments.parse_args(MINIMAL + ["--my-extra", "9"], add_custom_arguments=add_custom)
    assert args.my_extra == 9


# ---------------------------------------------------------------- flags that describe the model


@pytest.mark.parametrize("argv, says", [
    (["--normalization", "LayerNorm"], "--normalization LayerNorm: the model builder builds RMSNorm layers only"),
    (["--position-embedding-type", "learned_absolute"], "--position-embedding-type learned_absolute: the model "
                                                        "builder builds rotary position embeddings"),
    (["--position-embedding-type", "none", "--use-rotary-position-embeddings"],
     "--use-rotary-position-embeddings contradicts --position-embedding-type none"),
])
def test_an_architecture_kind_the_builder_does_not_build_is_refused(argv, says, capsys):
    assert says in parse_error(MINIMAL + argv, capsys)


def test_architecture_kinds_left_out_say_what_the_builder_builds():
    args = parse_quiet(MINIMAL)
    assert (args.normalization, args.position_embedding_type) == ("RMSNorm", "rope")
    args = parse_quiet(MINIMAL + ["--normalization", "RMSNorm", "--use-rotary-position-embeddings"])
    assert (args.normalization, args.position_embedding_type) == ("RMSNorm", "rope")
