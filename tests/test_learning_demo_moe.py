"""examples/run_cpu_demo_moe.sh learns as the dense demo does: a random-init tiny Qwen3-MoE (8 experts, top-2)
on 8 CPU ranks as TP2 x SP x EP4 (experts over 4 expert-parallel ranks, alltoall dispatcher with uneven
per-rank token counts), --colocate, dynamic batch, per-token loss, 20 rollouts of the counting task.

Checks, as tests/test_learning_demo.py does for the dense model: the reward of the last 3 rollouts is well
above rollout 0's (target +0.3, the test asks +0.25 against sampling noise), and after every weight sync the
engines' log-probs (transformers' Qwen3MoeForCausalLM, all experts pushed from the EP ranks) agree with the
trainer's in fp32.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_learning_demo import AGREEMENT, MIN_RISE, NUM_ROLLOUTS, _series

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def moe_demo(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("demo_moe")
    env = {**os.environ, "OUT": str(out), "NUM_ROLLOUT": str(NUM_ROLLOUTS), "PY": sys.executable}
    env.pop("SLIME_FAULT_INJECT", None)
    proc = subprocess.run(["bash", str(ROOT / "examples" / "run_cpu_demo_moe.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"out": out, "stdout": proc.stdout, "events": events}


@pytest.mark.timeout(880)
def test_moe_reward_rises_from_random_weights(moe_demo):
    rewards = _series(moe_demo["events"], "rollout", "rollout/raw_reward")
    assert len(rewards) == NUM_ROLLOUTS
    rise = sum(rewards[-3:]) / 3 - rewards[0]
    assert rise >= MIN_RISE, f"rewards {[round(r, 3) for r in rewards]}"


@pytest.mark.timeout(880)
def test_every_moe_weight_sync_is_confirmed_by_the_log_probs(moe_demo):
    diffs = _series(moe_demo["events"], "train", "train/train_rollout_logprob_abs_diff")
    assert len(diffs) == NUM_ROLLOUTS and all(0.0 <= d <= AGREEMENT for d in diffs), diffs
    assert _series(moe_demo["events"], "weight_sync", "weight_sync/version") == list(range(NUM_ROLLOUTS + 1))
