"""Fences: every rank shows every other rank what it believes about the step, over a gloo group.

Clean path: one all_gather_into_tensor of a fixed-size payload (phase, sequence number, a short
digest per field). Only when digests differ does a second gather fetch the full values of the
differing fields, so that the error can print a table of ranks x fields. Every rank sees the same
gathered payloads, so every rank takes the same branch and raises the same error together.

Fields that must agree only among some ranks (what one DP rank computed for its own samples, the same on
its TP/CP/PP peers and different on the next DP rank's) travel in the same gather as `ScopedFields`: each
rank names its scope (its DP rank) and those fields are compared among the ranks of the same scope. Every
rank sees every payload, so every rank still takes the same branch.

A fence waits as long as some rank makes progress (slime/distributed/progress.py) and fails when
none did for its timeout: ranks that wait at a fence while a peer works (the weight push) wait
for as long as the work goes on. The gloo group's own timeout (--distributed-timeout-minutes)
stays the hard limit of one wait.
"""
from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed.distributed_c10d as c10d

from slime.distributed.errors import CollectiveDivergenceError, FenceTimeoutError, HubUnreachableError
from slime.distributed.fingerprint import stable_hash
from slime.distributed.hang_report import format_table
from slime.distributed.ledger import FENCE_GROUP_NAME, Ledger
from slime.distributed.progress import ProgressView, suspects

PAYLOAD_BYTES = 4096
_WAIT_SLICE_S = 1.0  # how often a waiting fence looks at the progress of its peers
_VALUE_CHARS = 120  # a table cell


@dataclass(frozen=True)
class ScopedFields:
    """Fields compared only among the ranks that give the same `scope` (e.g. "dp1": one DP rank's model-parallel
    group). Their names differ from the fence's own fields."""

    scope: str
    fields: Mapping[str, object]


class Fence:
    """Callable fence over a persistent gloo group; `fence(phase, fields)` raises on divergence or timeout."""

    def __init__(
        self,
        group: object,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        ledger: Ledger | None = None,
    ):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.ledger = ledger
        self.progress = ProgressView(ledger)
        self.seq = 0

    def __call__(self, phase: str, fields: Mapping[str, object] | None = None, *, timeout_s: float | None = None,
                 scoped: ScopedFields | None = None) -> None:
        fields = dict(fields or {})
        self.seq += 1
        if scoped is not None and set(scoped.fields) & set(fields):
            raise ValueError(f"fence '{phase}': {sorted(set(scoped.fields) & set(fields))} are scoped and not")
        if self.ledger is not None:  # the recorded sequence keeps what each rank claimed (e.g. its plan)
            noted = fields if scoped is None else {**fields, "scoped": {"scope": scoped.scope, **scoped.fields}}
            self.ledger.note(f"fence:{phase}", noted)
        payload = {"phase": phase, "seq": self.seq, "digests": {k: stable_hash(v) for k, v in sorted(fields.items())}}
        if scoped is not None:
            payload.update(scope=scoped.scope, scoped={k: stable_hash(v) for k, v in sorted(scoped.fields.items())})
        gathered = self._gather_payloads(phase, payload, timeout_s or self.timeout_s)
        differing, differing_scoped = _differing_fields(gathered), _differing_scoped_fields(gathered)
        if differing or differing_scoped:
            mine = {**fields, **(scoped.fields if scoped is not None else {})}
            self._raise_divergence(phase, mine, gathered, differing, differing_scoped)

    # -- clean path ------------------------------------------------------------------------
    def _gather_payloads(self, phase: str, payload: dict, timeout_s: float) -> list[dict]:
        local = _encode(payload)
        out = torch.empty(self.world_size * PAYLOAD_BYTES, dtype=torch.uint8)
        entry = self._ledger_begin(phase)
        error = None
        try:
            work = c10d.all_gather_into_tensor(out, local, group=self.group, async_op=True)
            self._wait(work, timeout_s)
        except HubUnreachableError as exc:  # the peers' progress is unknown: named as what it is
            error = f"{type(exc).__name__}: {exc}"
            raise
        except (RuntimeError, TimeoutError) as exc:  # gloo: "timed out" or a peer closed the connection
            error = f"{type(exc).__name__}: {exc}"
            raise self._timeout_error(phase, timeout_s, error) from exc
        finally:
            if entry is not None:
                self.ledger.end(entry, error)
        return [_decode(chunk) for chunk in out.view(self.world_size, PAYLOAD_BYTES)]

    def _wait(self, work, timeout_s: float) -> None:
        """Wait in slices until done; raise when no rank made progress for timeout_s."""
        start = time.time()
        while True:
            try:
                work.wait(timeout=timedelta(seconds=min(_WAIT_SLICE_S, timeout_s)))
                return
            except RuntimeError:
                if work.is_completed():
                    # Either the op failed (a peer closed, gloo's own timeout) or it completed just after
                    # this slice ran out: a second wait returns at once, or raises the op's own error.
                    work.wait()
                    return
            idle = self.progress.idle_s(since=start, window_s=timeout_s)
            if idle > timeout_s:
                raise TimeoutError(f"no rank made progress for {idle:.0f}s")

    def _ledger_begin(self, phase: str):
        if self.ledger is None:
            return None
        return self.ledger.begin_named(f"fence:{phase}", FENCE_GROUP_NAME, tuple(range(self.world_size)), (PAYLOAD_BYTES,), "uint8")

    def _timeout_error(self, phase: str, timeout_s: float, cause: str) -> FenceTimeoutError:
        # the table of every rank is rendered once, by the driver or `python -m slime.distributed.hang_report`
        lagging = suspects(self.ledger, self.world_size)
        message = (
            f"fence '{phase}' (seq {self.seq}) on rank {self.rank}: no progress for {timeout_s:g}s; "
            f"lagging ranks={list(lagging)}; cause: {cause[:300]}"
        )
        return FenceTimeoutError(message, phase=phase, lagging_ranks=lagging)

    # -- divergence path -------------------------------------------------------------------
    def _raise_divergence(self, phase: str, fields: dict, gathered: list[dict], differing: list[str],
                          differing_scoped: list[str] = ()) -> None:
        names = [*differing, *differing_scoped]
        mine = {name: _describe_value(name, payload_value(name, fields, self.seq, phase)) for name in names}
        values: list[dict | None] = [None] * self.world_size
        c10d.all_gather_object(values, mine, group=self.group)  # all ranks are here: the first gather passed
        odd = tuple(sorted(set(_odd_ranks(gathered, differing)) | set(_odd_scoped_ranks(gathered, differing_scoped))))
        scopes = ["scope"] if differing_scoped else []
        rows = [[r] + [gathered[r].get("scope", "-") for _ in scopes] + [values[r][name] for name in names]
                for r in range(self.world_size)]
        table = format_table(["rank", *scopes, *names], rows)
        where = f"in fields {differing}" if differing else ""
        if differing_scoped:
            where += f"{' and ' if differing else ''}within their scope in fields {list(differing_scoped)}"
        message = f"ranks {list(odd)} diverge at fence '{phase}' {where} (rank {self.rank} reporting)\n{table}"
        raise CollectiveDivergenceError(message, phase=phase, ranks=odd, fields=tuple(names))


