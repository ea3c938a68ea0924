"""--megatron-config-path, upstream's per-role Megatron overrides: its YAML read into each role's converted flags
(the actor's onto the run's flags, the critic's kept apart and inheriting the command line, not the actor's entry),
the critic's flags checked as a whole before Ray starts (a layout that does not tile its ranks refused with the
sizes), its ranks started on bundles of its own, what cannot be honoured refused naming the key; and on two
forked ranks the critic's own fenced rank built from those flags runs at its own world, TP and learning rate,
gives transformers' values, and resumes exactly from its checkpoint."""
from __future__ import annotations

import copy
import json
import os
import re
import types

import pytest
import torch
import yaml

from arg_testing import parse_error, parse_quiet
from mp_utils import run_ranks
from slime.config.critic_role import critic_args
from slime.config.run_state import run_state_of

QWEN3 = dict(model_type="qwen3", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=32)


def _roles(tmp_path, *entries, raw=None) -> str:
    path = tmp_path / "roles.yaml"
    path.write_text(yaml.safe_dump(raw if raw is not None else {"megatron": list(entries)}))
    return str(path)


def _entry(role, **overrides):
    return {"name": "default", "role": role, "overrides": overrides}


def _argv(tmp_path, *flags, ppo=True):
    hf = tmp_path / "hf"
    if not hf.exists():
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps(QWEN3))
        (hf / "tokenizer.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text('{"input": "1"}\n')
    algorithm = ["--advantage-estimator", "ppo", "--critic-load", str(hf)] if ppo else []
    return ["--hf-checkpoint", str(hf), "--prompt-data", str(tmp_path / "prompts.jsonl"), "--num-rollout", "3",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--actor-num-gpus-per-node", "4",
            "--train-backend-device", "cpu", "--lr", "3e-6", *algorithm, *flags]


def test_each_role_gets_its_entry_and_the_critic_its_own_derived_layout(tmp_path):
    path = _roles(tmp_path, _entry("actor", lr="1e-6"),
                  _entry("critic", lr="1e-5", tensor_model_parallel_size=2, micro_batch_size="2",
                         **{"sequence-parallel": True}))
    args = parse_quiet(_argv(tmp_path, "--megatron-config-path", path))
    assert (args.lr, args.tensor_model_parallel_size, args.data_parallel_size) == (1e-6, 1, 4)
    assert not args.sequence_parallel and args.micro_batch_size == 1
    critic = critic_args(args)
    assert (critic.lr, critic.tensor_model_parallel_size, critic.data_parallel_size) == (1e-5, 2, 2)
    assert critic.sequence_parallel and critic.micro_batch_size == 2 and critic.role == "critic"


def test_a_role_without_an_entry_runs_the_command_line_not_the_other_roles_entry(tmp_path):
    path = _roles(tmp_path, {"name": "default", "role": "actor",  # upstream's `args` alias of `overrides`
                             "args": {"lr": 1e-6, "tensor_model_parallel_size": 2, "lr_warmup_iters": 3}})
    args = parse_quiet(_argv(tmp_path, "--megatron-config-path", path))
    assert (args.lr, args.lr_warmup_iters, args.tensor_model_parallel_size, args.data_parallel_size) == (1e-6, 3, 2, 2)
    critic = critic_args(args)
    assert (critic.lr, critic.lr_warmup_iters, critic.tensor_model_parallel_size, critic.data_parallel_size) == (
        3e-6, 0, 1, 4)


def test_the_critic_entrys_checkpoints_are_its_own(tmp_path):
    path = _roles(tmp_path, _entry("critic", save=str(tmp_path / "critic_out")))
    args = parse_quiet(_argv(tmp_path, "--megatron-config-path", path, "--save", str(tmp_path / "run")))
    assert args.save == str(tmp_path / "run") and critic_args(args).save == str(tmp_path / "critic_out")


@pytest.mark.parametrize("config, flags, says", [
    ({"critic": [_entry("critic", lr=1e-5)]}, [], "expected a top-level 'megatron' list"),
    ([_entry("reward", lr=1e-5)], [], "needs role: actor or role: critic"),
    ([_entry("critic", lr=1e-5), _entry("critic", lr=1e-4)], [], "more than one entry with role: critic"),
    ([_entry("critic", tensor_parallel=2)], [], "key 'tensor_parallel' is not a flag of train.py"),
    ([_entry("actor", rollout_batch_size=4)], [],
     r"key 'rollout_batch_size' \(--rollout-batch-size\) is not a per-role setting here"),
    ([_entry("critic", enable_lora=True)], [], r"\(--enable-lora\) is not a per-role setting here"),
    ([_entry("critic", sequence_parallel="yes")], [], "sequence_parallel is a switch"),
    ([_entry("critic", recompute_granularity="some")], [], r"is not one of \['full', 'selective'\]"),
    ([_entry("critic", tensor_model_parallel_size=3)], [],
     r"critic entry of --megatron-config-path .*tensor_model_parallel_size=3.*world size 4 is not divisible by "
     r"TP\*CP\*PP = 3\*1\*1"),
    ([_entry("critic", global_batch_size=3)], [], "the critic entry .* not a multiple of --global-batch-size 3"),
    ([_entry("critic", tensor_model_parallel_size=2, global_batch_size=1)], [],
     "the critic entry .*--global-batch-size 1 is not divisible by the data-parallel size 2"),
    ([_entry("critic", optimizer="sgd")], [], "the critic entry .*only --optimizer adam is implemented"),
    ([_entry("critic", overlap_grad_reduce=True)], [], "the critic entry .*--overlap-grad-reduce is not implemented"),
    ([_entry("critic", lr=1e-5)], ["--critic-lr", "1e-4"], "critic entry's lr and --critic-lr both"),
    ([_entry("critic", context_parallel_size=4)], ["--critic-num-gpus-per-node", "2"],
     r"the critic \(2 ranks: --critic-num-nodes 1 x --critic-num-gpus-per-node 2\), with the critic entry .*"
     r"world size 2 is not divisible by TP\*CP\*PP = 1\*4\*1"),
    ([], ["--critic-num-gpus-per-node", "3"],
     r"the critic \(3 ranks: .*\): --global-batch-size 8 .* is not divisible by the data-parallel size 3"),
    ([_entry("critic", num_gpus_per_node=2)], [],
     "num_gpus_per_node 2 differs from --critic-num-gpus-per-node 4: GPU counts follow the command line"),
])
def test_what_a_role_entry_cannot_do_is_refused_naming_it(config, flags, says, tmp_path, capsys):
    roles = ["--megatron-config-path", _roles(tmp_path, *config) if isinstance(config, list) else
             _roles(tmp_path, raw=config)] if config else []
    err = parse_error(_argv(tmp_path, *roles, *flags), capsys)
    assert re.search(says, err), err


def test_a_critic_entry_without_a_critic_is_refused(tmp_path, capsys):
    path = _roles(tmp_path, _entry("critic", lr=1e-5))
    err = parse_error(_argv(tmp_path, "--megatron-config-path", path, ppo=False), capsys)
    assert "the critic entry (lr) configures the critic, which only --advantage-estimator ppo trains" in err


def test_an_actor_entry_alone_needs_no_critic(tmp_path):
    path = _roles(tmp_path, _entry("actor", tensor_model_parallel_size=2, lr=1e-6))
    args = parse_quiet(_argv(tmp_path, "--megatron-config-path", path, ppo=False))
    assert (args.tensor_model_parallel_size, args.data_parallel_size, args.lr) == (2, 2, 1e-6)
    assert args.critic_lr is None and args.critic_overrides == {}


# ---------------------------------------------------------------------------------------- the critic's own rank
def _critic_rank(rank, world, role_args, ledger_dir, data, rollouts, save_after):
    """The critic's fenced rank: init (a fresh start or a resume), then values and a critic step per rollout,
    saving after rollout `save_after`."""
    from megatron.core import parallel_state

    from slime.backends.megatron_utils.critic import CriticTrainActor

    critic = CriticTrainActor(role_args, rank, world, ledger_dir)
    steps = {}
    try:
        start = critic.init(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), engine_urls=[])
        for rollout_id in rollouts:
            values = critic.values(rollout_id, copy.deepcopy(data))
            metrics = critic.train(rollout_id, {**copy.deepcopy(data), "values": values})
            steps[rollout_id] = dict(values=values, lr=metrics["critic/lr"], loss=metrics["critic/value_loss"])
            if rollout_id == save_after:
                critic.save(rollout_id)
    finally:
        critic.ledger.close()
    return dict(start=start, tp=parallel_state.get_tensor_model_parallel_world_size(),
                dp=parallel_state.get_data_parallel_world_size(), steps=steps)


