"""The standing proof that weight sync works: the engines' log-probs of what they generate match the trainer's.

`python train.py` on the embedded default in fp32: 2 CPU ranks (TP2 + SP, --colocate, one engine per rank), the
learnable demo's counting task, sampled at temperature 0.8 with top-p 0.9 (engine and trainer must agree on the
tempered distribution). What is measured, per rollout k: train/train_rollout_logprob_abs_diff, the mean over the
rollout's loss tokens of |log-prob the engine reported for the token it sampled - log-prob of that token under the
trainer's old policy|. The engines generated rollout k with the weights pushed after rollout k-1 (rollout 0: those
pushed at start); the trainer's old policy is its weights after training on rollout k-1. So the diff
is numerical noise when every push delivered the trainer's weights, and large when one did not.

healthy  5 rollouts (the push at start, then 4 weight syncs that rollouts 1-4 are judged after): every diff
         <= 1e-4; every sample of rollout k carries weight_version k (rollout 0: version 0, pushed at
         start), read from the recorded rollouts.
faulty   the same run with SLIME_FAULT_INJECT=skip_weight_push@0#1,corrupt_weight_push@0#2 and the weight-sync
         proof off (--no-weight-sync-proof; on, it stops the run at the first such push, naming engine, tensor
         and version: tests/test_update_weight.py): the push after rollout 1 sends no tensors, the one after
         rollout 2 sends them with noise. The versions still move (so the version check passes), but rollouts 2
         and 3 show a diff >= 100 x the healthy run's largest, and rollout 4 (after a clean push) is back to noise.
The healthy run's every sync also ran the proof over every tensor the engines serve. It is also the end-to-end
run of the project's router with colocated engines (docs/rollout-stack.md): one router, two engines that took
every push through the shared-memory tensor payload, the run's key in no log.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from train_runs import assert_key_reaches_no_log, run_train, write_run_assets

pytestmark = pytest.mark.e2e

NUM_ROLLOUTS = 5
RUN_TIMEOUT_S = 480
AGREEMENT = 1e-4  # fp32, 2 ranks: measured ~1e-7 (see the CHANGELOG)
BROKEN_FACTOR = 100.0
FAULTS = "skip_weight_push@0#1,corrupt_weight_push@0#2"
BROKEN_ROLLOUTS = (2, 3)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from slime.tools.tiny_checkpoint import TinyQwen3Spec

    return write_run_assets(tmp_path_factory.mktemp("logprob"), TinyQwen3Spec(alphabet="0123456789"), prompts=64,
                            task="counting")


def train_flags(assets: dict[str, Path], name: str) -> list[str]:
    out = assets["root"] / name
    return [
        "--hf-checkpoint", str(assets["checkpoint"]),
        "--prompt-data", str(assets["prompts"]), "--input-key", "prompt", "--label-key", "label",
        "--rollout-shuffle", "--custom-rm-path", "examples.counting_reward.reward",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--colocate",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256", "--calculate-per-token-loss",
        "--use-slime-router", "--rollout-num-gpus-per-engine", "1",
        "--num-rollout", str(NUM_ROLLOUTS), "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--num-steps-per-rollout", "1", "--rollout-max-response-len", "3",
        "--rollout-temperature", "0.8", "--rollout-top-p", "0.9",
        "--advantage-estimator", "grpo", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--optimizer", "adam", "--lr", "3e-3", "--seed", "7", "--fence-timeout", "120",
        "--metrics-jsonl", str(out / "metrics.jsonl"), "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.pt"),
    ]


def run_and_read(assets: dict[str, Path], name: str, faults: str | None) -> dict:
    out = assets["root"] / name
    flags = [*train_flags(assets, name), "--ledger-dir", str(out / "ledger")]  # the engines' and router's logs
    if faults:
        flags.append("--no-weight-sync-proof")  # what the proof would stop at once
    proc, _ = run_train(flags, timeout_s=RUN_TIMEOUT_S, env_extra={"SLIME_FAULT_INJECT": faults} if faults else None)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = {e["rollout_id"]: e for e in events if e["event"] == "train"}
    recorded = {k: torch.load(out / f"rollout_{k}.pt", weights_only=False)["samples"] for k in range(NUM_ROLLOUTS)}
    return {"proc": proc, "out": out, "train": train,
            "diff": {k: train[k]["train/train_rollout_logprob_abs_diff"] for k in sorted(train)},
            "versions": {k: [s["weight_versions"] for s in samples] for k, samples in recorded.items()},
            "syncs": [e for e in events if e["event"] == "weight_sync"]}


@pytest.fixture(scope="module")
def healthy(assets) -> dict:
    return run_and_read(assets, "healthy", None)


@pytest.fixture(scope="module")
def faulty(assets) -> dict:
    return run_and_read(assets, "faulty", FAULTS)


def expected_version(rollout_id: int) -> str:
    """The sync after rollout k pushes version k + 1; the one at start (k = -1) version 0."""
    return str(rollout_id)


@pytest.mark.timeout(600)
def test_engines_and_trainer_agree_after_every_weight_sync(healthy):
    assert sorted(healthy["diff"]) == list(range(NUM_ROLLOUTS))
    assert [e["weight_sync/version"] for e in healthy["syncs"]] == list(range(NUM_ROLLOUTS + 1))
    # the weight-sync proof compared every tensor each engine serves with the trainer's, after every push
    compared = [e["weight_sync/proof_tensors"] for e in healthy["syncs"]]
    assert len(set(compared)) == 1 and compared[0] > 0, compared
    for rollout_id, diff in healthy["diff"].items():
        assert 0.0 <= diff <= AGREEMENT, f"rollout {rollout_id}: diff {diff}"


@pytest.mark.timeout(600)
def test_every_sample_of_rollout_k_carries_the_version_pushed_after_rollout_k_minus_1(healthy):
    for rollout_id, versions in healthy["versions"].items():
        assert versions and all(v == [expected_version(rollout_id)] for v in versions), (rollout_id, versions)


@pytest.mark.timeout(600)
def test_the_project_router_served_two_colocated_engines_that_took_every_push(healthy):
    logs = sorted((healthy["out"] / "ledger" / "engine-logs").iterdir())
    routers = [p for p in logs if p.name.startswith("slime-router-")]
    engines = [p for p in logs if p.name.startswith("embedded-engine-")]
    assert len(routers) == 1 and len(engines) == 2, [p.name for p in logs]
    for engine in engines:  # each engine took every push, the last one included
        text = engine.read_text()
        assert "updated" in text and f"weight_version={NUM_ROLLOUTS}" in text, engine.name
    assert all(e["weight_sync/bytes"] > 0 and e["weight_sync/send_seconds"] > 0 for e in healthy["syncs"])
    assert all(math.isfinite(e["train/loss"]) for e in healthy["train"].values())


@pytest.mark.timeout(600)
def test_the_run_key_reaches_no_log(healthy):
    """The project's router and the tensor transport authenticate with the run's key (tests/conftest.py)."""
    assert_key_reaches_no_log(healthy["proc"], healthy["out"])


@pytest.mark.timeout(900)
def test_a_skipped_or_corrupted_push_shows_in_the_diff_though_the_versions_move(healthy, faulty):
    worst_healthy = max(healthy["diff"].values())
    for rollout_id, diff in faulty["diff"].items():
        if rollout_id in BROKEN_ROLLOUTS:
            assert diff >= BROKEN_FACTOR * worst_healthy and diff > AGREEMENT, (
                f"rollout {rollout_id}: broken push gives diff {diff}, healthy runs reach {worst_healthy}")
        else:
            assert diff <= AGREEMENT, f"rollout {rollout_id}: diff {diff} after a clean push"
    # the faults are silent to the version check: every sample still reports the version just pushed
    assert faulty["versions"] == healthy["versions"]
    assert [e["weight_sync/version"] for e in faulty["syncs"]] == list(range(NUM_ROLLOUTS + 1))
    assert not any("weight_sync/proof_tensors" in e for e in faulty["syncs"])  # --no-weight-sync-proof
