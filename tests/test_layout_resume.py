"""A checkpoint resumed at another parallel layout (slime/checkpoint/layout.py).

Forked gloo ranks save after one training step at one layout; ranks of another layout run the uninterrupted
two steps themselves, then build a fresh model and optimizer, resume from the checkpoint as the trainer does
(`plan_resume`, `load_checkpoint`) and train the second step again: its loss and grad norm, and the weights it
leaves (which carry the loaded Adam state), equal the uninterrupted run's at that layout within float tolerance.
What cannot be restored at another layout is refused, before anything loads and before Ray starts.
"""
from __future__ import annotations

import copy
import json
import os

import pytest

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3, save_tiny_qwen3_moe
from train_step_harness import _perturbed, build_loaded_model, layout_args, make_rollout, plans_for_this_rank

from slime.checkpoint import contents
from slime.checkpoint.layout import (DISTRIBUTED, PER_PARAMETER, LayoutResumeError, SavedLayout, plan_layout_resume,
                                     write_layout)

pytestmark = pytest.mark.ranks

LR = 1e-2  # large enough that a lost or wrong Adam state moves the weights far beyond float noise


# ----- what is restored, what is refused (pure) -------------------------------------------------------------
def _layout(**overrides) -> SavedLayout:
    fields = dict(tp=2, pp=1, cp=4, ep=1, etp=2, dp=1, world_size=8, vpp=None, optimizer=PER_PARAMETER,
                  optimizer_parts=1)
    return SavedLayout(**{**fields, **overrides})


def _plan(saved, current, *, load_optimizer=True, load_rng=True, random_draws=()):
    return plan_layout_resume(saved, current, load_optimizer=load_optimizer, load_rng=load_rng,
                              random_draws=random_draws)


def test_at_the_saved_layout_everything_is_restored_rank_by_rank():
    assert _plan(_layout(), _layout()).restore_rng and not _plan(_layout(), _layout()).changed
    assert _plan(None, _layout()).restore_rng  # saved before layouts were recorded: as before
    assert not _plan(_layout(), _layout(), load_rng=False).restore_rng


def test_at_another_layout_the_rng_is_not_restored_and_dropout_makes_that_a_refusal():
    saved, current = _layout(), _layout(cp=2, dp=2)
    plan = _plan(saved, current)
    assert plan.changed and not plan.restore_rng
    assert "saved at TP2 x CP4, 8 ranks, resumed at TP2 x CP2 x DP2, 8 ranks" in plan.notes[0]
    assert "every dropout is 0" in plan.notes[1]
    with pytest.raises(LayoutResumeError, match=r"dropout draws \(--hidden-dropout 0.1\).*--no-load-rng"):
        _plan(saved, current, random_draws=("--hidden-dropout 0.1",))
    assert not _plan(saved, current, load_rng=False, random_draws=("--hidden-dropout 0.1",)).restore_rng


def test_optimizer_state_that_cannot_be_resharded_is_refused_with_the_way_out():
    distributed = _layout(optimizer=DISTRIBUTED)
    assert _plan(distributed, _layout(cp=2, dp=2, optimizer=DISTRIBUTED)).changed  # DP x CP: resharded
    with pytest.raises(LayoutResumeError, match=r"reshards over DP and CP only, and TP 2 -> 1; "
                                                r"resume at the saved TP, or pass --no-load-optim"):
        _plan(distributed, _layout(tp=1, etp=1, cp=4, dp=2, optimizer=DISTRIBUTED))
    with pytest.raises(LayoutResumeError, match=r"EP 2 -> 4, ETP 2 -> 1"):  # the experts' own split
        _plan(_layout(ep=2, cp=1, dp=4, optimizer=DISTRIBUTED, optimizer_parts=2),
              _layout(ep=4, etp=1, cp=1, dp=4, optimizer=DISTRIBUTED, optimizer_parts=2))
    assert _plan(distributed, _layout(etp=1, cp=2, dp=2, optimizer=DISTRIBUTED)).changed  # ETP of a dense model
    assert _plan(distributed, _layout(tp=1, etp=1, dp=2, optimizer=DISTRIBUTED), load_optimizer=False).changed
    assert _plan(_layout(), _layout(tp=1, etp=1, dp=2)).changed  # per parameter: resharded with the model
    with pytest.raises(LayoutResumeError, match="in 1 part.*makes 2.*expert parallelism off"):
        _plan(_layout(tp=1, etp=1, cp=1, dp=2, world_size=2), _layout(tp=1, etp=1, cp=1, ep=2, world_size=2,
                                                                          optimizer_parts=2))
    with pytest.raises(LayoutResumeError, match="saved with --use-distributed-optimizer"):
        _plan(distributed, _layout())  # the same layout, another optimizer format
    assert not _plan(_layout(optimizer=None), _layout(tp=1, etp=1, dp=2)).restore_rng  # --no-save-optim


