"""The megatron training step: single-process behaviour and DP with padding micro-batches.

The 8-rank layout checks live in test_layout_invariance.py and reuse the helpers here.
"""

import math

import pytest

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3
from train_step_harness import layout_child, layout_args, make_rollout

pytestmark = pytest.mark.ranks

TOL = 1e-5
MODES = ("per_token", "per_sample")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("tiny_qwen3")))


@pytest.fixture(scope="session")
def rollout():
    return make_rollout(num_samples=6, seed=0)


_REFERENCES = {}


def reference_run(hf_dir, data, megatron_per_token: bool) -> dict:
    """Single-process results (cached per session: both 8-rank layouts reuse them)."""
    key = (hf_dir, id(data), megatron_per_token)
    if key not in _REFERENCES:
        layout = dict(calculate_per_token_loss=megatron_per_token)
        (_REFERENCES[key],) = run_ranks(layout_child, 1, args=(layout, hf_dir, data, MODES), timeout_s=120)
    return _REFERENCES[key]


def merged_log_probs(results: list[dict], num_samples: int) -> list[list[float]]:
    """Every sample's log-probs from whichever DP rank holds it; ranks holding it must agree."""
    merged = [None] * num_samples
    for result in results:
        for i, row in enumerate(result["log_probs"]):
            if row:
                assert merged[i] is None or merged[i] == row, f"ranks disagree on sample {i}"
                merged[i] = row
    return merged


def assert_matches_reference(results: list[dict], reference: dict, data: dict) -> None:
    merged = merged_log_probs(results, len(data["tokens"]))
    for got, want in zip(merged, reference["log_probs"]):
        assert got == pytest.approx(want, abs=TOL)
    for mode in MODES:
        want = reference["steps"][mode]
        assert not want["skipped"] and want["grad_norm"] > 0
        for result in results:
            got = result["steps"][mode]
            assert got["loss"] == pytest.approx(want["loss"], abs=TOL), mode
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], abs=TOL, rel=TOL), mode
            assert list(got["metrics"]) == sorted(want["metrics"])
            for key, value in want["metrics"].items():
                assert got["metrics"][key] == pytest.approx(value, abs=TOL), (mode, key)


@pytest.mark.timeout(120)
def test_per_token_and_per_sample_losses_differ_and_are_finite(tiny_hf_dir, rollout):
    ref = reference_run(tiny_hf_dir, rollout, False)
    losses = {m: ref["steps"][m]["loss"] for m in MODES}
    assert all(math.isfinite(v) for v in losses.values())
    assert losses["per_token"] != pytest.approx(losses["per_sample"], abs=1e-4)
    assert ref["steps"]["per_token"]["metrics"]["pg_clipfrac"] > 0  # the perturbation clips
    assert [len(r) for r in ref["log_probs"]] == rollout["response_lengths"]


@pytest.mark.timeout(120)
def test_megatron_averaging_modes_agree(tiny_hf_dir, rollout):
    """megatron's legacy averaging and its per-token mode are both undone exactly."""
    legacy = reference_run(tiny_hf_dir, rollout, False)
    per_token = reference_run(tiny_hf_dir, rollout, True)
    assert_matches_reference([per_token], legacy, rollout)


@pytest.mark.timeout(150)
def test_dp4_with_an_empty_rank_runs_a_padding_micro_batch(tiny_hf_dir):
    """3 samples over 4 DP ranks: rank 3 holds none and runs a zero-weight padding micro-batch."""
    data = make_rollout(num_samples=3, seed=1)
    reference = reference_run(tiny_hf_dir, data, False)
    results = run_ranks(layout_child, 4, args=(dict(), tiny_hf_dir, data, MODES), timeout_s=120)
    assert results[3]["padding"] == 1
    assert len({r["plan"]["num_micro_batches"] for r in results}) == 1
    assert_matches_reference(results, reference, data)


def _train_twice_child(rank, world, hf_dir, data):
    from transformers import AutoConfig

    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from train_step_harness import plans_for_this_rank
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime_plugins.models.hf_weights import load_hf_weights

    args = layout_args({}, lr=1e-2)
    init_model_parallel(args)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    model, optimizer, scheduler = build_model_and_optimizer(args, hf_config)
    load_hf_weights(model, hf_dir, hf_config)
    (plan,) = plans_for_this_rank(data, args)
    phases = []

    def hook(name):
        phases.append(name)
        import contextlib
        return contextlib.nullcontext()

    before = compute_log_probs(model, data, plan, args)
    data = dict(data, log_probs=before, ref_log_probs=before, rollout_log_probs=before)
    first = train_one_step(model, optimizer, scheduler, data, plan, args, collective_hook=hook)
    after = compute_log_probs(model, data, plan, args)
    no_loss = dict(data, loss_masks=[[0] * len(m) for m in data["loss_masks"]])
    (empty_plan,) = plans_for_this_rank(no_loss, args)
    skipped = train_one_step(model, optimizer, scheduler, no_loss, empty_plan, args)
    return dict(first=first, skipped=skipped, phases=phases, before=before, after=after)


@pytest.mark.timeout(120)
def test_step_updates_weights_and_zero_loss_tokens_skip(tiny_hf_dir, rollout):
    (out,) = run_ranks(_train_twice_child, 1, args=(tiny_hf_dir, rollout), timeout_s=100)
    first = out["first"]
    assert not first.skipped and math.isfinite(first.loss) and first.grad_norm > 0
    assert first.loss_token_total == sum(sum(m) for m in rollout["loss_masks"])
    assert out["phases"] == ["actor_train/loss_token_total", "actor_train/forward_backward",
                             "actor_train/grad_reduce", "actor_train/metrics", "actor_train/optimizer"]
    moved = max(abs(a - b) for x, y in zip(out["before"], out["after"]) for a, b in zip(x, y))
    assert moved > 1e-4
    assert out["skipped"].skipped and out["skipped"].loss_token_total == 0
