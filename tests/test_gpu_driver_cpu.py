"""benchmarks/gpu_fenced_step.py on CPU/gloo: 2 ranks (TP2 + SP), tiny model, 2 sleep/wake/train cycles.

The driver runs unchanged on GPUs (NCCL); this keeps its logic (checkpoint, synthetic data, the
no-Ray actor, fence accounting, weight-sync timing, failure reporting) covered where CI runs.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slime.utils.ports import find_free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "benchmarks" / "gpu_fenced_step.py"
LAYOUT = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-dynamic-batch-size",
          "--max-tokens-per-gpu", "256", "--calculate-per-token-loss", "--recreate-process-groups-on-wake"]


def _run_driver(tmp_path: Path, extra: list[str], env_extra: dict[str, str], timeout_s: float):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(find_free_port()), str(DRIVER),
           "--cycles", "2", "--num-samples", "8", "--min-tokens", "32", "--max-tokens", "96",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--ledger-dir", str(tmp_path / "ledger"), *LAYOUT, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env_extra}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc, time.monotonic() - start


@pytest.mark.timeout(300)
def test_driver_runs_cycles_and_reports(tmp_path):
    results = tmp_path / "results.json"
    proc, _ = _run_driver(tmp_path, ["--bench-fence-overhead", "--fence-repeats", "5", "--bench-weight-sync",
                                     "--check-wake-exact", "--fence-timeout", "60", "--results-json", str(results)],
                          {}, 280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(results.read_text())
    cycles, summary = report["cycles"], report["summary"]
    assert [c["cycle"] for c in cycles] == [0, 1]
    assert all(math.isfinite(c["loss"]) and c["grad_norm"] > 0 for c in cycles)
    assert all(c["step_fence_s"] > 0 and 0 < c["step_fence_ratio"] < 1 for c in cycles)
    assert summary["recreate_groups"] and summary["tp"] == 2 and summary["world"] == 2
    assert summary["fence_median_s"] > 0
    assert summary["ws_total_gb"] > 0 and summary["ws_export_s"] > 0 and summary["ws_encode_s"] > 0
    assert summary["wake_bit_exact"] and summary["sleep_freed_every_state_storage"]
    assert all(c["memory"]["memory/trainer_offloaded_gb"] > 0 for c in cycles)


@pytest.mark.timeout(200)
def test_driver_fault_ends_with_named_error(tmp_path):
    proc, elapsed = _run_driver(tmp_path, ["--fence-timeout", "20"], {"SLIME_FAULT_INJECT": "diverge_plan@1#1"}, 180)
    assert proc.returncode != 0
    failures = [line for line in proc.stdout.splitlines() if line.startswith("FAILED rank=")]
    assert failures and all("CollectiveDivergenceError" in line for line in failures), proc.stdout[-3000:]
    assert elapsed < 170


def _load_benchmark(path: Path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_ab_schedule_rotates_the_order_every_block():
    schedule = _load_benchmark(DRIVER).ab_schedule(1 + 3 * 4, ("both", "none"))
    assert schedule[0] == "on"
    blocks = [schedule[1 + 3 * b: 4 + 3 * b] for b in range(4)]
    assert blocks[:3] == [["on", "both", "none"], ["both", "none", "on"], ["none", "on", "both"]]
    assert all(sorted(block) == ["both", "none", "on"] for block in blocks[:3])


def test_ab_summary_ratio_interval_and_phase_delta():
    driver = _load_benchmark(DRIVER)
    cycles = []
    for cycle, variant in enumerate(driver.ab_schedule(41, ("both",))):
        jitter = 0.01 * ((cycle * 7) % 5)  # same spread in both variants
        step = 1.0 if variant == "on" else 0.9  # switching off saves 0.1 s, all of it in forward_backward
        cycles.append({"variant": variant, "sleep_s": 0.05, "train_s": step + jitter,
                       "phase_s": {"actor_train/forward_backward": step, "actor_train/optimizer": 0.02}})
    summary = driver.ab_summary(cycles)["ab_both"]
    assert summary["cycles"] == 20
    expected = summary["on_median_s"] / summary["off_median_s"]
    assert summary["ratio"] == pytest.approx(expected) and 1.08 < expected < 1.13
    low, high = summary["ratio_90"]
    assert low <= summary["ratio"] <= high and low > 1.0
    assert summary["phase_delta_ms"] == {"actor_train/forward_backward": pytest.approx(100.0),
                                         "actor_train/optimizer": 0.0}


def test_cycle_frame_names_the_variant_on_the_stack(monkeypatch):
    driver = _load_benchmark(DRIVER)
    monkeypatch.setattr(driver, "run_cycle", lambda actor, cycle, data: sys._getframe(1).f_code.co_name)
    assert driver.cycle_frame("ledger")(None, 3, {}) == "cycle_ledger"


def test_profile_split_attributes_recording_and_variant_differences(tmp_path):
    """A py-spy raw profile (two ranks, 'on' and 'ledger' cycles) is split per rank and variant."""
    split = _load_benchmark(ROOT / "benchmarks" / "profile_split.py")
    head = 'process 10:"torchrun";process {pid}:"python gpu_fenced_step.py";thread (0x1): MainThread;' \
           "main (gpu_fenced_step.py:1);{cycle} (gpu_fenced_step.py:290)"
    rec = "_wrap.<locals>.recorded (slime/distributed/instrument.py:100)"
    lines = []
    for pid in (11, 12):
        lines += [f"{head.format(pid=pid, cycle='cycle_on')};forward (core/layers.py:5) 500",
                  f"{head.format(pid=pid, cycle='cycle_on')};{rec};Ledger.begin (slime/distributed/ledger.py:130) 20",
                  f"{head.format(pid=pid, cycle='cycle_on')};{rec};all_reduce (torch/distributed/c10d.py:9) 30",
                  f"{head.format(pid=pid, cycle='cycle_ledger')};forward (core/layers.py:5) 480",
                  f'process 10:"torchrun";process {pid}:"python";thread (0x2): autograd;'
                  f"backward (core/layers.py:9);{rec} 5",
                  f'process 10:"torchrun";process {pid}:"python";thread (0x1): MainThread;'
                  f"bench_fence_latency (gpu_fenced_step.py:3);{rec} 7"]  # outside any cycle: not counted
    (tmp_path / "prof.txt").write_text("\n".join(lines) + "\n")
    cycles = [{"cycle": i, "variant": v, "sleep_s": 0.0, "train_s": 1.0} for i, v in enumerate(["on", "on", "ledger"])]
    (tmp_path / "keep.log").write_text("".join(f"CYCLE {json.dumps(c)}\n" for c in cycles))

    profiles = split.parse(str(tmp_path / "prof.txt"))
    assert sorted(profiles) == ["process 11", "process 12"]  # the innermost process is the rank
    prof = profiles["process 11"]
    assert prof.samples == {"on": 550, "ledger": 480}
    assert sum(prof.recording.values()) == 25  # ledger leaf in 'on' cycles + wrapper leaf on autograd's thread
    text = "\n".join(split.report(prof, split.cycle_seconds(str(tmp_path / "keep.log")), 100.0, 5))
    assert "250.0 ms/cycle = 25.00 % of sleep + train" in text  # 25 samples at 100 Hz, one 1 s 'on' cycle
    assert "+200.0" in text and "forward (core/layers.py)" in text  # (500 - 480) samples at 100 Hz