def test_a_resume_the_ranks_would_refuse_stops_before_ray_starts(tmp_path):
    from arg_testing import parse_quiet

    from slime.config.errors import ArgumentValidationError
    from slime.config.launch import check_launch_inputs

    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

    hf_dir = str(write_tiny_checkpoint(tmp_path / "hf", TinyQwen3Spec(layers=1)))  # with its tokenizer
    (tmp_path / "p.jsonl").write_text(json.dumps({"input": "1+1", "label": "2"}) + "\n")
    root = tmp_path / "ckpt"
    path = contents.iteration_dir(str(root), 4)
    os.makedirs(path)
    write_layout(path, _layout(optimizer=DISTRIBUTED))  # TP2 x CP4 on 8 ranks, distributed optimizer
    (root / contents.TRACKER).write_text("4")

    def flags(tp: int, cp: int, *extra: str) -> list[str]:
        return ["--hf-checkpoint", hf_dir, "--prompt-data", str(tmp_path / "p.jsonl"), "--load", str(root),
                "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", str(tp), "--context-parallel-size",
                str(cp), "--use-distributed-optimizer", "--hidden-dropout", "0", "--rollout-batch-size", "8",
                "--num-rollout", "2", "--train-backend-device", "cpu", "--rollout-backend", "embedded", *extra]

    with pytest.raises(ArgumentValidationError, match="TP 2 -> 1"):
        check_launch_inputs(parse_quiet(flags(1, 4, "--attention-dropout", "0")))
    check_launch_inputs(parse_quiet(flags(1, 4, "--attention-dropout", "0", "--no-load-optim")))  # the way out
    check_launch_inputs(parse_quiet(flags(2, 2, "--attention-dropout", "0")))  # CP4 -> CP2 x DP2: resharded
    with pytest.raises(ArgumentValidationError, match="--attention-dropout 0.1.*--no-load-rng"):
        check_launch_inputs(parse_quiet(flags(2, 2, "--attention-dropout", "0.1")))


# ----- the continuation at another layout (forked gloo ranks) ------------------------------------------------
def _train(model, optimizer, scheduler, args, rollouts) -> list[dict]:
    """One step per rollout, each with old-policy log-probs from the model as it is (as the trainer makes them)."""
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step

    results = []
    for data in rollouts:
        data = copy.deepcopy(data)
        (plan,) = plans_for_this_rank(data, args)
        mine = [row if row else [0.0] * n
                for row, n in zip(compute_log_probs(model, data, plan, args), data["response_lengths"])]
        data["log_probs"] = _perturbed(mine, 0.3, 0.0)
        data["ref_log_probs"] = _perturbed(mine, 0.2, 1.0)
        data["rollout_log_probs"] = _perturbed(mine, 0.5, 2.0)
        result = train_one_step(model, optimizer, scheduler, data, plan, args)
        assert not result.skipped
        results.append(dict(loss=result.loss, grad_norm=result.grad_norm))
    return results


def _weights(model) -> dict:
    return {name: p.detach().clone() for name, p in model[0].named_parameters()}


