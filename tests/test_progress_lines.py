"""What a run prints on stdout, from metrics events alone: one line per rollout, eval and placement lines,
no all-zero memory figures, the start line, and --verbose's per-event lines; the JSONL keeps every event."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from arg_testing import driver_args
from slime.config import defaults_namespace
from slime.ray.driver.session import start_line
from slime.utils import progress_lines
from slime.utils.metrics_logger import Console, MetricsLogger
from slime.utils.progress_lines import (
    RolloutProgress,
    duration,
    eval_line,
    event_line,
    has_memory_figures,
    placement_summary,
    rollout_line,
)

CPU_MEMORY = {"event": "memory", "rollout_id": 3, "memory/engine0_awake_peak_reserved_gb": 0.0,
              "memory/trainer_awake_allocated_gb": 0, "memory/trainer_offloaded_gb": 0.0002,  # host copies, not
              "memory/trainer_sleep_s": 0.0046}                                             # device memory
GPU_MEMORY = {**CPU_MEMORY, "memory/engine0_awake_peak_reserved_gb": 41.25,
              "memory/trainer_awake_peak_reserved_gb": 30.0}


def _events(rollout_id: int) -> list[dict]:
    return [
        {"event": "rollout", "rollout_id": rollout_id, "rollout/raw_reward": 0.40625, "rollout/num_samples": 64.0},
        {"event": "train", "rollout_id": rollout_id, "train/loss": 0.01234, "perf/actor_train_s": 2.34,
         "train/train_rollout_logprob_abs_diff": 2.14e-05, "train/grad_norm": 1.2},
        {"event": "memory", "rollout_id": rollout_id, **{k: v for k, v in CPU_MEMORY.items() if "/" in k}},
        {"event": "weight_sync", "rollout_id": rollout_id, "weight_sync/seconds": 0.1042, "weight_sync/version": 4},
    ]


def test_a_rollouts_events_make_one_line_with_its_figures():
    events = {e["event"]: e for e in _events(3)}
    line = rollout_line(3, 20, events, seconds_left=80)
    assert line == "rollout 3/20  reward 0.406  loss 0.0123  diff 2.1e-05  sync 0.10s  step 2.3s  left ~1m20s"
    assert "\n" not in line


def test_missing_events_leave_their_figures_out():
    only_rollout = rollout_line(0, 2, {"rollout": _events(0)[0]})  # --debug-rollout-only: no train, no sync
    assert only_rollout == "rollout 0/2  reward 0.406"
    no_diff = {"train": {"train/loss": 0.5}}
    assert rollout_line(1, None, no_diff) == "rollout 1  loss 0.5"
    assert rollout_line(1, 2, {"train": {"train/loss": "nan"}}) == "rollout 1/2  loss nan"  # a NaN stays visible


def test_memory_figures_show_only_when_not_all_zero():
    assert not has_memory_figures(CPU_MEMORY)
    assert has_memory_figures(GPU_MEMORY)
    cpu = {e["event"]: e for e in _events(3)}
    assert "mem" not in rollout_line(3, 20, cpu)
    gpu = {**cpu, "memory": GPU_MEMORY}
    assert "mem 41.2G" in rollout_line(3, 20, gpu)  # the highest peak of any engine or rank


def test_the_time_left_follows_the_pace_of_the_last_rollouts_and_the_last_line_says_how_long_the_run_took():
    progress = RolloutProgress(started=0.0)
    progress.mark(60.0)  # start-up over at 60 s: not counted in the pace
    lines = []
    for rollout_id, now in ((0, 70.0), (1, 80.0), (2, 90.0)):
        for event in _events(rollout_id):
            progress.add(event)
        lines.append(progress.done(rollout_id, 4 if rollout_id < 3 else None, now))
    assert lines[0].endswith("left ~30s") and lines[1].endswith("left ~20s") and lines[2].endswith("left ~10s")
    for event in _events(3):
        progress.add(event)
    assert progress.done(3, 4, 100.0).endswith("done in 1m40s")


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (0.04, 2.34, 45, 80, 3600 + 180)] == ["0.0s", "2.3s", "45s", "1m20s", "1h03m"]


def test_eval_line_names_each_dataset_with_its_mean_reward():
    event = {"event": "eval", "rollout_id": 5, "eval/aime": 0.3333, "eval/aime/response_len/mean": 100.0,
             "eval/gsm8k": 0.71}
    assert eval_line(event) == "eval 5: aime 0.333  gsm8k 0.71"


def test_placement_is_one_line_and_the_record_is_untouched():
    ranks = [{"rank": r, "node_id": "n" * 56, "node_ip": "127.0.0.1", "gpu_ids": [], "device": None} for r in range(8)]
    engines = [{"rank": 0, "url": "http://127.0.0.1:43587", "node_id": "n" * 56, "node_ip": "127.0.0.1",
                "bind_host": "127.0.0.1", "gpu_ids": (), "device_indices": ()}]
    event = {"event": "placement", "rollout_id": 0, "placement/engines": engines, "placement/nodes": 1,
             "placement/ranks": ranks}
    line = placement_summary(event)
    assert line == "placement: 8 trainer ranks, 1 engine on 1 node (127.0.0.1); engines at http://127.0.0.1:43587"
    assert len(line) < 120 < len(event_line(event))  # the whole record: --verbose and the JSONL


def test_the_start_line_names_the_layout_from_the_flags():
    args = driver_args(actor_num_nodes=1, actor_num_gpus_per_node=8, tensor_model_parallel_size=2,
                       sequence_parallel=True, pipeline_model_parallel_size=1, context_parallel_size=4,
                       expert_model_parallel_size=1, rollout_num_gpus=8, rollout_num_gpus_per_engine=8,
                       colocate=True, num_rollout=20, rollout_batch_size=8, n_samples_per_prompt=8, use_critic=False)
    assert start_line(args, device="CPU") == ("starting: 8 trainer ranks (TP2 x SP x CP4), 1 engine, colocated, "
                                              "on CPU; 20 rollouts of 8 prompts x 8 samples")
    dp = driver_args(**{**vars(args), "context_parallel_size": 1, "sequence_parallel": False, "colocate": False,
                        "rollout_num_gpus": 4, "rollout_num_gpus_per_engine": 2})
    assert start_line(dp, device="GPU").startswith("starting: 8 trainer ranks (TP2 x DP4), 2 engines of 2 GPUs each, "
                                                   "engines apart, on GPU")
    ppo = driver_args(**{**vars(args), "advantage_estimator": "ppo", "use_critic": True})
    assert start_line(ppo, device="CPU").startswith(
        "starting: 8 trainer ranks (TP2 x SP x CP4), 8 critic ranks on the trainer ranks' GPUs, 1 engine")
    own = driver_args(**{**vars(ppo), "critic_num_gpus_per_node": 4})
    assert ", 4 critic ranks on GPUs of their own, 1 engine" in start_line(own, device="CPU")


def _logged(tmp_path, verbose: bool) -> tuple[list[str], list[dict]]:
    args = defaults_namespace(verbose=verbose, num_rollout=2, start_rollout_id=0, metrics_jsonl=str(tmp_path / "m.jsonl"))
    printed: list[str] = []
    console = Console(args, out=printed.append)
    metrics = MetricsLogger(args, console)
    metrics.log("memory", -1, {k: v for k, v in CPU_MEMORY.items() if "/" in k})
    metrics.log("weight_sync", -1, {"weight_sync/seconds": 0.2, "weight_sync/version": 0})
    console.rollouts_begin()
    for rollout_id in range(2):
        for event in _events(rollout_id):
            metrics.log(event["event"], rollout_id, {k: v for k, v in event.items() if "/" in k})
        metrics.rollout_done(rollout_id)
    metrics.log("eval", 2, {"eval/aime": 0.5})
    metrics.close()
    jsonl = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert jsonl[0]["event"] == "run"  # the run's facts first (its dtype), then the events in order
    return printed, jsonl[1:]


def test_by_default_one_line_per_rollout_and_the_jsonl_keeps_every_event(tmp_path):
    printed, jsonl = _logged(tmp_path, verbose=False)
    assert [line.split("  ")[0] for line in printed] == ["rollout 0/2", "rollout 1/2", "eval 2: aime 0.5"]
    assert [(e["event"], e["rollout_id"]) for e in jsonl] == [
        ("memory", -1), ("weight_sync", -1), *[(e["event"], r) for r in range(2) for e in _events(r)], ("eval", 2)]
    assert jsonl[2]["rollout/raw_reward"] == 0.40625 and "memory/trainer_sleep_s" in jsonl[0]


def test_verbose_prints_every_event_but_no_all_zero_memory(tmp_path):
    printed, jsonl = _logged(tmp_path, verbose=True)
    assert [line.split("] ")[0] + "]" for line in printed] == [
        "[weight_sync -1]", "[rollout 0]", "[train 0]", "[weight_sync 0]", "[rollout 1]", "[train 1]",
        "[weight_sync 1]", "[eval 2]"]
    assert printed[2].startswith("[train 0] perf/actor_train_s=2.34 ")
    assert len(jsonl) == 11 and [e["event"] for e in jsonl].count("memory") == 3


@pytest.mark.parametrize("kind", ["engine_catch_up", "something_new"])
def test_other_events_are_printed_whole(kind):
    printed: list[str] = []
    Console(SimpleNamespace(verbose=False), out=printed.append).event({"event": kind, "rollout_id": 1, "a/b": 1.5})
    assert printed == [f"[{kind} 1] a/b=1.5"]


def test_rollout_kinds_are_the_ones_the_line_reads():
    assert set(progress_lines.ROLLOUT_KINDS) == {"rollout", "train", "weight_sync", "memory"}
