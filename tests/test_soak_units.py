"""benchmarks/soak.py's bookkeeping: which rollouts finished, who a process is, how much it grew."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import soak  # noqa: E402


def test_finished_rollouts_reads_only_complete_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    events = [{"event": "weight_sync", "rollout_id": -1}, {"event": "train", "rollout_id": 0},
              {"event": "weight_sync", "rollout_id": 0}]
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "weight_sy')
    ids, offset = soak.finished_rollouts(path, 0)
    assert ids == [0]
    with open(path, "a") as f:
        f.write('nc", "rollout_id": 1}\n')
    assert soak.finished_rollouts(path, offset)[0] == [1]


def test_roles_from_command_lines():
    assert soak.role_of("ray::TrainRayActor.train") == "rank"
    assert soak.role_of("python -m slime.backends.embedded_engine.server --model-path m --port 4001") == "engine"
    assert soak.role_of("python -m sglang_router.launch_router --port 5") == "router"
    assert soak.role_of("/venv/bin/python train.py --hf-checkpoint x") == "driver"
    assert soak.role_of("/ray/core/src/ray/raylet/raylet --node") == "ray"


def test_this_process_is_sampled():
    [me] = [p for p in soak.sample_tree(os.getpid()) if p.pid == os.getpid()]
    assert me.rss_mb > 1 and me.open_files > 0 and me.threads >= 1


def _sample(rollout_id: int, at_s: float, rss: dict[str, float]) -> soak.RolloutSample:
    processes = [soak.ProcessSample(pid=i, role=name.split(":")[0], name=name, rss_mb=mb, open_files=10, threads=4)
                 for i, (name, mb) in enumerate(rss.items())]
    return soak.RolloutSample(rollout_id, at_s, processes)


def test_growth_is_measured_from_the_baseline_rollout():
    samples = [_sample(r, 10.0 * (r + 1), {"engine:1": 100.0 + (50 if r < 2 else r), "rank:7": 200.0})
               for r in range(12)]
    report = soak.growth_report(samples, baseline=2)
    assert report["baseline_rollout"] == 2 and report["last_rollout"] == 11
    assert report["processes"]["engine:1"]["rss_growth_pct"] == round(100 * 9 / 102, 2)
    assert report["processes"]["rank:7"]["rss_growth_pct"] == 0
    assert report["seconds_per_rollout_first_tenth"] == report["seconds_per_rollout_last_tenth"] == 10.0
