"""`python train.py` end to end on the embedded default, as a user runs it.

One run of the seed's configuration scaled to CPU (8 ranks = TP2 x SP x CP4, colocate, dynamic
batches, per-token loss, the project's router, one embedded engine per rank) records its rollout;
replays of that rollout then check layout invariance (1 rank vs 8 ranks) and that every injected
hang class ends the run with a named error instead of a hang.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SEED_LAYOUT = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "4", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "96", "--calculate-per-token-loss",
    "--use-slime-router", "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.7",
]
ONE_RANK_LAYOUT = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "384", "--calculate-per-token-loss",
]


def common_flags(assets: dict[str, Path]) -> list[str]:
    return [
        "--hf-checkpoint", str(assets["checkpoint"]),
        "--prompt-data", str(assets["prompts"]), "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rm-type", "math",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "1",
        "--rollout-max-response-len", "12", "--advantage-estimator", "grpo",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.001",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--lr", "1e-4", "--seed", "1234",
    ]


def run_train(flags: list[str], *, timeout_s: float, env_extra: dict[str, str] | None = None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    if not env_extra:
        env.pop("SLIME_FAULT_INJECT", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    return proc, time.monotonic() - start


def read_events(path: Path) -> dict[str, list[dict]]:
    events: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        event = json.loads(line)
        events.setdefault(event["event"], []).append(event)
    return events


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from slime.tools.demo_prompts import write_prompts
    from slime.tools.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("e2e")
    checkpoint = write_tiny_checkpoint(root / "tiny-qwen3")
    prompts = root / "prompts.jsonl"
    write_prompts(prompts, n=16, seed=0)
    return {"root": root, "checkpoint": Path(checkpoint), "prompts": prompts}


@pytest.fixture(scope="module")
def seed_run(assets) -> dict:
    """The seed's flags scaled to CPU, 3 rollouts; records every rollout for the replays."""
    metrics = assets["root"] / "metrics.jsonl"
    replay = assets["root"] / "rollout_{rollout_id}.pt"
    proc, _ = run_train([*common_flags(assets), *SEED_LAYOUT, "--num-rollout", "3",
                         "--metrics-jsonl", str(metrics), "--save-debug-rollout-data", str(replay),
                         "--fence-timeout", "120"], timeout_s=900)
    return {"proc": proc, "metrics": metrics, "replay": replay}


