"""Small pieces of the flags that used to be accepted without effect: parameter freezing, the log-prob
token budget, the reference refresh, resume variants, --dump-details, --train-env-vars."""
from __future__ import annotations

import argparse
import warnings
from types import SimpleNamespace

import pytest
import torch

from slime.backends.megatron_utils import actor as actor_module
from slime.backends.megatron_utils.actor import MegatronTrainActor, WeightSnapshots, log_prob_plan_args
from slime.utils import sglang_passthrough
from slime.utils.arguments import parse_args
from slime.utils.security import current_key

MINIMAL = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
           "--train-backend-device", "cpu"]


@pytest.fixture(autouse=True)
def _no_real_sglang(monkeypatch):
    monkeypatch.setattr(sglang_passthrough, "server_args_parser", lambda: None)


def _chunks():
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embedding = torch.nn.Linear(2, 2)
    model.decoder = torch.nn.Linear(2, 2)
    model.output_layer = torch.nn.Linear(2, 2)
    return [model]


def test_freeze_and_only_train_lists_select_parameters_by_regex():
    from slime.backends.megatron_utils.model import freeze_parameters

    chunks = _chunks()
    assert freeze_parameters(chunks, None, ["^embedding", "output_layer.bias"]) == 3
    assert {n for n, p in chunks[0].named_parameters() if p.requires_grad} == {"decoder.weight", "decoder.bias",
                                                                               "output_layer.weight"}
    chunks = _chunks()
    assert freeze_parameters(chunks, ["decoder"], None) == 4
    assert {n for n, p in chunks[0].named_parameters() if p.requires_grad} == {"decoder.weight", "decoder.bias"}
    with pytest.raises(ValueError, match="no trainable parameter"):
        freeze_parameters(_chunks(), ["nothing_matches"], None)


def test_log_prob_passes_get_their_own_token_budget():
    args = argparse.Namespace(use_dynamic_batch_size=True, max_tokens_per_gpu=100, log_probs_max_tokens_per_gpu=400)
    assert log_prob_plan_args(args).max_tokens_per_gpu == 400 and args.max_tokens_per_gpu == 100
    same = argparse.Namespace(use_dynamic_batch_size=True, max_tokens_per_gpu=100, log_probs_max_tokens_per_gpu=100)
    assert log_prob_plan_args(same) is same


def _actor(**attributes) -> MegatronTrainActor:
    """The actor's methods on hand-set attributes (no process group, no model build)."""
    actor = object.__new__(MegatronTrainActor)
    vars(actor).update(attributes)
    return actor


def test_reference_model_is_refreshed_every_interval():
    model = _chunks()
    actor = _actor(args=SimpleNamespace(ref_update_interval=2), snapshots=WeightSnapshots(model))
    actor.snapshots.take("ref")
    with torch.no_grad():
        model[0].decoder.weight.add_(1.0)
    MegatronTrainActor._refresh_reference(actor, rollout_id=0)  # after rollout 0: not yet
    assert not torch.equal(actor.snapshots._saved["ref"]["0.decoder.weight"], model[0].decoder.weight)
    MegatronTrainActor._refresh_reference(actor, rollout_id=1)  # after 2 rollouts: the actor becomes the reference
    assert torch.equal(actor.snapshots._saved["ref"]["0.decoder.weight"], model[0].decoder.weight)


NO_DRAWS = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "enable_lora": False}  # a step that draws no random numbers


def _same_layout(monkeypatch, checkpoint, items: frozenset[str]) -> None:
    """The checkpoint as saved at this rank's layout (what a layout resume changes is tests/test_layout_resume.py's),
    holding `items`."""
    monkeypatch.setattr(checkpoint, "plan_resume", lambda path, iteration, optimizer, *, load_optimizer, load_rng,
                        random_draws: SimpleNamespace(notes=(), restore_rng=load_rng))
    monkeypatch.setattr(checkpoint, "holds", lambda path, iteration: items)


@pytest.mark.parametrize("flags, optimizer_loaded, scheduler_loaded, rng_loaded, start", [
    ({}, True, True, True, 8), ({"no_load_optim": True}, False, True, True, 8),
    ({"no_load_rng": True}, True, True, False, 8), ({"finetune": True}, False, False, False, 0)])
