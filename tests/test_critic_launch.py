"""The critic's flags and checkpoint, checked before Ray starts (--advantage-estimator ppo): the critic starts from
--hf-checkpoint unless a critic flag or a saved critic says otherwise, a critic checkpoint of another architecture than the actor's is refused naming what differs,
and critic flags without ppo, a critic GPU count below one or a KL reward term are refused (the critic's own layout:
test_megatron_config.py)."""
from __future__ import annotations

import json

import pytest

from arg_testing import parse_error, parse_quiet
from slime.config.critic_role import critic_args, critic_resume_dir, critic_save_dir
from slime.utils.arguments import ArgumentValidationError, check_launch_inputs

BASE = ["--rollout-batch-size", "2", "--num-rollout", "3", "--actor-num-gpus-per-node", "1",
        "--train-backend-device", "cpu"]
QWEN3 = dict(model_type="qwen3", num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=32)


def _checkpoint(path, **config) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")
    return str(path)


def _ppo(tmp_path, *flags):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "prompts.jsonl").write_text('{"input": "1"}\n')
    return [*BASE, "--hf-checkpoint", _checkpoint(tmp_path / "actor", **QWEN3), "--advantage-estimator", "ppo",
            "--prompt-data", str(tmp_path / "prompts.jsonl"), *flags]


def test_ppo_without_a_critic_flag_starts_the_critic_from_the_hf_checkpoint(tmp_path):
    """Upstream's critic inherits the run's checkpoint flags: with only --hf-checkpoint it starts from it."""
    args = parse_quiet(_ppo(tmp_path))
    check_launch_inputs(args)
    assert args.critic_load == args.hf_checkpoint == critic_args(args).critic_load
    assert "critic starts from the run's checkpoint" in args.derived_values["critic_load"]
    assert critic_args(args).load is None  # loaded from HF, not resumed
    argv = [*_ppo(tmp_path / "first"), "--load", str(tmp_path / "run"), "--save", str(tmp_path / "run")]
    first = parse_quiet(argv)
    assert first.critic_load == first.hf_checkpoint  # a job's first run: nothing saved yet


def test_a_load_with_the_actors_checkpoint_but_no_critic_names_critic_load(tmp_path, capsys):
    (tmp_path / "run" / "iter_0000003").mkdir(parents=True)
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("3")
    err = parse_error(_ppo(tmp_path, "--load", str(tmp_path / "run")), capsys)
    assert "holds the actor's checkpoint but no critic checkpoint (critic/)" in err and "pass --critic-load" in err


@pytest.mark.parametrize("change, says", [
    (dict(hidden_size=128), "hidden_size 128 (actor 64)"),
    (dict(num_hidden_layers=2), "num_hidden_layers 2 (actor 4)"),
    (dict(num_attention_heads=8, num_key_value_heads=4), "num_attention_heads 8 (actor 4), num_key_value_heads 4"),
    (dict(vocab_size=48), "vocab_size 48 (actor 32)"),
])
def test_a_critic_of_another_architecture_is_refused_before_ray(change, says, tmp_path):
    critic = _checkpoint(tmp_path / "critic", **{**QWEN3, **change})
    args = parse_quiet(_ppo(tmp_path, "--critic-load", critic))
    with pytest.raises(ArgumentValidationError, match="--critic-load .* differs from --hf-checkpoint's") as info:
        check_launch_inputs(args)
    assert says in str(info.value)


def test_a_critic_of_the_actors_architecture_passes_and_gets_its_own_flags(tmp_path):
    critic = _checkpoint(tmp_path / "critic", **QWEN3, num_labels=1)
    args = parse_quiet(_ppo(tmp_path, "--critic-load", critic, "--critic-lr", "0.5", "--save", str(tmp_path / "s")))
    check_launch_inputs(args)
    role = critic_args(args)
    assert role.lr == 0.5 and args.lr != 0.5
    assert role.save == str(tmp_path / "s" / "critic") == critic_save_dir(args)
    assert role.load is None and critic_resume_dir(args) is None  # an HF critic: loaded, not resumed
    assert role.custom_model_provider_path.endswith("value_model_provider") and not role.use_kl_loss


