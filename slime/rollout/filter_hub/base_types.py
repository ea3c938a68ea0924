"""What a dynamic-sampling filter returns, and how the sampling loop calls it."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class DynamicFilterOutput:
    keep: bool
    """False drops the group from this rollout (its prompt is not retried)."""
    reason: str | None = None
    """Why it was dropped; counted in the rollout metrics as `rollout/dynamic_filter/drop_<reason>`."""
    keep_when_insufficient: bool = False
    """Keep a rejected group anyway when dropping it would need another sampling round."""


def call_dynamic_filter(fn: Callable[..., Any] | None, args, group: list) -> DynamicFilterOutput:
    """`fn(args, group)`; a bare bool (older plugins) is wrapped; no filter keeps everything."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(args, group)
    return output if isinstance(output, DynamicFilterOutput) else DynamicFilterOutput(keep=bool(output))


def should_drop_dynamic_filter_output(output: DynamicFilterOutput, *, remaining_batch_size: int,
                                      target_data_size: int) -> bool:
    """Drop a rejected group unless it asked to be kept when the groups still in play (in flight or kept,
    `remaining_batch_size`) barely fill the rollout (`target_data_size`)."""
    if output.keep:
        return False
    return not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)


class DropCounter:
    """Counts dropped groups per reason for the rollout metrics."""

    def __init__(self) -> None:
        self.reasons: Counter[str] = Counter()

    def drop(self, reason: str | None) -> None:
        self.reasons[reason or "unspecified"] += 1

    def metrics(self) -> dict[str, float]:
        out = {f"rollout/dynamic_filter/drop_{reason}": float(n) for reason, n in sorted(self.reasons.items())}
        out["rollout/dynamic_filter/dropped_groups"] = float(sum(self.reasons.values()))
        return out
