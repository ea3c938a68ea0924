"""User hooks that rewrite the rollout batch on every rank, fenced on what they changed.

--rollout-data-postprocess-path and --custom-advantage-function-path run on every rank, each on its own
copy of the batch. What follows assumes every rank holds the same result: changed loss masks re-plan the
step (a rank that re-plans while a peer does not meets the peer in another collective), advantages feed
the loss. A hook that reads rank-local state (its own random generator, the clock, a file one node sees)
breaks that silently. So whenever such a hook is set, every rank fences the keys the hook changed and a
digest of their new values, before anything depends on them: a rank whose hook did something else ends
the step with a CollectiveDivergenceError that names it and the keys.

Keys that hold per-DP-rank values (the log-probs a DP rank computed for its own samples and what derives
from them) differ between DP replicas by design, but not within one DP rank: its TP/CP/PP peers computed the
same samples and feed one sharded loss. The caller names them and its DP rank (`PerDpKeys`); the same fence
compares them among the ranks of that DP rank's model-parallel group (slime/distributed/fence.py, ScopedFields).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from slime.distributed.fence import ScopedFields
from slime.distributed.fingerprint import DIGEST_CHARS, stable_hash

Fence = Callable[..., None]  # fence(phase, fields, scoped=ScopedFields | None)


def value_digest(value: object) -> str:
    """Digest of one batch entry; per-sample lists of numbers go through their bytes (a batch holds millions)."""
    if isinstance(value, list) and value and all(isinstance(row, list) for row in value):
        try:
            return _rows_digest(value)
        except (TypeError, ValueError, RuntimeError):  # not numbers: the generic encoding
            pass
    return stable_hash(value)


def _rows_digest(rows: list[list]) -> str:
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    flat = [x for r in rows for x in r]
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in flat):
        raise TypeError("not numbers")
    values = torch.tensor(flat, dtype=torch.float64)  # exact: a float is a double, token ids are far below 2**53
    digest = hashlib.sha256(lengths.numpy().tobytes())
    digest.update(values.numpy().tobytes())
    return digest.hexdigest()[:DIGEST_CHARS]


@dataclass(frozen=True)
class PerDpKeys:
    """Batch keys holding per-DP-rank values (DP > 1), and this rank's DP rank: they are fenced among its peers."""

    keys: tuple[str, ...]
    dp_rank: int


def batch_digests(data: Mapping[str, object]) -> dict[str, str]:
    return {key: value_digest(value) for key, value in sorted(data.items())}


def run_fenced_hook(fence: Fence, phase: str, rollout_id: int, data: dict, hook: Callable[[], None], *,
                    per_dp: PerDpKeys | None = None) -> frozenset[str]:
    """Run `hook()` (it edits `data` in place), then fence what it changed: every key on every rank, the per-DP
    keys among the ranks of this DP rank. Returns the changed keys every rank agreed on (never a per-DP one)."""
    before = batch_digests(data)
    hook()
    after = batch_digests(data)
    changed = {key: digest for key, digest in after.items() if before.get(key) != digest}
    removed = sorted(set(before) - set(after))
    local = set(per_dp.keys) if per_dp is not None else set()
    shared_changed = {key: digest for key, digest in changed.items() if key not in local}
    shared_removed = [key for key in removed if key not in local]
    fields: dict[str, object] = {"rollout_id": rollout_id, "changed_keys": sorted(shared_changed),
                                 "removed_keys": shared_removed, **_values(shared_changed)}
    scoped = None
    if per_dp is not None:
        dp_changed = {key: digest for key, digest in changed.items() if key in local}
        scoped = ScopedFields(f"dp{per_dp.dp_rank}", {
            "dp_changed_keys": sorted(dp_changed), "dp_removed_keys": [key for key in removed if key in local],
            **_values(dp_changed)})
    fence(phase, fields, scoped=scoped)
    return frozenset(shared_changed) | frozenset(shared_removed)


def _values(changed: dict[str, str]) -> dict[str, str]:
    return {f"value/{key}": digest for key, digest in changed.items()}
