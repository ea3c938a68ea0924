"""Upstream's geo3k VLM job learns on a gated DeltaNet hybrid with its vision tower: examples/run_cpu_geo3k_vlm.sh
(upstream's geo3k flags) on 4 CPU ranks as TP2 x SP x CP2 x EP2, a random-init tiny Qwen3.5-MoE with images (one
DeltaNet and one gated attention layer, 4 experts top-2 and a gated shared expert per layer, a 2-block vision tower
trained with it) on the square-counting pictures (--colocate, dynamic batches, per-token loss; the DeltaNet's
recurrence crosses the CP ranks, the experts are spread over the expert-parallel ranks, the images' features enter
before the sequence-parallel split and multimodal RoPE's three rows reach every CP rank).

As tests/test_learning_demo.py asks of the dense model: the mean reward of the last 3 rollouts is well above
rollout 0's (measured +0.43: the model learns to answer with a digit near the counts; that it reads the squares
needs longer runs), after every weight sync the engine (transformers' Qwen3_5MoeForConditionalGeneration, served
the pushed weights with the same images) gives the trainer's log-probs in fp32, and the run's recorded collectives
pass the order proof. The evaluation with images runs at the start and every 10 rollouts.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from safetensors import safe_open
from test_learning_demo import MIN_RISE, NUM_ROLLOUTS
from train_runs import PRIVATE_CLUSTER, ROOT, assert_reward_rises, run_script, series

pytestmark = pytest.mark.e2e

SEED = 1234
# trainer vs engine (transformers' composite class after the push, with the images), fp32 on CPU; measured ~1.5e-7
AGREEMENT = 1e-6
# ~150 s of training on 2 loaded cores (2m31s measured), plus start-up: the deadline is for a hang
RUN_TIMEOUT_S = 800


@pytest.fixture(scope="module")
def geo3k_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("geo3k_vlm")
    ledger = out / "ledger"
    extra = ("--context-parallel-size", "2", "--ledger-dir", str(ledger), "--ledger-record-sequence")
    events = run_script("run_cpu_geo3k_vlm.sh", out, timeout_s=RUN_TIMEOUT_S, num_rollout=NUM_ROLLOUTS, extra=extra,
                        env_extra={"SEED": str(SEED), "EVAL_INTERVAL": "10", **PRIVATE_CLUSTER})["events"]
    with safe_open(str(out / f"squares-vl-moe-seed{SEED}" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    return {"events": events, "ledger": ledger, "checkpoint_names": names}


@pytest.mark.timeout(RUN_TIMEOUT_S + 40)
def test_qwen3_5_moe_with_images_learns_under_tp2_sp_cp2_ep2(geo3k_run):
    events = geo3k_run["events"]
    assert_reward_rises(series(events, "rollout", "rollout/raw_reward"), NUM_ROLLOUTS, MIN_RISE)
    diffs = series(events, "train", "train/train_rollout_logprob_abs_diff")
    assert len(diffs) == NUM_ROLLOUTS and all(0.0 <= d <= AGREEMENT for d in diffs), diffs
    assert series(events, "weight_sync", "weight_sync/version") == list(range(NUM_ROLLOUTS + 1))
    assert len(series(events, "eval", "eval/squares")) == 3  # rollouts 0, 10 and 20
    # the weight-sync proof compared every tensor the engine serves, the vision tower's included, after every push
    names = geo3k_run["checkpoint_names"]
    compared = series(events, "weight_sync", "weight_sync/proof_tensors")
    assert any(name.startswith("model.visual.") for name in names)
    assert len(compared) == NUM_ROLLOUTS + 1 and set(compared) == {len(names)}, (compared, len(names))


@pytest.mark.timeout(RUN_TIMEOUT_S + 40)
def test_the_order_proof_holds_with_the_vision_tower(geo3k_run):
    proof = subprocess.run([sys.executable, "-m", "slime.distributed.order_proof", str(geo3k_run["ledger"])],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proof.returncode == 0, proof.stdout + proof.stderr
