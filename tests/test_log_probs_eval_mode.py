"""The old-policy and reference log-probs are scored without dropout, as the engines score (one CPU rank).

With megatron's default dropout (0.1, which upstream's flags keep unless a script sets 0), a forward in
training mode gives log-probs that differ from run to run and from the engines' by ~0.04 on a tiny
model: train/train_rollout_logprob_abs_diff then measures dropout noise, and PPO's ratio starts off 1.
"""
from __future__ import annotations

import pytest

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3
from train_step_harness import build_loaded_model, layout_args, make_rollout

pytestmark = pytest.mark.ranks


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("tiny_qwen3_dropout")))


def _log_probs_child(rank: int, world: int, hf_dir: str, dropout: float) -> dict:
    from train_step_harness import plans_for_this_rank
    from slime.backends.megatron_utils.train_step import compute_log_probs

    args = layout_args({}, hidden_dropout=dropout, attention_dropout=dropout)
    model, _, _ = build_loaded_model(args, hf_dir)
    data = make_rollout(num_samples=4, seed=0)
    (plan,) = plans_for_this_rank(data, args)
    first = compute_log_probs(model, data, plan, args)
    second = compute_log_probs(model, data, plan, args)
    return {"first": first, "second": second, "training_after": all(chunk.training for chunk in model)}


def test_log_probs_ignore_dropout_and_training_mode_comes_back(tiny_hf_dir):
    (noisy,) = run_ranks(_log_probs_child, 1, args=(tiny_hf_dir, 0.5), timeout_s=180)
    (clean,) = run_ranks(_log_probs_child, 1, args=(tiny_hf_dir, 0.0), timeout_s=180)
    assert noisy["first"] == noisy["second"], "two forward-only passes of the same weights differ: dropout is on"
    assert noisy["first"] == clean["first"], "dropout changed the scored log-probs"
    assert noisy["training_after"], "the model did not go back to training mode (dropout off while training)"