def _save_child(rank, world, layout, hf_dir, rollouts, ckpt):
    from slime.backends.megatron_utils.checkpoint import save_checkpoint

    args = layout_args(layout, lr=LR)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    _train(model, optimizer, scheduler, args, rollouts[:1])
    save_checkpoint(ckpt, 0, model, optimizer, scheduler)
    return rank


def _resume_child(rank, world, layout, hf_dir, rollouts, ckpt):
    import transformers

    from slime.backends.megatron_utils.checkpoint import load_checkpoint, plan_resume
    from slime.backends.megatron_utils.model import build_model_and_optimizer

    args = layout_args(layout, lr=LR)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    uninterrupted = _train(model, optimizer, scheduler, args, rollouts)[1]
    expected = _weights(model)
    # a new process's trainer: a model and optimizer never stepped, then the checkpoint
    model, optimizer, scheduler = build_model_and_optimizer(args, transformers.AutoConfig.from_pretrained(hf_dir))
    plan = plan_resume(ckpt, 0, optimizer, load_optimizer=True, load_rng=True, random_draws=())
    assert load_checkpoint(ckpt, model, optimizer, scheduler) == 0
    resumed = _train(model, optimizer, scheduler, args, rollouts[1:])[0]
    drift = max(float((expected[name] - p).abs().max()) for name, p in _weights(model).items())
    return dict(uninterrupted=uninterrupted, resumed=resumed, drift=drift, changed=plan.changed,
                restore_rng=plan.restore_rng)


def _assert_continues(results: list[dict]) -> None:
    for result in results:
        assert result["changed"] and not result["restore_rng"], result
        for key in ("loss", "grad_norm"):
            assert result["resumed"][key] == pytest.approx(result["uninterrupted"][key], rel=1e-5, abs=1e-6), result
        # Adam moved every weight by ~LR: a lost moment or a miscounted step is a thousand times this bound
        assert result["drift"] < 1e-4, result


@pytest.mark.timeout(400)
def test_a_checkpoint_of_tp2_sp_cp4_continues_at_tp2_sp_cp2_dp2(tmp_path):
    """With the distributed optimizer: its state reshards from CP4 to CP2 x DP2 (DP x CP stays 4)."""
    hf_dir = save_tiny_qwen3(str(tmp_path / "hf"))
    rollouts = [make_rollout(num_samples=4, seed=seed, max_len=20) for seed in (0, 1)]
    ckpt = str(tmp_path / "ckpt")
    common = dict(tensor_model_parallel_size=2, sequence_parallel=True, calculate_per_token_loss=True,
                  use_distributed_optimizer=True)
    run_ranks(_save_child, 8, args=({**common, "context_parallel_size": 4}, hf_dir, rollouts, ckpt), timeout_s=300)
    saved = json.loads((tmp_path / "ckpt" / "iter_0000000" / "slime_layout.json").read_text())
    assert (saved["tp"], saved["cp"], saved["dp"], saved["optimizer"]) == (2, 4, 1, DISTRIBUTED)
    _assert_continues(run_ranks(_resume_child, 8, args=({**common, "context_parallel_size": 2}, hf_dir, rollouts,
                                                        ckpt), timeout_s=300))


@pytest.mark.timeout(400)
def test_a_moe_checkpoint_of_ep4_continues_at_tp1_ep2(tmp_path):
    """Per-parameter optimizer state: the experts' moments follow them from four ranks to two."""
    hf_dir = save_tiny_qwen3_moe(str(tmp_path / "hf"))
    rollouts = [make_rollout(num_samples=4, seed=seed, max_len=20) for seed in (0, 1)]
    ckpt = str(tmp_path / "ckpt")
    common = dict(calculate_per_token_loss=True)
    run_ranks(_save_child, 4, args=({**common, "expert_model_parallel_size": 4}, hf_dir, rollouts, ckpt),
              timeout_s=300)
    _assert_continues(run_ranks(_resume_child, 2, args=({**common, "expert_model_parallel_size": 2}, hf_dir,
                                                        rollouts, ckpt), timeout_s=300))
