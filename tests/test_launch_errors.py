"""What fails before Ray starts fails at parse time, with the fix; what fails after ends in one line.

A misspelled hook, a hook path without a module, a missing or incomplete --hf-checkpoint and
--colocate across nodes with an engine or a model replica larger than a node are refused before any process starts; any error of a started run ends
in its traceback and one `training stopped:` line; a run that ends cleanly removes the temp ledger
directory it made, a failed one keeps it.
"""
from __future__ import annotations

import json
import logging
import os

import pytest

import train
from arg_testing import no_real_sglang, parse_error, parse_quiet  # noqa: F401 (fixture)
from slime.config import defaults_namespace
from slime.ray.driver.trainer_group import resolve_ledger_dir
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


@pytest.mark.parametrize("path, says", [
    ("examples.search_r1.generate_with_search.generate",
     "examples.* is a package of upstream slime's tree, importable when upstream's root is on the import path (its "
     "launchers run python from there): run with PYTHONPATH=/path/to/upstream/slime"),
    ("slime_plugins.rollout_buffer.generator.run", "run with PYTHONPATH=/path/to/upstream/slime"),
    ("my_rewards_xyz.reward", "not in the directory train.py is run from: add the directory that holds it to "
                              "PYTHONPATH"),
    ("slime.rollout.rm_hub.no_such.reward", "this project's slime package, which replaces upstream's, has no such"),
])
def test_a_hook_module_off_the_import_path_says_where_python_looks(path, says, capsys):
    err = parse_error([*BASE, "--custom-rm-path", path], capsys)
    assert f"--custom-rm-path: cannot find the module of {path!r}" in err and says in err