def _saved(root, actor: int | None, critic: int | None, critic_iterations=()) -> None:
    """A run's checkpoint directory: the actor's tracker, the critic's tracker and iteration directories."""
    (root / "critic").mkdir(parents=True)
    if actor is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(str(actor))
        (root / f"iter_{actor:07d}").mkdir()
    if critic is not None:
        (root / "critic" / "latest_checkpointed_iteration.txt").write_text(str(critic))
    for iteration in critic_iterations:
        (root / "critic" / f"iter_{iteration:07d}").mkdir()


def test_a_saved_critic_under_load_is_resumed_at_the_actors_iteration(tmp_path):
    # the critic's tracker moves after the actor's: a run stopped in between has the critic one ahead
    _saved(tmp_path / "run", actor=3, critic=4, critic_iterations=(3, 4))
    args = parse_quiet(_ppo(tmp_path, "--load", str(tmp_path / "run")))
    check_launch_inputs(args)
    role = critic_args(args)
    assert (role.load, role.resume_iteration) == (str(tmp_path / "run" / "critic"), 3)


def test_a_critic_saved_before_its_tracker_moved_is_still_resumed(tmp_path):
    _saved(tmp_path / "run", actor=0, critic=None, critic_iterations=(0,))  # stopped before the critic's first publish
    args = parse_quiet(_ppo(tmp_path, "--load", str(tmp_path / "run")))
    check_launch_inputs(args)
    assert (critic_args(args).load, critic_args(args).resume_iteration) == (str(tmp_path / "run" / "critic"), 0)


@pytest.mark.parametrize("actor, critic, iterations, says", [
    (5, 3, (3,), "the actor resumes at iteration 5 .* has no iter_0000005 \\(its tracker names 3\\): the two roles "
                 "were not saved together; point --critic-load at the critic saved with that iteration"),
    (None, 3, (3,), "is at iteration 3, but the actor starts fresh"),
])
def test_a_critic_that_cannot_resume_with_the_actor_is_named_before_ray(tmp_path, actor, critic, iterations, says):
    _saved(tmp_path / "run", actor=actor, critic=critic, critic_iterations=iterations)
    args = parse_quiet(_ppo(tmp_path, "--load", str(tmp_path / "run")))
    with pytest.raises(ArgumentValidationError, match=says):
        check_launch_inputs(args)


@pytest.mark.parametrize("flags, says", [
    (["--critic-lr", "1e-3"], "--critic-lr configure the critic, which only --advantage-estimator ppo trains"),
    (["--num-critic-only-steps", "2"], "--num-critic-only-steps configure the critic"),
])
def test_critic_flags_without_ppo_are_refused(flags, says, tmp_path, capsys):
    err = parse_error([*BASE, "--hf-checkpoint", _checkpoint(tmp_path / "actor", **QWEN3), *flags], capsys)
    assert says in err


@pytest.mark.parametrize("flags, says", [
    (["--critic-num-gpus-per-node", "0"], "--critic-num-gpus-per-node 0 must be positive"),
    (["--kl-coef", "0.1"], "--kl-coef (a KL reward term) with --advantage-estimator ppo is not implemented"),
    (["--mtp-num-layers", "1", "--enable-mtp-training"], "--enable-mtp-training with --advantage-estimator ppo"),
    (["--num-critic-only-steps", "3"], "leaves no rollout of --num-rollout 3 to train the actor"),
    (["--num-critic-only-steps", "1", "--save", "s", "--save-interval", "1"],
     "--save-interval 1 saves during the first --num-critic-only-steps 1 rollouts"),
])
def test_what_the_critic_cannot_run_is_refused(flags, says, tmp_path, capsys):
    err = parse_error(_ppo(tmp_path, "--critic-load", "x", *flags), capsys)
    assert says in err
