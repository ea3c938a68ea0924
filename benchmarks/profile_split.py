"""Split a py-spy profile of gpu_fenced_step.py's A/B run by variant: where an "on" cycle spends the
time that a variant's cycle does not.

    py-spy record --subprocesses --nonblocking --idle --threads -r 250 -f raw -o prof.txt -- \
        torchrun ... benchmarks/gpu_fenced_step.py --ab-fences --ab-off ledger ... > keep.log
    python benchmarks/profile_split.py prof.txt keep.log

Main-thread stacks carry the cycle's variant as a frame named cycle_<variant> (cycle_frame in the
driver; cycle_warmup for cycle 0). Per rank this prints, in ms per cycle (samples over py-spy's
rate): the functions whose inclusive main-thread time differs most between "on" and
each variant, and the recording's own time: samples whose innermost frame is the ledger's wrapper or
hot path (instrument.py, ledger.py), on any thread (autograd's runs backward's collectives), which
only "on" cycles can have.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
RECORDING_FILES = ("slime/distributed/instrument.py", "slime/distributed/ledger.py")
RECORDING_FUNCS = {"recorded", "begin", "end", "begin_named"}


@dataclass
class RankProfile:
    """Samples of one process: main-thread function counts per variant, recording leaves, threads."""

    inclusive: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))  # variant -> func -> n
    leaf: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    samples: Counter = field(default_factory=Counter)  # variant -> main-thread samples inside its cycles
    recording: Counter = field(default_factory=Counter)  # thread name -> samples with a recording leaf
    threads: Counter = field(default_factory=Counter)


def function_key(frame: str) -> str:
    m = FRAME.match(frame)
    return f"{m['func']} ({m['file']})" if m else frame


def is_recording_leaf(frame: str) -> bool:
    m = FRAME.match(frame)
    return bool(m) and m["func"].rpartition(".")[2] in RECORDING_FUNCS and m["file"].endswith(RECORDING_FILES)


def parse(path: str) -> dict[str, RankProfile]:
    """py-spy raw lines 'process P:"cmd";thread (T): name;frame;...;frame COUNT' -> profile per process."""
    profiles: dict[str, RankProfile] = defaultdict(RankProfile)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            parts = stack.split(";")
            # --subprocesses nests 'process torchrun;process worker': the innermost one is the rank
            process = next((p.split(":")[0] for p in reversed(parts) if p.startswith("process ")), "process ?")
            thread = next((p.split(": ", 1)[-1] for p in parts if p.startswith("thread ")), "?")
            frames = [p for p in parts if not p.startswith(("process ", "thread "))]
            if not frames or not count.isdigit():
                continue
            n, prof = int(count), profiles[process]
            prof.threads[thread] += n
            variant = next((function_key(p).split(" ")[0][len("cycle_"):] for p in frames
                            if p.startswith("cycle_")), None)
            # main thread: inside 'on' cycles only (not the warm-up, not the driver's own probes);
            # autograd's thread has no cycle frame: all of its samples count
            if is_recording_leaf(frames[-1]) and (variant == "on" or (variant is None and thread != "MainThread")):
                prof.recording[thread] += n
            if variant is None:
                continue
            prof.samples[variant] += n
            prof.leaf[variant][function_key(frames[-1])] += n
            for key in {function_key(p) for p in frames}:
                prof.inclusive[variant][key] += n
    return profiles


def cycle_seconds(log_path: str) -> dict[str, list[float]]:
    """Wall seconds of each cycle per variant from the driver's CYCLE lines (cycle 0 is the warm-up)."""
    seconds: dict[str, list[float]] = defaultdict(list)
    with open(log_path) as f:
        for line in f:
            if line.startswith("CYCLE "):
                c = json.loads(line[len("CYCLE "):])
                seconds["warmup" if c["cycle"] == 0 else c["variant"]].append(c["sleep_s"] + c["train_s"])
    return seconds


def report(prof: RankProfile, seconds: dict[str, list[float]], rate: float, top: int) -> list[str]:
    variants = [v for v in seconds if v not in ("on", "warmup") and prof.samples[v]]
    if not prof.samples["on"]:
        return ["  no samples inside cycle_on frames"]
    per_cycle = lambda v, n: 1e3 * n / rate / len(seconds[v])  # noqa: E731
    timed_ms = 1e3 * sum(seconds["on"]) / len(seconds["on"])  # sleep + train: what the A/B ratio compares
    # the cycle frame also holds the untimed gc.collect and bookkeeping around sleep + train
    lines = [f"  'on': {len(seconds['on'])} cycles, cycle frame {per_cycle('on', prof.samples['on']):.0f} ms each "
             f"(sleep + train {timed_ms:.0f} ms)"]
    recording = per_cycle("on", sum(prof.recording.values()))
    lines.append(f"  recording's own time (innermost frame in the wrapper or ledger), 'on' cycles: "
                 f"{recording:.1f} ms/cycle = {100 * recording / timed_ms:.2f} % of sleep + train"
                 f" (by thread: {dict(prof.recording)})")
    for v in variants:
        lines.append(f"  '{v}': {len(seconds[v])} cycles, {per_cycle(v, prof.samples[v]):.0f} ms each; "
                     f"on - {v}, ms/cycle, main thread:")
        for kind, table in (("inclusive", prof.inclusive), ("leaf", prof.leaf)):
            keys = set(table["on"]) | set(table[v])
            delta = {k: per_cycle("on", table["on"][k]) - per_cycle(v, table[v][k]) for k in keys
                     if not k.startswith("cycle_")}
            for k in sorted(delta, key=lambda k: -abs(delta[k]))[:top]:
                lines.append(f"    {kind:9s} {delta[k]:+8.1f}  on {per_cycle('on', table['on'][k]):8.1f}  {k}")
    lines.append(f"  threads (all samples): {dict(prof.threads.most_common(8))}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", help="py-spy raw output (--format raw --threads --subprocesses)")
    p.add_argument("log", help="the driver's stdout with its CYCLE lines")
    p.add_argument("--rate", type=float, default=250.0, help="py-spy's --rate")
    p.add_argument("--top", type=int, default=15)
    opts = p.parse_args()
    seconds = cycle_seconds(opts.log)
    for process, prof in sorted(parse(opts.profile).items()):
        if prof.samples:
            print(f"{process}:")
            print("\n".join(report(prof, seconds, opts.rate, opts.top)))


if __name__ == "__main__":
    main()
