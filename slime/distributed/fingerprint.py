"""Stable hashes of plans and the fingerprint every rank compares at the plan fence."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

DIGEST_CHARS = 16


def _canonical(obj: Any) -> Any:
    """Turn obj into JSON-able data whose encoding does not depend on dict order or container type."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _canonical(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(_canonical(v) for v in obj)
    if isinstance(obj, float):
        return repr(obj)  # exact, so 0.1+0.2 and 0.3 differ as they do on the ranks
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if hasattr(obj, "tolist"):  # tensors and numpy arrays
        return _canonical(obj.tolist())
    return repr(obj)


def stable_hash(obj: Any) -> str:
    """Short sha256 of a canonical encoding: equal on every rank iff the values are equal."""
    encoded = json.dumps(_canonical(obj), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()[:DIGEST_CHARS]


@dataclass(frozen=True, kw_only=True)
class PlanFingerprint:
    """What every rank must agree on before forward/backward starts."""

    rollout_id: int
    step_id: int
    plan_hash: str  # stable_hash of the whole micro-batch plan
    num_micro_batches: int
    micro_batch_tokens: tuple[int, ...]  # tokens per micro-batch as planned for the CP group
    loss_token_total: int  # per-token-loss denominator of the step, from the plan
    metric_keys: tuple[str, ...] = ()
    optional_collectives: tuple[str, ...] = ()  # e.g. ("kl_loss", "entropy", "tis")

    def as_fields(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def plan_fingerprint(
    plan: Any,
    *,
    rollout_id: int,
    step_id: int,
    micro_batch_tokens: Sequence[int],
    loss_token_total: int,
    metric_keys: Iterable[str] = (),
    optional_collectives: Iterable[str] = (),
) -> PlanFingerprint:
    """Build the fingerprint of any plan object (a frozen dataclass is hashed field by field)."""
    return PlanFingerprint(
        rollout_id=rollout_id,
        step_id=step_id,
        plan_hash=stable_hash(plan),
        num_micro_batches=len(micro_batch_tokens),
        micro_batch_tokens=tuple(int(t) for t in micro_batch_tokens),
        loss_token_total=int(loss_token_total),
        metric_keys=tuple(sorted(metric_keys)),
        optional_collectives=tuple(sorted(optional_collectives)),
    )
