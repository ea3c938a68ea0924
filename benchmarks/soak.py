"""Soak: N rollouts of the CPU demo, with every process's resources sampled once per rollout.

    python benchmarks/soak.py --num-rollout 100 [--out outputs/soak] [--json outputs/soak/soak.json] [-- EXTRA FLAGS]

Runs `examples/run_cpu_demo.sh` (the demo's own flags, whatever main has; `--num-rollout N` and EXTRA
FLAGS appended) and, each time a rollout's last event (its weight sync) reaches the metrics file,
samples every process of the run (train.py and all its descendants: Ray's daemons, the rollout
manager, the training ranks, the engines, the router) with psutil: RSS, open files (file
descriptors), threads. Prints one line per rollout (wall time, RSS by role) and at the end, per
process, RSS at rollout `--baseline` and at the last rollout with the growth in %, the time per rollout
over the first and last tenth, and whether the run ended cleanly. Exit status 1 when the run failed,
stalled (no rollout for --stall-timeout seconds), or a process of the run (not Ray's daemons) grew more
than --max-rss-growth.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]

# Ray's daemons (GCS, raylet, dashboard): their bookkeeping is Ray's and bounded by Ray's own settings
# (e.g. RAY_task_events_max_num_task_in_gcs); the check covers the run's own processes.
UNCHECKED_ROLES = ("ray:",)

# cmdline pattern -> role, first match wins (Ray names its workers' processes "ray::<Actor>.<method>")
ROLES = (
    (r"ray::TrainRayActor", "rank"),
    (r"ray::RolloutManager", "rollout-manager"),
    (r"ray::EngineRayActor", "engine-actor"),  # starts and watches one engine on its bundle
    (r"embedded_engine\.server|sglang\.launch_server", "engine"),
    (r"slime\.router\.router|sglang_router", "router"),
    (r"train\.py", "driver"),
    (r"raylet|gcs_server|dashboard|log_monitor|monitor\.py|runtime_env|ray::IDLE|default_worker", "ray"),
)


@dataclass
class ProcessSample:
    pid: int
    role: str
    name: str
    rss_mb: float
    open_files: int
    threads: int


@dataclass
class RolloutSample:
    rollout_id: int
    at_s: float
    """Seconds since the run started when the rollout's weight sync was logged."""
    processes: list[ProcessSample] = field(default_factory=list)


def role_of(cmdline: str) -> str:
    for pattern, role in ROLES:
        if re.search(pattern, cmdline):
            return role
    return "other"


def process_label(process: psutil.Process, role: str, cmdline: str) -> str:
    """A name that stays the same across samples: engines by port, ranks and others by pid."""
    port = re.search(r"--port (\d+)", cmdline)
    return f"{role}:{port.group(1)}" if port and role in ("engine", "router") else f"{role}:{process.pid}"