@pytest.mark.parametrize("flags, says", [
    (["--rollout-num-gpus-per-engine", "8"], "an engine of --rollout-num-gpus-per-engine 8 GPUs spans 2 nodes. "
                                             "Colocated engines take their weights by CUDA IPC"),
    (["--actor-num-gpus-per-node", "6", "--rollout-num-gpus-per-engine", "4"], "does not fit within one node's 6"),
    (["--rollout-num-gpus", "4"], "--rollout-num-gpus 4 must be the trainer's 8 GPUs"),
    (["--tensor-model-parallel-size", "8"], "--tensor-model-parallel-size 8 must divide the node's 4 GPUs"),
])
def test_colocate_across_nodes_refuses_engines_or_tp_groups_that_leave_a_node(flags, says, capsys):
    base = [*BASE, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--colocate"]
    err = parse_error([*base, *flags], capsys)
    assert "--colocate over --actor-num-nodes 2 x --actor-num-gpus-per-node" in err and says in err


@pytest.mark.parametrize("layout", [
    ["--context-parallel-size", "2"],  # whole replicas on each node
    ["--pipeline-model-parallel-size", "2"],  # a PP stage per node: each node gets the other's over a group
    ["--context-parallel-size", "4"],  # a CP replica spanning both nodes: each node's TP group exports
])
def test_colocate_across_nodes_with_engines_and_tp_groups_within_a_node_parses(layout):
    args = parse_quiet([*BASE, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--colocate",
                       "--tensor-model-parallel-size", "2", *layout, "--rollout-num-gpus-per-engine", "4"])
    assert args.rollout_num_gpus == 8 and args.colocate and args.offload_train


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
    path = None if files is None else _hf_dir(tmp_path, files)
    with pytest.raises(ArgumentValidationError, match=says):
        check_launch_inputs(defaults_namespace(hf_checkpoint=path, prompt_data="prompts.jsonl"))
    if files is None:
        with pytest.raises(ArgumentValidationError, match="does not exist"):
            check_launch_inputs(defaults_namespace(hf_checkpoint=str(tmp_path / "missing"), prompt_data="prompts.jsonl"))


def test_train_py_without_a_checkpoint_exits_2_before_ray(capsys, monkeypatch):
    monkeypatch.setattr(train, "train", lambda args: pytest.fail("must not start"))
    assert train.main(BASE) == 2
    assert "--hf-checkpoint DIR is required" in capsys.readouterr().err


@pytest.fixture
def launchable(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input": "1 + 1"}) + "\n")
    return [*BASE, "--hf-checkpoint", _hf_dir(tmp_path, ["config.json", "tokenizer.json"]), "--prompt-data",
            str(prompts)]


def test_an_unexpected_error_after_start_ends_in_its_traceback_and_one_line(launchable, monkeypatch, caplog):
    made = {}

    def broken(args):
        made["dir"] = resolve_ledger_dir(args)
        raise KeyError("reward")

    monkeypatch.setattr(train, "train", broken)
    with caplog.at_level(logging.INFO):
        assert train.main(launchable) == 1
    stopped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training stopped:")]
    assert stopped == [f"training stopped: KeyError: 'reward' (ledger dir {made['dir']})"]
    assert any(r.exc_info and r.exc_info[0] is KeyError for r in caplog.records)
    assert os.path.isdir(made["dir"])  # kept for the post-mortem


def test_a_dead_ray_address_ends_in_one_line_without_a_traceback(launchable, monkeypatch, caplog):
    """A stale RAY_ADDRESS is the user's to fix: one 'training stopped' line that says how, no traceback."""
    from slime.ray.driver.cluster import cluster_address, require_reachable

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # nothing listens on port 1
    # what init_ray does first when it joins a cluster (this test process may hold a Ray connection already)
    monkeypatch.setattr(train, "train", lambda args: require_reachable(cluster_address()))
    with caplog.at_level(logging.INFO):
        assert train.main(launchable) == 1
    stopped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training stopped:")]
    assert len(stopped) == 1 and "no Ray cluster answers at 127.0.0.1:1" in stopped[0], stopped
    assert "ray start --head" in stopped[0]
    assert not any(r.exc_info for r in caplog.records)


def test_a_clean_run_removes_the_temp_ledger_dir_it_made(launchable, monkeypatch, tmp_path):
    made = {}

    def fine(args):
        made["dir"] = resolve_ledger_dir(args)

    monkeypatch.setattr(train, "train", fine)
    assert train.main(launchable) == 0
    assert not os.path.exists(made["dir"])
    own = tmp_path / "mine"
    own.mkdir()
    assert train.main([*launchable, "--ledger-dir", str(own)]) == 0
    assert own.is_dir()  # a directory the user named is never removed


def test_moe_at_tensor_parallel_without_sequence_parallel_is_refused_before_start(tmp_path):
    path = _hf_dir(tmp_path, ["config.json", "tokenizer.json"])
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"num_experts": 8}))
    args = dict(hf_checkpoint=path, prompt_data="prompts.jsonl", tensor_model_parallel_size=2, sequence_parallel=False)
    with pytest.raises(ArgumentValidationError, match="add it"):
        check_launch_inputs(defaults_namespace(**args))
    check_launch_inputs(defaults_namespace(**{**args, "sequence_parallel": True}))
    check_launch_inputs(defaults_namespace(**{**args, "tensor_model_parallel_size": 1}))
    expert_tp1 = {**args, "sequence_parallel": True, "expert_tensor_parallel_size": 1}
    with pytest.raises(ArgumentValidationError, match="experts' gradients would not be summed over the TP ranks"):
        check_launch_inputs(defaults_namespace(**expert_tp1))
    check_launch_inputs(defaults_namespace(**{**expert_tp1, "expert_model_parallel_size": 2}))


# ---------------------------------------------------------------- every missing flag in one error


def test_every_missing_required_flag_is_named_in_one_error(capsys):
    err = parse_error(["--train-backend-device", "cpu"], capsys)
    for named in ("--rollout-batch-size is required", "--num-rollout N (rollout steps) or --num-epoch N is required",
                  "--hf-checkpoint DIR is required", "--prompt-data FILE is required"):
        assert named in err, named
    assert err.count("error:") == 1


def test_a_launch_names_the_checkpoint_and_the_prompts_together(capsys, monkeypatch):
    monkeypatch.setattr(train, "train", lambda args: pytest.fail("must not start"))
    assert train.main(BASE) == 2
    err = capsys.readouterr().err
    assert "--hf-checkpoint DIR is required" in err and "--prompt-data FILE is required" in err


def test_prompts_are_not_required_where_the_rollout_reads_none():
    import types

    from slime.utils.arguments import launch_missing_flags

    args = types.SimpleNamespace(hf_checkpoint="/x", prompt_data=None, debug_train_only=False,
                                 data_source_path="my.source.Source",
                                 rollout_function_path="slime.rollout.sglang_rollout.generate_rollout")
    assert launch_missing_flags(args) == []


# ---------------------------------------------------------------- the checkpoint's config.json before Ray


def _checkpoint(tmp_path, **config) -> str:
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")
    return str(path)


QWEN3 = dict(model_type="qwen3", num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128)


