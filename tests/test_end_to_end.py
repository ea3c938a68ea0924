"""`python train.py` end to end on the embedded default, as a user runs it.

The session's seed recording (conftest.py: the seed's configuration scaled to CPU, 8 ranks = TP2 x SP x
CP4, colocate, dynamic batches, per-token loss, the project's router, one embedded engine over the 8 GPUs)
must train every rollout; replays of its first rollout then check layout invariance (1 rank gives
what the 8 ranks computed) and that a rank with another plan ends the run with a named error instead
of a hang (the rank that skips a collective is the order proof's fault run, tests/test_order_proof.py).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import SEED_RECORDING_TIMEOUT_S
from train_runs import assert_named_stop, read_events, run_train

from slime.tools.record_step_sequence import RUN, SEED_LAYOUT

pytestmark = pytest.mark.e2e

# The plan fault replays the recording on 4 ranks, TP2 x SP x CP2 with the recording's tokens per micro-batch
# (96 x CP2 = 48 x CP4): the fault reaches the same fence with half the ranks to start. No engines run
# (--debug-train-only), but an engine may not span more GPUs than the 4 ranks hold.
FAULT_REPLAY_LAYOUT = ["--actor-num-gpus-per-node", "4", "--context-parallel-size", "2", "--max-tokens-per-gpu", "96",
                       "--rollout-num-gpus-per-engine", "1"]
# The recording's budget is 48 tokens per GPU: 48 x CP4 per micro-batch, the same micro-batches on one rank.
ONE_RANK_LAYOUT = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "192", "--calculate-per-token-loss",
]


def replay_flags(recording: dict, layout, metrics: Path, *, fence_timeout: int = 120) -> list[str]:
    """Train once on the recording's first rollout (no engines), with the recording's model and flags."""
    out = recording["out"]
    return ["--hf-checkpoint", str(out / "tiny-qwen3"), "--prompt-data", str(out / "prompts.jsonl"),
            *layout, *RUN, "--num-rollout", "1", "--debug-train-only",
            "--load-debug-rollout-data", str(recording["replay"]), "--fence-timeout", str(fence_timeout),
            "--metrics-jsonl", str(metrics)]


@pytest.mark.timeout(SEED_RECORDING_TIMEOUT_S + 60)
def test_seed_configuration_trains_every_rollout(seed_recording):
    proc = seed_recording["proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = read_events(seed_recording["metrics"])
    train, sync = events.get("train", []), events.get("weight_sync", [])
    assert [e["rollout_id"] for e in train] == [0, 1]
    for event in train:
        assert math.isfinite(event["train/loss"])
        assert event["train/grad_norm"] > 0
    # The first push (before rollout 0) carries the trainer's loaded weights; then one per rollout.
    assert [(e["rollout_id"], e["weight_sync/version"]) for e in sync] == [(-1, 0), (0, 1), (1, 2)]
    assert all(e["weight_sync/bytes"] > 0 for e in sync)
    # Colocated: the trainer sleeps (freeing its parameters and optimizer state) after every train.
    memory = [e for e in events.get("memory", []) if "memory/trainer_offloaded_gb" in e]
    assert [e["rollout_id"] for e in memory] == [-1, 0, 1]
    assert all(e["memory/trainer_offloaded_gb"] > 0 for e in memory)


@pytest.mark.timeout(600)
def test_replayed_rollout_on_one_rank_gives_the_eight_rank_steps(seed_recording, tmp_path):
    """Layout invariance: the recording's first rollout, trained again on one rank from the same checkpoint,
    gives the loss and grad norm its 8 ranks (TP2 x SP x CP4) computed (a replay on 8 ranks equals the
    recording exactly: same checkpoint, same data, same seed)."""
    assert seed_recording["proc"].returncode == 0, "the recording run failed"
    eight = read_events(seed_recording["metrics"])["train"][0]
    metrics = tmp_path / "one.jsonl"
    proc, _ = run_train(replay_flags(seed_recording, ONE_RANK_LAYOUT, metrics), timeout_s=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = read_events(metrics)["train"][0]
    assert one["train/num_steps"] == eight["train/num_steps"] == 2
    for key in ("train/loss", "train/grad_norm", "train/kl_loss", "train/entropy_loss"):
        assert eight[key] == pytest.approx(one[key], rel=1e-3), f"{key}: 1 rank {one[key]}, 8 ranks {eight[key]}"


@pytest.mark.timeout(600)
def test_rank_with_another_plan_ends_run_with_named_error(seed_recording, tmp_path):
    """diverge_plan@3: rank 3 claims another micro-batch plan. The plan fence stops every rank with the
    field table (no hang table), naming rank 3 and the phase, through train.py and its driver (the recording
    replayed on 4 ranks, TP2 x SP x CP2). Every fault kind also runs on the real step's 8 gloo ranks
    (tests/test_distributed_faults.py, tests/test_distributed_fence.py)."""
    fence_timeout = 30
    proc, _ = run_train(replay_flags(seed_recording, [*SEED_LAYOUT, *FAULT_REPLAY_LAYOUT], tmp_path / "metrics.jsonl",
                                     fence_timeout=fence_timeout),
                        timeout_s=480, env_extra={"SLIME_FAULT_INJECT": "diverge_plan@3#0"})
    assert_named_stop(proc, phase=r"actor_train/plan", rank=3, fence_timeout_s=fence_timeout, tables=0)