def test_resume_variants(monkeypatch, flags, optimizer_loaded, scheduler_loaded, rng_loaded, start):
    from slime.backends.megatron_utils import checkpoint

    calls, rng_calls = [], []
    monkeypatch.setattr(checkpoint, "load_checkpoint",
                        lambda path, model, optimizer=None, scheduler=None, iteration=None:
                        calls.append((optimizer, scheduler)) or 7)
    monkeypatch.setattr(checkpoint, "restore_rng", lambda path, iteration, rank: rng_calls.append((iteration, rank)) or True)
    _same_layout(monkeypatch, checkpoint, frozenset({"model", "rng"}))
    args = SimpleNamespace(**{"no_load_optim": False, "finetune": False, "no_load_rng": False,
                              "ref_update_interval": None, **NO_DRAWS, **flags})
    optimizer = SimpleNamespace(reloaded=0)
    optimizer.reload_model_params = lambda: setattr(optimizer, "reloaded", optimizer.reloaded + 1)
    actor = _actor(args=args, model="m", optimizer=optimizer, lr_scheduler="sched", rank=3,
                   snapshots=WeightSnapshots(_chunks()))
    assert actor._resume("/ckpt") == start
    assert calls == [(optimizer if optimizer_loaded else None, "sched" if scheduler_loaded else None)]
    assert rng_calls == ([(7, 3)] if rng_loaded else [])
    # a fresh optimizer's (bf16) main params must follow the loaded weights, not the init they were cloned from
    assert optimizer.reloaded == (0 if optimizer_loaded else 1)


def test_resume_restores_a_refreshed_reference_and_keeps_the_live_weights(monkeypatch):
    from slime.backends.megatron_utils import checkpoint

    model = _chunks()
    live = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: 4)
    monkeypatch.setattr(checkpoint, "restore_rng", lambda *a: True)
    _same_layout(monkeypatch, checkpoint, frozenset({"model", "reference"}))

    def load_reference(path, iteration, chunks):  # the saved reference: every weight 0.5
        with torch.no_grad():
            for p in chunks[0].parameters():
                p.fill_(0.5)

    monkeypatch.setattr(checkpoint, "load_reference", load_reference)
    args = SimpleNamespace(no_load_optim=False, finetune=False, no_load_rng=False, ref_update_interval=2, **NO_DRAWS)
    actor = _actor(args=args, model=model, optimizer=None, lr_scheduler=None, rank=0, snapshots=WeightSnapshots(model))
    actor.snapshots.take("ref")  # --ref-load's weights
    assert actor._resume("/ckpt") == 5
    assert all(torch.equal(v, torch.full_like(v, 0.5)) for v in actor.snapshots._saved["ref"].values())
    assert all(torch.equal(live[n], p) for n, p in model[0].named_parameters())


def test_dump_details_sets_both_debug_dumps():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = parse_args(MINIMAL + ["--dump-details", "/tmp/d"])
    assert args.save_debug_rollout_data == "/tmp/d/rollout_data/{rollout_id}.pt"
    assert args.save_debug_train_data == "/tmp/d/train_data/{rollout_id}.pt"
    assert args.derived_values["save_debug_train_data"] == "--dump-details /tmp/d"


def test_train_env_vars_reach_the_rank_process(monkeypatch):
    from slime.ray.trainer import rank_actor as train_actor

    seen = {}

    class FakeMegatronActor:  # stands in for the megatron actor: only the environment is checked
        def __init__(self, *a, **kw):
            pass

        def init(self, *a, **kw):
            import os

            seen["value"] = os.environ.get("SLIME_TEST_ENV_VAR")
            return 0

    monkeypatch.setattr(actor_module, "MegatronTrainActor", FakeMegatronActor)
    monkeypatch.delenv("SLIME_TEST_ENV_VAR", raising=False)
    from slime.config import defaults_namespace

    args = defaults_namespace(train_env_vars={"SLIME_TEST_ENV_VAR": 3}, api_key=current_key())
    from slime.config.run_state import initial_run_state

    rank = train_actor.TrainRayActor(args, initial_run_state(args), 0, 1, "/tmp")
    rank.init("127.0.0.1", 1, [])
    assert seen["value"] == "3"
    monkeypatch.delenv("SLIME_TEST_ENV_VAR", raising=False)