@pytest.mark.ranks
@pytest.mark.timeout(200)
def test_the_critic_rank_runs_its_entrys_tp_and_lr_and_resumes_exactly(tmp_path):
    """Actor TP1 x DP4 from the command line; the critic on 2 GPUs of its own (--critic-num-gpus-per-node 2) at
    TP2 x SP (DP1) with its own rate from its entry: the critic's fenced rank (CriticTrainActor, built from
    critic_args) runs that world, layout and rate, and its values match the HF token-classification reference.
    Saved after rollout 0 (--save: <save>/critic) and resumed by a fresh run (--load), it starts at rollout 1 and
    gives the same values and steps (weights, Adam state, schedule) as the run that went on."""
    import step_ranks
    from tiny_models import tiny_qwen3_config
    from train_step_harness import make_rollout
    from transformers import Qwen3ForTokenClassification

    torch.manual_seed(0)
    reference = Qwen3ForTokenClassification(tiny_qwen3_config(num_labels=1)).float().eval()
    torch.nn.init.normal_(reference.score.weight, std=0.5)
    hf = str(tmp_path / "hf")
    reference.save_pretrained(hf, safe_serialization=True)
    path = _roles(tmp_path, _entry("critic", lr="1e-3", tensor_model_parallel_size=2, sequence_parallel=True))
    run = str(tmp_path / "run")
    args = step_args_ppo(step_ranks, hf, path, "--save", run)
    assert (args.tensor_model_parallel_size, args.data_parallel_size) == (1, 4)
    assert (critic_args(args).world_size, critic_args(args).data_parallel_size) == (2, 1)
    critic_run, run_config = critic_args(args).run_config, args.run_config  # each role's own layout
    assert (critic_run.layout.world_size, critic_run.layout.tp, critic_run.layout.dp) == (2, 2, 1)
    assert (run_config.layout.world_size, run_config.layout.tp, run_config.layout.dp) == (4, 1, 4)
    data = make_rollout(num_samples=8, vocab=reference.config.vocab_size)
    first = run_ranks(_critic_rank, 2, args=(critic_args(args), str(tmp_path / "ledger"), data, (0, 1, 2), 0),
                      init_process_group=False, timeout_s=120)
    assert [(r["start"], r["tp"], r["dp"]) for r in first] == [(0, 2, 1)] * 2
    assert all(step["lr"] == 1e-3 for r in first for step in r["steps"].values())
    assert first[0]["steps"] == first[1]["steps"] and first[0]["steps"][0]["loss"] > 0
    with torch.no_grad():
        for tokens, response, got in zip(data["tokens"], data["response_lengths"], first[0]["steps"][0]["values"]):
            prompt = len(tokens) - response
            expected = reference(torch.tensor([tokens])).logits[0, prompt - 1: prompt - 1 + response, 0]
            assert got == pytest.approx(expected.tolist(), abs=1e-5)
    assert first[0]["steps"][1]["values"] != first[0]["steps"][0]["values"]  # the step moved the critic

    resumed_args = critic_args(step_args_ppo(step_ranks, hf, path, "--load", run))
    assert resumed_args.load == os.path.join(run, "critic")
    resumed = run_ranks(_critic_rank, 2, args=(resumed_args, str(tmp_path / "ledger2"), data, (1, 2), None),
                        init_process_group=False, timeout_s=120)
    for before, after in zip(first, resumed):
        # rollout 1: the saved weights and schedule; rollout 2's values: rollout 1's step with the saved Adam state
        assert after["start"] == 1 and after["steps"] == {k: before["steps"][k] for k in (1, 2)}


