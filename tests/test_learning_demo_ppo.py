"""PPO with a critic learns the demo task: examples/run_cpu_demo.sh with --advantage-estimator ppo at TP2 x SP x CP2
(4 actor ranks and 4 critic ranks on the same bundles, --colocate, 20 rollouts of the counting task from random
weights; the critic starts from the actor's checkpoint with a zero head, --num-critic-only-steps 2, and takes its
learning rate from the critic entry of --megatron-config-path).

One run (~70-80 s on 2 cores; measured +0.33 over rollout 0, the critic's value loss from 0.6 at rollout 1 to
0.03, the engines' and the trainer's log-probs within 1.4e-7) checks that the mean reward of the last 3 rollouts is
well above rollout 0's (target +0.3, asked +0.25 against sampling noise, as the GRPO demo's test does), that the
critic trained every rollout and the actor only after the critic-only rollouts (no weight push then), that the
engines' and the trainer's log-probs agree after every weight push, and that the order proof holds for both roles'
recorded collectives.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from test_learning_demo import AGREEMENT, MIN_RISE, NUM_ROLLOUTS, _series, run_demo_script
from train_runs import ROOT

pytestmark = pytest.mark.e2e

CRITIC_ONLY = 2
CRITIC_LR = 1e-2
LAYOUT = ("--actor-num-gpus-per-node", "4", "--context-parallel-size", "2", "--rollout-num-gpus-per-engine", "4")


@pytest.fixture(scope="module")
def ppo_demo(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("demo_ppo")
    ledger = out / "ledger"
    roles = out / "roles.yaml"  # upstream's per-role Megatron config: the critic's own rate
    roles.write_text(f"megatron:\n  - {{name: default, role: critic, overrides: {{lr: {CRITIC_LR}}}}}\n")
    return {**run_demo_script("run_cpu_demo.sh", out, 600, extra=(
        *LAYOUT, "--advantage-estimator", "ppo", "--critic-load", str(out / "counting-model-seed1234"),
        "--megatron-config-path", str(roles), "--num-critic-only-steps", str(CRITIC_ONLY), "--normalize-advantages",
        "--ledger-dir", str(ledger), "--ledger-record-sequence")), "ledger": ledger}


@pytest.mark.timeout(640)
def test_ppo_reward_rises_from_random_weights(ppo_demo):
    rewards = _series(ppo_demo["events"], "rollout", "rollout/raw_reward")
    assert len(rewards) == NUM_ROLLOUTS
    rise = sum(rewards[-3:]) / 3 - rewards[0]
    assert rise >= MIN_RISE, f"rewards {[round(r, 3) for r in rewards]}"


@pytest.mark.timeout(640)
def test_the_critic_trains_every_rollout_and_the_actor_after_the_critic_only_ones(ppo_demo):
    events = ppo_demo["events"]
    value_loss = _series(events, "train", "critic/value_loss")
    assert len(value_loss) == NUM_ROLLOUTS and all(v >= 0.0 for v in value_loss)
    assert set(_series(events, "train", "critic/lr")) == {CRITIC_LR}  # --megatron-config-path's critic entry
    trained = sorted(e["rollout_id"] for e in events if e["event"] == "train" and "train/loss" in e)
    assert trained == list(range(CRITIC_ONLY, NUM_ROLLOUTS))
    diffs = [e["train/train_rollout_logprob_abs_diff"] for e in events if "train/train_rollout_logprob_abs_diff" in e]
    assert len(diffs) == NUM_ROLLOUTS - CRITIC_ONLY and all(0.0 <= d <= AGREEMENT for d in diffs), diffs
    # the first push at start, then one after every rollout the actor trained
    assert _series(events, "weight_sync", "weight_sync/version") == [0, *range(CRITIC_ONLY + 1, NUM_ROLLOUTS + 1)]


@pytest.mark.timeout(640)
def test_the_order_proof_holds_for_the_actor_and_the_critic(ppo_demo):
    proof = subprocess.run([sys.executable, "-m", "slime.distributed.order_proof", str(ppo_demo["ledger"])],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proof.returncode == 0, proof.stdout + proof.stderr
    assert "actor: " in proof.stdout and "critic: " in proof.stdout