def sample_tree(root_pid: int) -> list[ProcessSample]:
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    samples = []
    for process in processes:
        try:
            with process.oneshot():
                cmdline = " ".join(process.cmdline()) or process.name()
                role = role_of(cmdline)
                samples.append(ProcessSample(pid=process.pid, role=role, name=process_label(process, role, cmdline),
                                             rss_mb=process.memory_info().rss / 2**20, open_files=process.num_fds(),
                                             threads=process.num_threads()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return samples


def finished_rollouts(metrics_path: Path, offset: int) -> tuple[list[int], int]:
    """Rollout ids whose weight sync was logged since `offset` (bytes), and the new offset."""
    if not metrics_path.exists():
        return [], offset
    with open(metrics_path) as f:
        f.seek(offset)
        text = f.read()
    complete = text[: text.rfind("\n") + 1]
    ids = [event["rollout_id"] for event in map(json.loads, complete.splitlines())
           if event.get("event") == "weight_sync" and event["rollout_id"] >= 0]
    return ids, offset + len(complete.encode())


def run_soak(num_rollout: int, out: Path, extra: list[str], stall_timeout_s: float) -> tuple[int, list[RolloutSample]]:
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    log = open(out / "train.log", "w")
    env = {**os.environ, "OUT": str(out), "PY": sys.executable}
    start = time.monotonic()
    proc = subprocess.Popen(["bash", str(ROOT / "examples" / "run_cpu_demo.sh"), "--num-rollout", str(num_rollout),
                             *extra], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    samples: list[RolloutSample] = []
    offset, last_progress = 0, time.monotonic()
    try:
        while proc.poll() is None:
            ids, offset = finished_rollouts(metrics_path, offset)
            for rollout_id in ids:
                samples.append(RolloutSample(rollout_id, time.monotonic() - start, sample_tree(proc.pid)))
                print(summary_line(samples), flush=True)
                last_progress = time.monotonic()
            if time.monotonic() - last_progress > stall_timeout_s:
                print(f"STALL: no rollout finished for {stall_timeout_s:.0f}s; stopping the run", flush=True)
                terminate(proc)
                return 2, samples
            time.sleep(0.5)
    except KeyboardInterrupt:
        terminate(proc)
        raise
    ids, offset = finished_rollouts(metrics_path, offset)
    samples += [RolloutSample(i, time.monotonic() - start) for i in ids]
    return proc.returncode, samples


def terminate(proc: subprocess.Popen) -> None:
    """End the run and everything it started (engines, Ray) by their pids."""
    try:
        tree = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def by_role(sample: RolloutSample) -> dict[str, float]:
    totals: dict[str, float] = {}
    for process in sample.processes:
        totals[process.role] = totals.get(process.role, 0.0) + process.rss_mb
    return totals


def summary_line(samples: list[RolloutSample]) -> str:
    last = samples[-1]
    wall = last.at_s - samples[-2].at_s if len(samples) > 1 else last.at_s
    roles = " ".join(f"{role}={mb:.0f}MB" for role, mb in sorted(by_role(last).items()))
    fds = sum(p.open_files for p in last.processes)
    threads = sum(p.threads for p in last.processes)
    return (f"rollout {last.rollout_id:4d}  {wall:6.1f}s  processes={len(last.processes)} fds={fds} "
            f"threads={threads}  {roles}")


def growth_report(samples: list[RolloutSample], baseline: int) -> dict:
    """Per process: RSS / fds / threads at the baseline rollout and at the last, growth in %; time per rollout."""
    sampled = [s for s in samples if s.processes]
    first = next((s for s in sampled if s.rollout_id >= baseline), None)
    if first is None or first is sampled[-1]:
        return {}
    base = {p.name: p for p in first.processes}
    last = {p.name: p for p in sampled[-1].processes}
    processes = {}
    for name in sorted(set(base) & set(last)):
        b, e = base[name], last[name]
        processes[name] = {"rss_mb": [round(b.rss_mb, 1), round(e.rss_mb, 1)],
                           "rss_growth_pct": round(100 * (e.rss_mb - b.rss_mb) / max(b.rss_mb, 1e-9), 2),
                           "open_files": [b.open_files, e.open_files], "threads": [b.threads, e.threads]}
    walls = [b.at_s - a.at_s for a, b in zip(samples, samples[1:])]
    tenth = max(1, len(walls) // 10)
    return {
        "baseline_rollout": first.rollout_id, "last_rollout": sampled[-1].rollout_id, "processes": processes,
        "appeared": sorted(set(last) - set(base)), "disappeared": sorted(set(base) - set(last)),
        "seconds_per_rollout_first_tenth": round(sum(walls[:tenth]) / tenth, 2),
        "seconds_per_rollout_last_tenth": round(sum(walls[-tenth:]) / tenth, 2),
        "seconds_per_rollout_max": round(max(walls), 2) if walls else None,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-rollout", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "soak")
    parser.add_argument("--json", type=Path, default=None, help="write every sample and the report here")
    parser.add_argument("--baseline", type=int, default=10, help="rollout whose sample growth is measured from")
    parser.add_argument("--stall-timeout", type=float, default=900.0, help="seconds without a finished rollout")
    parser.add_argument("--max-rss-growth", type=float, default=5.0, help="percent, per process")
    args = parser.parse_args(argv)
    code, samples = run_soak(args.num_rollout, args.out, extra, args.stall_timeout)
    report = growth_report(samples, args.baseline)
    for name, row in report.get("processes", {}).items():
        print(f"{name:28s} rss {row['rss_mb'][0]:8.1f} -> {row['rss_mb'][1]:8.1f} MB ({row['rss_growth_pct']:+.2f} %)  "
              f"fds {row['open_files'][0]} -> {row['open_files'][1]}  threads {row['threads'][0]} -> {row['threads'][1]}")
    for key in ("baseline_rollout", "last_rollout", "seconds_per_rollout_first_tenth", "seconds_per_rollout_last_tenth",
                "seconds_per_rollout_max", "appeared", "disappeared"):
        if key in report:
            print(f"{key}: {report[key]}")
    done = len(samples)
    print(f"run exit code {code}; {done} of {args.num_rollout} rollouts finished")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"exit_code": code, "report": report,
                                         "samples": [asdict(s) for s in samples]}, indent=1))
    over = {name: row["rss_growth_pct"] for name, row in report.get("processes", {}).items()
            if row["rss_growth_pct"] > args.max_rss_growth}
    grew = [name for name in over if not name.startswith(UNCHECKED_ROLES)]
    if over:
        print(f"RSS grew more than {args.max_rss_growth} % in: {sorted(over)}"
              + (" (Ray's own daemons are reported, not checked)" if len(grew) < len(over) else ""))
    return 0 if code == 0 and done == args.num_rollout and not grew else 1


if __name__ == "__main__":
    sys.exit(main())
