"""Training-step time per parallel layout on CPU/gloo at a tiny size (not a test).

    python benchmarks/bench_layouts.py [--samples 8] [--layouts 1 tp2 tp2_cp2 tp2_sp_cp4 tp2_dp2_cp2]

Runs the real step (tests/train_step_harness.py) for each layout and prints the median
step seconds (rank 0) over --repeats steps per loss mode. On 2 shared cores the absolute times
mostly measure gloo and process count; the ratios between layouts are what to read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from mp_utils import run_ranks  # noqa: E402
from tiny_models import save_tiny_qwen3  # noqa: E402
from train_step_harness import layout_child, make_rollout  # noqa: E402

LAYOUTS = {
    "1": (1, dict()),
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2_cp2": (4, dict(tensor_model_parallel_size=2, context_parallel_size=2)),
    "tp2_sp_cp4": (8, dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=4)),
    "tp2_dp2_cp2": (8, dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=3, help="training steps per loss mode")
    opts = parser.parse_args()
    hf_dir = save_tiny_qwen3(tempfile.mkdtemp(prefix="bench_layouts_"))
    data = make_rollout(num_samples=opts.samples, seed=0)
    modes = ("per_token", "per_sample") * opts.repeats
    print(f"{'layout':<14}{'ranks':>6}{'micro-batches':>15}{'step s (median)':>17}{'wall s':>9}")
    for name in opts.layouts:
        world, layout = LAYOUTS[name]
        start = time.perf_counter()
        results = run_ranks(layout_child, world, args=(layout, hf_dir, data, modes), timeout_s=600)
        wall = time.perf_counter() - start
        step = statistics.median(results[0]["step_seconds"])
        print(f"{name:<14}{world:>6}{results[0]['plan']['num_micro_batches']:>15}{step:>17.3f}{wall:>9.1f}")


if __name__ == "__main__":
    main()