@pytest.mark.parametrize("model_type", ["qwen9_hyper", "made_up_moe", "qwen9_hyper_moe", "qwen9"])
def test_a_model_type_no_family_builds_is_refused_naming_the_supported_ones(model_type, tmp_path, capsys):
    err = parse_error([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, **{**QWEN3, "model_type": model_type})], capsys)
    assert f"has model_type {model_type!r}, which no model family here builds" in err
    assert "supported: qwen3, qwen2, llama, qwen3_moe, qwen2_moe, deepseek_v3" in err


@pytest.mark.parametrize("flags, says", [
    (["--num-layers", "8"], "--num-layers 8 contradicts"),
    (["--hidden-size", "128"], "--hidden-size 128 contradicts"),
    (["--num-attention-heads", "8"], "--num-attention-heads 8 contradicts"),
    (["--group-query-attention", "--num-query-groups", "4"], "--num-query-groups 4 contradicts"),
    (["--tensor-model-parallel-size", "4", "--actor-num-gpus-per-node", "4"],
     "--tensor-model-parallel-size 4 does not divide the model's 2 key/value heads"),
    (["--tensor-model-parallel-size", "8", "--actor-num-gpus-per-node", "8"],
     "--tensor-model-parallel-size 8 does not divide the model's 4 attention heads"),
    (["--pipeline-model-parallel-size", "3", "--actor-num-gpus-per-node", "3"],
     "--num-layers 4 does not split over --pipeline-model-parallel-size 3"),
])
def test_architecture_flags_are_checked_against_the_config_before_ray(flags, says, tmp_path, capsys):
    err = parse_error([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, **QWEN3), *flags], capsys)
    assert says in err


HYBRID = dict(model_type="qwen3_5_text", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=128, layer_types=["linear_attention", "full_attention"],
              linear_num_key_heads=2, linear_num_value_heads=6)


@pytest.mark.parametrize("config, flags, says", [
    (dict(layer_types=["linear_attention", "sliding_attention"]), [],
     "layer_types has ['sliding_attention'], which no layer here builds; the supported kinds are"),
    (dict(layer_types=["linear_attention"]), [], "layer_types lists 1 layers, num_hidden_layers is 2"),
    (dict(linear_num_key_heads=3), ["--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
     "--tensor-model-parallel-size 2 does not divide the model's 3 linear-attention key heads"),
    (dict(num_key_value_heads=1), ["--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
     "--tensor-model-parallel-size 2 does not divide the model's 1 key/value heads"),
    # a composite (vision + text) checkpoint is checked by its text model
    (dict(model_type="qwen3_5", text_config={**HYBRID, "layer_types": ["mamba", "full_attention"]}), [],
     "layer_types has ['mamba']"),
])
def test_hybrid_layer_stacks_are_checked_before_ray(config, flags, says, tmp_path, capsys):
    err = parse_error([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, **{**HYBRID, **config}), *flags], capsys)
    assert says in err


GLM4_MOE = dict(QWEN3, model_type="glm4_moe", n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1)


@pytest.mark.parametrize("config, flags, says", [
    (GLM4_MOE, ["--expert-model-parallel-size", "3", "--actor-num-gpus-per-node", "3", "--rollout-batch-size", "3"],
     "--expert-model-parallel-size 3 does not divide the model's 8 experts (n_routed_experts"),
    (dict(GLM4_MOE, n_group=3), [], "set n_group to a divisor of 8 and topk_group to at most n_group"),
    (dict(GLM4_MOE, topk_group=4), [], "topk_group=4 with n_routed_experts=8: the experts must split"),
    (dict(QWEN3, model_type="minimax_m2", num_local_experts=6), ["--expert-model-parallel-size", "4",
                                                                  "--actor-num-gpus-per-node", "4",
                                                                  "--rollout-batch-size", "4"],
     "does not divide the model's 6 experts (num_local_experts"),
])
def test_experts_that_do_not_split_are_refused_before_ray(config, flags, says, tmp_path, capsys):
    err = parse_error([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, **config), *flags], capsys)
    assert says in err


def test_a_config_that_agrees_with_the_flags_passes(tmp_path):
    from arg_testing import parse_quiet

    args = parse_quiet([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, **QWEN3), "--num-layers", "4",
                        "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"])
    assert args.num_layers == 4


# ---------------------------------------------------------------- a hook module that fails at import


