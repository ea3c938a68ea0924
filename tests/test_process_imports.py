"""What the light processes of a run import: an engine's Ray actor starts an engine and answers the driver, so it
loads no torch (~1 CPU-s in every engine actor of every run); the engine it starts learns its device from the
bundles' GPUs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from slime.backends.sglang_utils.launcher import build_embedded_command
from slime.config import defaults_namespace

ROOT = Path(__file__).resolve().parents[1]


def test_the_engine_actor_module_imports_no_torch():
    script = "import sys, slime.ray.engines.actor; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


def test_the_embedded_engine_runs_where_its_bundles_are():
    args = defaults_namespace(num_gpus_per_node=8, sglang_server_args={})
    on_cpu = build_embedded_command(args, 0, "127.0.0.1", 1234, "/model", gpu_ids=())
    assert "--device" not in on_cpu
    on_gpu = build_embedded_command(args, 0, "127.0.0.1", 1234, "/model", gpu_ids=(3,))
    assert on_gpu[on_gpu.index("--device") + 1] == "cuda:3"