def payload_value(name: str, fields: dict, seq: int, phase: str) -> object:
    if name == "phase":
        return phase
    if name == "seq":
        return seq
    return fields.get(name, "<missing>")


def _describe_value(name: str, value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= _VALUE_CHARS else f"{text[:_VALUE_CHARS - 20]}..#{stable_hash(value)[:8]}"


def _field_digest(payload: dict, name: str) -> str:
    if name in ("phase", "seq"):
        return str(payload[name])
    return payload["digests"].get(name, "<missing>")


def _differing_fields(gathered: list[dict]) -> list[str]:
    names = ["phase", "seq"] + sorted({k for p in gathered for k in p["digests"]})
    return [n for n in names if len({_field_digest(p, n) for p in gathered}) > 1]


def _odd_ranks(gathered: list[dict], differing: list[str]) -> tuple[int, ...]:
    """Ranks that disagree with the majority on some field (ties: with rank 0's value)."""
    odd: set[int] = set()
    for name in differing:
        odd.update(_minority(list(enumerate(_field_digest(p, name) for p in gathered))))
    return tuple(sorted(odd))


def _minority(digests: list[tuple[int, str]]) -> list[int]:
    """The ranks whose digest is not the majority's (ties: the lowest rank's)."""
    counts = Counter(d for _, d in digests)
    top = max(counts.values())
    majority = next(d for _, d in digests if counts[d] == top)
    return [rank for rank, d in digests if d != majority]


def _scopes(gathered: list[dict]) -> list[list[int]]:
    """The ranks of each scope (ranks that gave none form one scope)."""
    by_scope: dict[str | None, list[int]] = defaultdict(list)
    for rank, payload in enumerate(gathered):
        by_scope[payload.get("scope")].append(rank)
    return list(by_scope.values())


def _scoped_digest(payload: dict, name: str) -> str:
    return payload.get("scoped", {}).get(name, "<missing>")


def _differing_scoped_fields(gathered: list[dict]) -> list[str]:
    names = sorted({k for p in gathered for k in p.get("scoped", {})})
    return [n for n in names if any(len({_scoped_digest(gathered[r], n) for r in ranks}) > 1
                                    for ranks in _scopes(gathered))]


def _odd_scoped_ranks(gathered: list[dict], differing: list[str]) -> tuple[int, ...]:
    """Per scope, the ranks that disagree with their scope's majority."""
    odd: set[int] = set()
    for name in differing:
        for ranks in _scopes(gathered):
            odd.update(_minority([(r, _scoped_digest(gathered[r], name)) for r in ranks]))
    return tuple(sorted(odd))


def _encode(payload: dict) -> torch.Tensor:
    raw = json.dumps(payload, separators=(",", ":")).encode()
    if len(raw) > PAYLOAD_BYTES:
        # Raised before the collective on the offending rank; its peers then time out at this fence.
        raise ValueError(f"fence payload of {len(raw)} bytes exceeds {PAYLOAD_BYTES}: too many fields")
    buf = torch.zeros(PAYLOAD_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def _decode(chunk: torch.Tensor) -> dict:
    raw = chunk.numpy().tobytes().rstrip(b"\x00")
    return json.loads(raw.decode())
