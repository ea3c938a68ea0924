"""Per-rollout table of a colocated run from its --metrics-jsonl: training, weight sync, memory, log-prob agreement.

    python benchmarks/colocate_summary.py METRICS.jsonl

One row per rollout: loss, grad norm, the engines' vs the trainer's log-prob diff, weight-sync seconds /
bytes / version, the trainer's device memory awake (peak) and asleep, the engines' awake peak and
released figures, and the asleep/awake ratios the colocate target is stated in (under 10 %, CUDA context
and communicator buffers apart). The last lines say whether every rollout trained, synced and met it, the
weight sync's and the proof's share of a step, the reward's first and last rollouts and each phase's median
seconds.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict

COLUMNS = (
    ("loss", "train", "train/loss"),
    ("grad_norm", "train", "train/grad_norm"),
    ("logprob_diff", "train", "train/train_rollout_logprob_abs_diff"),
    ("sync_s", "weight_sync", "weight_sync/seconds"),
    ("sync_GB", "weight_sync", "weight_sync/bytes"),
    ("version", "weight_sync", "weight_sync/version"),
    ("trainer_awake_GB", "memory", "memory/trainer_awake_peak_reserved_gb"),
    ("trainer_asleep_GB", "memory", "memory/trainer_asleep_reserved_gb"),
    ("trainer_ctx_GB", "memory", "memory/trainer_asleep_context_and_comm_gb"),
    ("engine0_awake_GB", "memory", "memory/engine0_awake_peak_reserved_gb"),
    ("engine0_released_GB", "memory", "memory/engine0_released_reserved_gb"),
)
TARGET_RATIO = 0.10


def read(path: str) -> dict[int, dict[str, dict]]:
    rows: dict[int, dict[str, dict]] = defaultdict(dict)
    with open(path) as f:
        for line in f:
            event = json.loads(line)
            rows[event["rollout_id"]].setdefault(event["event"], {}).update(event)
    return rows


def cell(rows: dict, rollout: int, event: str, key: str) -> float | None:
    value = rows[rollout].get(event, {}).get(key)
    if key == "weight_sync/bytes" and value is not None:
        value = value / 1e9
    return value


def ratio(awake: float | None, asleep: float | None) -> float | None:
    return None if not awake or asleep is None else asleep / awake


def main(path: str) -> int:
    rows = read(path)
    rollouts = sorted(r for r in rows if r >= 0)
    header = ["rollout", *(name for name, _, _ in COLUMNS), "trainer_ratio", "engine0_ratio"]
    print(" ".join(f"{h:>12}" for h in header))
    ratios = []
    for r in rollouts:
        values = [cell(rows, r, event, key) for _, event, key in COLUMNS]
        by_name = dict(zip((name for name, _, _ in COLUMNS), values))
        pair = (ratio(by_name["trainer_awake_GB"], by_name["trainer_asleep_GB"]),
                ratio(by_name["engine0_awake_GB"], by_name["engine0_released_GB"]))
        ratios.append(pair)
        print(" ".join(f"{r:>12}" if i == 0 else _fmt(v) for i, v in enumerate([r, *values, *pair])))
    trained = [r for r in rollouts if "train" in rows[r] and math.isfinite(rows[r]["train"].get("train/loss", math.nan))]
    synced = [r for r in rollouts if "weight_sync" in rows[r]]
    met = [all(x is not None and x < TARGET_RATIO for x in pair) for pair in ratios]
    diffs = [rows[r]["train"].get("train/train_rollout_logprob_abs_diff") for r in trained]
    diffs = [d for d in diffs if d is not None]
    print(f"rollouts {len(rollouts)}: trained {len(trained)}, synced {len(synced)}, "
          f"memory target (asleep < {TARGET_RATIO:.0%} of awake, both sides) met in {sum(met)}")
    if diffs:
        print(f"train_rollout_logprob_abs_diff: first {diffs[0]:.4g}, last {diffs[-1]:.4g}, "
              f"min {min(diffs):.4g}, max {max(diffs):.4g}")
    sync_share(rows, rollouts)
    reward_and_phases(rows, rollouts)
    return 0 if rollouts and len(trained) == len(rollouts) == len(synced) else 1


def sync_share(rows: dict, rollouts: list[int]) -> None:
    """Median weight sync (and its export / send split), and the weight-sync proof's share of it, against the
    median actor_train."""
    def median(event: str, key: str) -> float | None:
        values = [v for r in rollouts if (v := rows[r].get(event, {}).get(key)) is not None]
        return statistics.median(values) if values else None

    sync, train = median("weight_sync", "weight_sync/seconds"), median("train", "perf/actor_train_s")
    if sync is None or not train:
        return
    gather, send = median("weight_sync", "weight_sync/gather_seconds"), median("weight_sync", "weight_sync/send_seconds")
    nbytes = median("weight_sync", "weight_sync/bytes") or 0.0
    print(f"weight_sync median {sync:.3f} s (export {gather or 0:.3f} s, send {send or 0:.3f} s, "
          f"{nbytes / 1e9:.2f} GB, {nbytes / 1e9 / sync:.2f} GB/s) vs actor_train median {train:.3f} s: "
          f"{sync / train:.1%}")
    proof = median("weight_sync", "weight_sync/proof_seconds")
    if proof is not None:  # rank 0's time in the proof: its digests of what it pushed, the gather, the engines'
        per_push = [f"{rows[r]['weight_sync']['weight_sync/proof_seconds']:.4f}" for r in rollouts
                    if "weight_sync/proof_seconds" in rows[r].get("weight_sync", {})]
        print(f"weight-sync proof median {proof:.4f} s per push vs actor_train median {train:.3f} s: "
              f"{proof / train:.2%} (target <= 1 %); per push: {' '.join(per_push)}; "
              f"{median('weight_sync', 'weight_sync/proof_tensors') or 0:.0f} (engine, tensor) pairs compared")


# Seconds per phase of a rollout, as the run logs them (any event of the rollout)
PHASES = (("generate", "perf/rollout_generate_s"), ("wake", "perf/wake_memory_s"), ("train", "perf/actor_train_s"),
          ("weight_sync", "weight_sync/seconds"), ("proof", "weight_sync/proof_seconds"))


def reward_and_phases(rows: dict, rollouts: list[int]) -> None:
    """The mean reward's first and last rollouts (mean of up to three each), and each phase's median seconds."""
    def found(key: str) -> list[float]:
        return [v for r in rollouts for event in rows[r].values() if (v := event.get(key)) is not None]

    rewards = found("rollout/raw_reward")
    if rewards:
        k = min(3, len(rewards))
        print(f"reward: first {k} rollouts {statistics.mean(rewards[:k]):.3f}, last {k} "
              f"{statistics.mean(rewards[-k:]):.3f}; per rollout {' '.join(f'{x:.3f}' for x in rewards)}")
    times = [f"{name} {statistics.median(values):.3f}" for name, key in PHASES if (values := found(key))]
    if times:
        print("median seconds per rollout: " + ", ".join(times))


def _fmt(value) -> str:
    if value is None:
        return f"{'-':>12}"
    return f"{value:>12.4g}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
