"""`python train.py` as a user runs it, from the tests: the run, its metrics file, its stop line.

    proc, seconds = run_train(flags, timeout_s=600)
    events = read_events(path_to_metrics_jsonl)     # {"train": [...], "weight_sync": [...], ...}
    assert_named_stop(proc, phase=r"actor_train/plan", rank=3, fence_timeout_s=30, tables=0)
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from slime.utils.deadlines import DeadlineModel

ROOT = Path(__file__).resolve().parents[1]


def train_env(env_extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a train.py run started by a test: offline, one thread per process, the test process's
    shared Ray cluster (tests/ray_cluster.py), and no fault unless env_extra names one."""
    from ray_cluster import shared_cluster_address

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "RAY_ADDRESS": shared_cluster_address()}
    env.pop("SLIME_FAULT_INJECT", None)
    return {**env, **(env_extra or {})}


# A run's own private Ray cluster, as `python train.py` starts by default, instead of the worker's shared one: for
# the runs that, late in CI's suite, had Ray cancel the rollout manager before it ran on every start while
# joined to the shared cluster (the SFT and Qwen3.5 learning runs; the cause is not found, a run that owns its
# cluster never showed it).
PRIVATE_CLUSTER = {"RAY_ADDRESS": "local"}


def run_train(flags: list[str], *, timeout_s: float, env_extra: dict[str, str] | None = None):
    """One train.py process in train_env(env_extra)."""
    env = train_env(env_extra)
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


def log_time(output: str, marker: str) -> float:
    """The timestamp of the first log line holding `marker`."""
    line = next(line for line in output.splitlines() if marker in line)
    stamp = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", line).group(0)
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def assert_named_stop(proc: subprocess.CompletedProcess, *, phase: str, rank: int, fence_timeout_s: float,
                      tables: int) -> None:
    """The run failed with one readable 'training stopped' line naming the phase (a regex) and the rank,
    the ledger dir and the rank's traceback, `tables` hang tables, before the communicators' own timeout
    could have ended it: the watchdog, not gloo or NCCL, stopped the run (its window is the fence timeout;
    the group timeout sits minutes above it, so a loaded machine cannot blur the two)."""
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"the run exited 0\n{output[-3000:]}"
    summary = [line for line in output.splitlines() if "training stopped:" in line]
    assert summary, f"no 'training stopped' line\n{output[-3000:]}"
    assert re.search(phase, summary[0]), summary[0]
    assert re.search(rf"\b{rank}\b", summary[0]), f"rank {rank} not named: {summary[0]}"
    assert "(ledger dir " in summary[0], summary[0]
    assert "traceback:\nTraceback" in output or " exited: " in summary[0], output[-3000:]
    assert output.count("rank  verdict  phase") == tables, output[-3000:]
    took = log_time(output, "training stopped:") - log_time(output, "Timer actor_train start")
    group_timeout_s = DeadlineModel(no_progress_s=fence_timeout_s).group_timeout
    assert took < group_timeout_s, f"took {took:.0f}s, the communicators' timeout is {group_timeout_s:.0f}s"