def test_a_hook_module_that_raises_at_import_is_one_line_naming_the_file(tmp_path, capsys):
    hook = tmp_path / "my_reward.py"
    hook.write_text("import os\nimport not_a_real_package_xyz\n\ndef reward(args, sample):\n    return 1.0\n")
    err = parse_error([*BASE, "--custom-rm-path", f"{hook}:reward"], capsys)
    assert f"--custom-rm-path: importing the module of '{hook}:reward' failed: {hook}:2: ModuleNotFoundError" in err
    assert "not_a_real_package_xyz" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_a_hook_module_with_a_syntax_error_names_its_line(tmp_path, capsys):
    hook = tmp_path / "broken_hook.py"
    hook.write_text("def reward(args, sample):\n    return (\n")
    err = parse_error([*BASE, "--custom-rm-path", f"{hook}:reward"], capsys)
    assert f"{hook}:2: SyntaxError" in err and "Traceback" not in err


def test_a_hook_package_whose_init_fails_is_named_not_called_missing(tmp_path, monkeypatch, capsys):
    package = tmp_path / "brokenpkg_xyz"
    package.mkdir()
    (package / "__init__.py").write_text("import another_missing_dependency_xyz\n")
    (package / "rewards.py").write_text("def reward(args, sample):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = parse_error([*BASE, "--custom-rm-path", "brokenpkg_xyz.rewards.reward"], capsys)
    assert "importing the module of 'brokenpkg_xyz.rewards.reward' failed" in err
    assert f"{package / '__init__.py'}:1: ModuleNotFoundError" in err and "another_missing_dependency_xyz" in err
    assert "cannot find the module" not in err and "Traceback" not in err


def _actor_died(never_started: bool):
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    return ActorDiedError(ActorDiedErrorContext(class_name="RolloutManager", actor_id=b"\0" * 16,
                                                never_started=never_started, error_message="references removed"))


@pytest.mark.parametrize("deaths, started", [((True,), 2), ((True, True), 3), ((False,), 1), ((True, False), 2),
                                             ((True, True, True), 3)])
def test_an_actor_ray_cancelled_before_it_ran_is_started_again(deaths, started, caplog):
    from slime.ray.driver.cluster import retry_if_cancelled_before_start

    calls = []

    def start():
        calls.append(1)
        if len(calls) <= len(deaths):
            raise _actor_died(deaths[len(calls) - 1])
        return "handle"

    pauses = (0.0, 0.0)  # the product pauses 2 s, then 5 s
    if all(deaths) and len(deaths) <= len(pauses):
        assert retry_if_cancelled_before_start(start, "the rollout manager", pauses) == "handle"
        assert caplog.text.count("cancelled the rollout manager before it started") == len(deaths)
    else:  # a death after its constructor ran, or a cancellation of the last start, is the run's error
        with pytest.raises(Exception, match="RolloutManager"):
            retry_if_cancelled_before_start(start, "the rollout manager", pauses)
    assert len(calls) == started


# ---------------------------------------------------------------- what --load and --num-rollout ask for, before Ray


@pytest.mark.parametrize("count", ["0", "-1"])
def test_a_run_of_no_rollouts_is_refused_before_ray(count, capsys):
    err = parse_error([*BASE[:2], "--num-rollout", count, *BASE[4:]], capsys)
    assert f"--num-rollout {count} runs no rollout" in err and "pass a positive count" in err


def _saved(root, iteration=None, tracker=None, dirs=()):
    root.mkdir(parents=True, exist_ok=True)
    for name in dirs:
        (root / name).mkdir()
    if tracker is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    return str(root)


@pytest.mark.parametrize("layout, says", [
    (None, "does not exist: a run resumes only from a checkpoint. To start fresh, drop --load"),
    (dict(), "holds no checkpoint (no latest_checkpointed_iteration.txt)"),
    (dict(dirs=["iter_0000004"]), "holds iter_0000004 but no latest_checkpointed_iteration.txt"),
    (dict(tracker="4"), "names iteration 4, but iter_0000004 is missing"),
    (dict(tracker="", dirs=["iter_0000004"]), "latest_checkpointed_iteration.txt holds ''"),
])
def test_a_load_without_a_checkpoint_is_refused_before_ray(layout, says, tmp_path, capsys):
    path = tmp_path / "run" if layout is None else _saved(tmp_path / "run", **layout)
    err = parse_error([*BASE, "--load", str(path), "--save", str(tmp_path / "elsewhere")], capsys)
    assert f"--load {tmp_path / 'run'}" in err and says in err


def test_a_load_holding_hf_weights_names_hf_checkpoint(tmp_path, capsys):
    hf = _hf_dir(tmp_path, ["config.json", "tokenizer.json"])
    err = parse_error([*BASE, "--load", hf], capsys)
    assert f"--load {hf} is a Hugging Face checkpoint" in err and f"pass --hf-checkpoint {hf}" in err


def test_a_jobs_first_run_with_load_and_save_one_directory_starts_fresh(tmp_path, caplog):
    """Upstream's launchers pass --load and --save the same directory: the first run finds nothing there yet."""
    for run in (tmp_path / "new", _saved(tmp_path / "empty")):
        with caplog.at_level(logging.INFO, logger="slime.config.checks.checkpoints"):
            args = parse_quiet([*BASE, "--load", str(run), "--save", f"{run}/"])
        assert args.load == str(run) and "holds no checkpoint yet: this run starts from --hf-checkpoint" in caplog.text
    resumed = _saved(tmp_path / "resumed", tracker="2", dirs=["iter_0000002"])
    assert parse_quiet([*BASE, "--load", resumed]).load == resumed
    with pytest.raises(SystemExit):
        parse_quiet([*BASE, "--load", str(tmp_path / "new"), "--save", str(tmp_path / "new"), "--finetune"])


# ---------------------------------------------------------------- upstream's model flags checked against the config


LLAMA3 = dict(QWEN3, model_type="llama", rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=8192))


