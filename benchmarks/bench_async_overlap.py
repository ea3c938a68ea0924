"""train.py (colocated: trainer and engines take turns) against train_async.py (engines of their own, the next
rollout generated while this one trains), on the same CPU budget, one after the other in one invocation.

    python benchmarks/bench_async_overlap.py [--num-rollout 8] [--out outputs/bench-async] [--json FILE] [-- FLAGS]

Both run the CPU demo's task, model and flags (examples/run_cpu_async_demo.sh: 4 ranks as TP2 x SP x CP2 and 2
embedded engines); train.py gets `--colocate` instead, its 2 engines on the first 2 of the ranks' bundles. FLAGS
go to both (e.g. `--rollout-max-response-len 32`: longer generation, more to overlap). Per
script, over the rollouts after the first two (start-up and first compilation left out):

  wall per rollout   seconds between consecutive `train` events reaching the metrics file
  engine idle        1 - (engines' generation seconds, perf/rollout_generate_s) / wall
  trainer idle       1 - (perf/actor_train_s + weight_sync/seconds) / wall

The figures depend on what else the machine runs: rerun on a quiet machine for numbers to compare with.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = 2  # rollouts left out of the figures (start-up, first compilation)


@dataclass(frozen=True)
class Figures:
    script: str
    rollouts: int
    wall_s_per_rollout: float
    engine_idle_fraction: float
    trainer_idle_fraction: float
    total_s: float


def _watch(path: Path, arrivals: list[tuple[float, dict]], stop: threading.Event) -> None:
    """Stamp every event with the time it reached the metrics file (the jsonl sink is line-buffered)."""
    while not path.exists() and not stop.wait(0.1):
        pass
    if not path.exists():
        return
    with path.open() as handle:
        buffer = ""
        while True:
            chunk = handle.readline()
            if chunk:
                buffer += chunk
                if buffer.endswith("\n"):
                    arrivals.append((time.monotonic(), json.loads(buffer)))
                    buffer = ""
                continue
            if stop.wait(0.05):
                return


def run(script: str, num_rollout: int, out: Path, timeout_s: float, extra: list[str]) -> list[tuple[float, dict]]:
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = {**os.environ, "OUT": str(out), "NUM_ROLLOUT": str(num_rollout), "PY": sys.executable, "SCRIPT": script}
    env.pop("SLIME_FAULT_INJECT", None)
    arrivals: list[tuple[float, dict]] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(metrics, arrivals, stop), daemon=True)
    watcher.start()
    try:
        colocate = ["--colocate"] if script == "train.py" else []  # engines share the ranks' first bundles
        proc = subprocess.run(["bash", str(ROOT / "examples" / "run_cpu_async_demo.sh"), *colocate, *extra],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    finally:
        time.sleep(0.5)
        stop.set()
        watcher.join(5)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return arrivals


def figures(script: str, arrivals: list[tuple[float, dict]]) -> Figures:
    by_kind: dict[str, dict[int, tuple[float, dict]]] = {}
    for at, event in arrivals:
        by_kind.setdefault(event["event"], {})[event["rollout_id"]] = (at, event)
    trains = by_kind.get("train", {})
    ids = sorted(k for k in trains if k >= SKIP - 1)
    if len(ids) < 2:
        raise RuntimeError(f"{script}: too few rollouts to measure ({sorted(trains)})")
    window = trains[ids[-1]][0] - trains[ids[0]][0]
    measured = ids[1:]  # each rollout's work between the previous train event and its own
    generate = sum(by_kind["rollout"][k][1].get("perf/rollout_generate_s", 0.0) for k in measured)
    busy = sum(trains[k][1].get("perf/actor_train_s", 0.0) + by_kind.get("weight_sync", {}).get(k, (0, {}))[1]
               .get("weight_sync/seconds", 0.0) for k in measured)
    return Figures(script=script, rollouts=len(measured), wall_s_per_rollout=window / len(measured),
                   engine_idle_fraction=1 - generate / window, trainer_idle_fraction=1 - busy / window,
                   total_s=arrivals[-1][0] - arrivals[0][0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-rollout", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-async")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per script")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- flags for both scripts")
    args = parser.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if args.num_rollout < SKIP + 2:
        parser.error(f"--num-rollout must be at least {SKIP + 2}")
    results = [figures(script, run(script, args.num_rollout, args.out / script.removesuffix(".py"), args.timeout, extra))
               for script in ("train.py", "train_async.py")]
    print(f"{'script':<16}{'rollouts':>9}{'wall s/rollout':>16}{'engine idle':>13}{'trainer idle':>14}")
    for r in results:
        print(f"{r.script:<16}{r.rollouts:>9}{r.wall_s_per_rollout:>16.2f}{r.engine_idle_fraction:>13.2f}"
              f"{r.trainer_idle_fraction:>14.2f}")
    print(f"speed-up of train_async.py over train.py: {results[0].wall_s_per_rollout / results[1].wall_s_per_rollout:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