@pytest.mark.timeout(960)
def test_seed_configuration_trains_every_rollout(seed_run):
    proc = seed_run["proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = read_events(seed_run["metrics"])
    train, sync = events.get("train", []), events.get("weight_sync", [])
    assert [e["rollout_id"] for e in train] == [0, 1, 2]
    for event in train:
        assert math.isfinite(event["train/loss"])
        assert event["train/grad_norm"] > 0
    # The first push (before rollout 0) carries the trainer's loaded weights; then one per rollout.
    assert [(e["rollout_id"], e["weight_sync/version"]) for e in sync] == [(-1, 0), (0, 1), (1, 2), (2, 3)]
    assert all(e["weight_sync/bytes"] > 0 for e in sync)
    # Colocated: the trainer sleeps (freeing its parameters and optimizer state) after every train.
    memory = [e for e in events.get("memory", []) if "memory/trainer_offloaded_gb" in e]
    assert [e["rollout_id"] for e in memory] == [-1, 0, 1, 2]
    assert all(e["memory/trainer_offloaded_gb"] > 0 for e in memory)


def replay_flags(assets, seed_run, layout: list[str], *, fence_timeout: int = 120) -> list[str]:
    return [*common_flags(assets), *layout, "--num-rollout", "1", "--debug-train-only",
            "--load-debug-rollout-data", str(seed_run["replay"]), "--fence-timeout", str(fence_timeout)]


@pytest.mark.timeout(900)
def test_replayed_rollout_gives_same_first_step_on_one_and_eight_ranks(assets, seed_run, tmp_path):
    assert seed_run["proc"].returncode == 0, "the recording run failed"
    results = {}
    for name, layout in (("one", ONE_RANK_LAYOUT), ("eight", SEED_LAYOUT)):
        metrics = tmp_path / f"{name}.jsonl"
        proc, _ = run_train([*replay_flags(assets, seed_run, layout), "--metrics-jsonl", str(metrics)],
                            timeout_s=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[name] = read_events(metrics)["train"][0]
    for key in ("train/loss", "train/grad_norm"):
        one, eight = results["one"][key], results["eight"][key]
        assert eight == pytest.approx(one, rel=1e-3), f"{key}: 1 rank {one}, 8 ranks {eight}"


# kind: the phase the error must name. One stall (a rank that skips a collective: the watchdog's table)
# and one divergence (a rank with another plan: the fence's field table) through train.py and its driver;
# every kind, these and the communicator-warm-up stall, the logging stall and the extra metric key, also
# runs on the real step's 8 gloo ranks in tests/test_distributed_faults.py and tests/test_distributed_fence.py.
FAULTS = {
    "diverge_plan": r"actor_train/plan",
    "skip_collective": r"actor_train/step\d+/|loss_token_total|forward_backward",
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_injected_fault_ends_run_with_named_error(assets, seed_run, kind):
    fence_timeout = 30
    proc, elapsed = run_train(replay_flags(assets, seed_run, SEED_LAYOUT, fence_timeout=fence_timeout),
                              timeout_s=480, env_extra={"SLIME_FAULT_INJECT": f"{kind}@3#0"})
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"{kind}: the run exited 0\n{output[-3000:]}"
    summary = [line for line in output.splitlines() if "training stopped:" in line]
    assert summary, f"{kind}: no 'training stopped' line\n{output[-3000:]}"
    assert re.search(FAULTS[kind], summary[0]), summary[0]
    assert re.search(r"\b3\b", summary[0]), f"{kind}: rank 3 not named: {summary[0]}"
    # readable: the ledger dir in the last line, the rank's traceback, and one table (after a stall)
    assert "(ledger dir " in summary[0], summary[0]
    assert "traceback:\nTraceback" in output or " exited: " in summary[0], output[-3000:]
    tables = output.count("rank  verdict  phase")
    assert tables == (0 if kind == "diverge_plan" else 1), f"{kind}: {tables} tables"
    # From the start of actor_train to the error: within about twice the fence timeout.
    started = _log_time(output, "Timer actor_train start")
    stopped = _log_time(output, "training stopped:")
    assert stopped - started < 2 * fence_timeout + 20, f"{kind}: took {stopped - started:.0f}s"


def _log_time(output: str, marker: str) -> float:
    from datetime import datetime

    line = next(line for line in output.splitlines() if marker in line)
    stamp = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", line).group(0)
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.mark.timeout(600)
def test_recreated_process_groups_train_after_every_wake(assets, seed_run, tmp_path):
    """Upstream's colocate behaviour: groups destroyed at sleep, re-created and warmed at wake; the
    model and optimizer follow the new groups and the next rollouts train."""
    assert seed_run["proc"].returncode == 0, "the recording run failed"
    metrics = tmp_path / "metrics.jsonl"
    flags = replay_flags(assets, seed_run, SEED_LAYOUT)
    flags[flags.index("--num-rollout") + 1] = "3"
    proc, _ = run_train([*flags, "--recreate-process-groups-on-wake", "--metrics-jsonl", str(metrics)],
                        timeout_s=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    train = read_events(metrics)["train"]
    assert [e["rollout_id"] for e in train] == [0, 1, 2]
    assert all(e["perf/wake_create_groups_s"] > 0 for e in train[1:])  # re-created, not kept
    assert all(math.isfinite(e["train/loss"]) and e["train/grad_norm"] > 0 for e in train)