@pytest.mark.parametrize("config", [LLAMA3, dict(QWEN3, model_type="llama", rope_parameters=dict(
    type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192,
    rope_theta=500000.0))], ids=["rope_scaling", "rope_parameters"])
def test_use_rope_scaling_is_accepted_on_a_llama3_rope_config(config, tmp_path):
    args = parse_quiet([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, **config), "--use-rope-scaling",
                        "--rotary-scaling-factor", "8.0"])
    assert args.use_rope_scaling


@pytest.mark.parametrize("config, flags, says", [
    (dict(QWEN3, model_type="llama"), [], "asks for Llama-3 RoPE scaling, but"),
    (dict(QWEN3, model_type="llama", rope_scaling=dict(rope_type="yarn", factor=4.0)), [], "has rope type 'yarn'"),
    (LLAMA3, ["--rotary-scaling-factor", "4"], "--rotary-scaling-factor 4 contradicts"),
])
def test_use_rope_scaling_is_refused_where_the_config_has_no_llama3_rope(config, flags, says, tmp_path, capsys):
    err = parse_error([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, **config), "--use-rope-scaling", *flags],
                      capsys)
    assert says in err


def test_freeze_indexer_asks_for_what_the_builder_does_and_is_refused_where_it_cannot(tmp_path, capsys):
    err = parse_error([*BASE, "--hf-checkpoint", _checkpoint(tmp_path, **QWEN3), "--freeze-indexer"], capsys)
    assert "--freeze-indexer: " in err and "has no DeepSeek sparse attention indexer (index_topk) to freeze" in err
    dsa = {"index_topk": 8}
    from slime.config.checks.linear_attention import check_frozen_indexer

    frozen = defaults_namespace(freeze_indexer=True)
    check_frozen_indexer(frozen, dsa, "config.json")  # GLM-5's indexer is frozen unless its loss trains it
    with pytest.raises(ArgumentValidationError, match="--freeze-indexer contradicts --dsa-indexer-loss-coeff 0.1"):
        check_frozen_indexer(defaults_namespace(freeze_indexer=True, dsa_indexer_loss_coeff=0.1), dsa, "config.json")


@pytest.mark.parametrize("flags, says", [
    (["--keep-checkpoint-num", "0", "--save", "/tmp/s"], "--keep-checkpoint-num 0 would delete every checkpoint"),
    (["--keep-checkpoint-num", "2"], "--keep-checkpoint-num prunes the checkpoints under --save: add --save DIR"),
])
def test_keep_checkpoint_num_needs_a_save_dir_and_one_checkpoint_at_least(flags, says, capsys):
    assert says in parse_error([*BASE, *flags], capsys)


def test_keep_checkpoint_num_protects_every_roles_checkpoints(tmp_path):
    args = parse_quiet([*BASE, "--keep-checkpoint-num", "2", "--save", str(tmp_path / "s"), "--advantage-estimator",
                        "ppo", "--critic-load", str(tmp_path)])
    assert args.checkpoint_roots == (str(tmp_path / "s"), str(tmp_path / "s" / "critic"))
