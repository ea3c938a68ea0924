"""Memory per GPU and per process from an nvidia-smi sample file (benchmarks/run_colocate_layouts.sh).

    python benchmarks/smi_summary.py SMI.csv

Lines are `ts,gpu,INDEX,MiB` and `ts,proc,GPU_UUID,PID,MiB,ROLE`. In a colocated run each side is awake
(its peak) and asleep (its floor) in turn, so per process the maximum is its awake figure and the
minimum after its first peak is its asleep one; per GPU the same of the total.
"""
from __future__ import annotations

import sys
from collections import defaultdict


def summarize(lines: list[str]) -> list[str]:
    gpus: dict[str, list[float]] = defaultdict(list)
    procs: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for line in lines:
        parts = [p.strip() for p in line.strip().split(",")]
        if len(parts) >= 4 and parts[1] == "gpu":
            gpus[parts[2]].append(float(parts[3]))
        elif len(parts) >= 6 and parts[1] == "proc":
            procs[(parts[2][-8:], parts[3], parts[5])].append(float(parts[4]))
    out = []
    for gpu, used in sorted(gpus.items()):
        out.append(f"gpu {gpu}: peak {max(used) / 1024:.2f} GiB, floor after peak {_floor(used) / 1024:.2f} GiB")
    for (uuid, pid, role), used in sorted(procs.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        out.append(f"gpu ..{uuid} pid {pid} {role}: awake {max(used) / 1024:.2f} GiB, asleep "
                   f"{_floor(used) / 1024:.2f} GiB ({len(used)} samples)")
    return out


def _floor(used: list[float]) -> float:
    """The smallest value after the first peak (before it the process was still starting)."""
    first_peak = used.index(max(used))
    return min(used[first_peak:]) if first_peak < len(used) else used[-1]


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print("\n".join(summarize(f.readlines())))
