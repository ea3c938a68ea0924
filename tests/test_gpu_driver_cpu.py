"""benchmarks/gpu_fenced_step.py on CPU/gloo: 2 ranks (TP2 + SP), tiny model, 2 sleep/wake/train cycles.

The driver runs unchanged on GPUs (NCCL); this keeps its logic (checkpoint, synthetic data, the
no-Ray actor, fence accounting, weight-sync timing, failure reporting) covered where CI runs.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "benchmarks" / "gpu_fenced_step.py"
LAYOUT = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-dynamic-batch-size",
          "--max-tokens-per-gpu", "256", "--calculate-per-token-loss", "--recreate-process-groups-on-wake"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_driver(tmp_path: Path, extra: list[str], env_extra: dict[str, str], timeout_s: float):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(_free_port()), str(DRIVER),
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
                                     "--fence-timeout", "60", "--results-json", str(results)], {}, 280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(results.read_text())
    cycles, summary = report["cycles"], report["summary"]
    assert [c["cycle"] for c in cycles] == [0, 1]
    assert all(math.isfinite(c["loss"]) and c["grad_norm"] > 0 for c in cycles)
    assert all(c["step_fence_s"] > 0 and 0 < c["step_fence_ratio"] < 1 for c in cycles)
    assert summary["recreate_groups"] and summary["tp"] == 2 and summary["world"] == 2
    assert summary["fence_median_s"] > 0
    assert summary["ws_total_gb"] > 0 and summary["ws_export_s"] > 0 and summary["ws_encode_s"] > 0


@pytest.mark.timeout(200)
def test_driver_fault_ends_with_named_error(tmp_path):
    proc, elapsed = _run_driver(tmp_path, ["--fence-timeout", "20"], {"SLIME_FAULT_INJECT": "diverge_plan@1#1"}, 180)
    assert proc.returncode != 0
    failures = [line for line in proc.stdout.splitlines() if line.startswith("FAILED rank=")]
    assert failures and all("CollectiveDivergenceError" in line for line in failures), proc.stdout[-3000:]
    assert elapsed < 170