def step_args_ppo(step_ranks, hf: str, roles: str, *flags: str):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return step_ranks.step_args(hf, world=4, fence_timeout=60, extra=[
            "--advantage-estimator", "ppo", "--critic-load", hf, "--megatron-config-path", roles,
            "--critic-num-gpus-per-node", "2", "--lr-decay-style", "constant", *flags])


def test_the_critic_group_starts_its_own_world_on_its_own_bundles(tmp_path, monkeypatch):
    """RayTrainGroup(role="critic") with --critic-num-gpus-per-node 2 (actor: 4): two ranks, on the critic's
    bundles, each given the critic's flags (its world, layout and rate) and its own ledger directory."""
    from slime.ray.driver import trainer_group
    from slime.ray.driver.placement import BundleInfo, Placement, plan_layout

    path = _roles(tmp_path, _entry("critic", lr=1e-5, tensor_model_parallel_size=2))
    args = parse_quiet(_argv(tmp_path, "--megatron-config-path", path, "--critic-num-gpus-per-node", "2",
                             "--ledger-dir", str(tmp_path / "ledger")))
    infos = [BundleInfo(index=i, node_id="n", node_ip="10.0.0.1") for i in range(6)]
    layout = plan_layout(infos, trainer_ranks=4, num_engines=4, gpus_per_engine=1, colocate=True, critic_ranks=2)
    placement = Placement(group=None, use_gpu=False, layout=layout)
    monkeypatch.setattr(Placement, "strategy", lambda self, bundle: bundle)
    started = []

    class Remote:
        def options(self, **options):
            return types.SimpleNamespace(remote=lambda *a: started.append((options["scheduling_strategy"], a)))

    monkeypatch.setattr(trainer_group.ray, "remote", lambda cls: Remote())
    monkeypatch.setattr(trainer_group, "start_hub", lambda world, runtime_env=None: ("hub", "name"))
    monkeypatch.setattr(trainer_group, "HubClient", lambda transport: None)
    monkeypatch.setattr(trainer_group, "RayHub", lambda *hub: None)
    group = trainer_group.RayTrainGroup(args, placement, role="critic")
    assert group.world_size == 2 and [bundle for bundle, _ in started] == [4, 5]
    assert group.deadlines == args.run_config.deadlines
    for rank, (_, (role_args, run_state, rank_arg, world, ledger_dir, hub, role)) in enumerate(started):
        assert (rank_arg, world, role, ledger_dir) == (rank, 2, "critic", str(tmp_path / "ledger" / "critic"))
        # the run state is the rank's argument (the driver's, with its ledger dir), not a field of its flags
        assert run_state == run_state_of(args) and "run_state" not in vars(role_args)
        assert (role_args.lr, role_args.tensor_model_parallel_size, role_args.data_parallel_size) == (1e-5, 2, 1)
