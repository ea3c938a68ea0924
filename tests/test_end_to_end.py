"""`python train.py` end to end on the embedded default, as a user runs it.

The session's #1487 recording (conftest.py: upstream #1487's configuration scaled to CPU, 8 ranks = TP2 x SP x
CP4, colocate, dynamic batches, per-token loss, the project's router, one embedded engine over the 8 GPUs)
must train every rollout; a replay of its first rollout then checks that a rank with another plan ends the
run with a named error instead of a hang (the rank that skips a collective is the order proof's fault run,
tests/test_order_proof.py). That upstream #1487's layout computes what one process does (loss, grad norm and
log-probs of the same step, both loss normalisations, 1e-5) is tests/test_layout_invariance.py's, on the
real megatron step without a run around it.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import ISSUE_RECORDING_TIMEOUT_S
from train_runs import assert_named_stop, read_events, run_train

from slime.tools.record_step_sequence import RUN, ISSUE_LAYOUT

pytestmark = pytest.mark.e2e

# The plan fault replays the recording on 4 ranks, TP2 x SP x CP2 with the recording's tokens per micro-batch
# (96 x CP2 = 48 x CP4): the fault reaches the same fence with half the ranks to start. No engines run
# (--debug-train-only), but an engine may not span more GPUs than the 4 ranks hold.
FAULT_REPLAY_LAYOUT = ["--actor-num-gpus-per-node", "4", "--context-parallel-size", "2", "--max-tokens-per-gpu", "96",
                       "--rollout-num-gpus-per-engine", "1"]


def replay_flags(recording: dict, layout, metrics: Path, *, fence_timeout: int = 120) -> list[str]:
    """Train once on the recording's first rollout (no engines), with the recording's model and flags."""
    out = recording["out"]
    return ["--hf-checkpoint", str(out / "tiny-qwen3"), "--prompt-data", str(out / "prompts.jsonl"),
            *layout, *RUN, "--num-rollout", "1", "--debug-train-only",
            "--load-debug-rollout-data", str(recording["replay"]), "--fence-timeout", str(fence_timeout),
            "--metrics-jsonl", str(metrics)]


@pytest.mark.timeout(ISSUE_RECORDING_TIMEOUT_S + 60)
def test_issue_configuration_trains_every_rollout(issue_recording):
    proc = issue_recording["proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = read_events(issue_recording["metrics"])
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
def test_rank_with_another_plan_ends_run_with_named_error(issue_recording, tmp_path):
    """diverge_plan@3: rank 3 claims another micro-batch plan. The plan fence stops every rank with the
    field table (no hang table), naming rank 3 and the phase, through train.py and its driver (the recording
    replayed on 4 ranks, TP2 x SP x CP2). Every hang class also runs on the product's own step on forked
    gloo ranks (tests/test_step_faults.py)."""
    fence_timeout = 30
    proc, _ = run_train(replay_flags(issue_recording, [*ISSUE_LAYOUT, *FAULT_REPLAY_LAYOUT], tmp_path / "metrics.jsonl",
                                     fence_timeout=fence_timeout),
                        timeout_s=480, env_extra={"SLIME_FAULT_INJECT": "diverge_plan@3#0"})
    assert_named_stop(proc, phase=r"actor_train/plan", rank=3, fence_timeout_s=fence_timeout, tables=0)
