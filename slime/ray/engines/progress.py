"""Engine progress while a rollout generates: what each engine reports of its work, and the no-progress rule.

A generation of 16k tokens legitimately takes minutes without a request completing, so finished requests do not
tell a slow engine from a stalled one; the engine's own work counters do. SGLang serves them at `GET /v1/loads`
(0.5.15.post1 to 0.5.23; the embedded engine serves the same route and fields), one entry per DP rank, written by
that rank's scheduler after every prefill batch and every few decode steps and read from shared memory by the HTTP
process, so a scheduler stuck in a kernel or a collective leaves them frozen while the route still answers:

  held        num_running_reqs + num_waiting_reqs: the requests the rank holds
  work        num_used_tokens (the KV cache fills by one token per running request and decode step, empties as
              requests finish), total_prefill_uncached_tokens and decode_moments (SGLang >= 0.5.23: decode steps
              and tokens generated); a change in any of them is progress, as is `held` going down

`ProgressWatch` applies the rule to successive reads (`EngineLoads`, or None when an engine did not answer within
the read's limit): a DP rank that holds requests and whose work does not move for the window, or an engine that
does not answer at all for the window, is stalled. An engine whose answer is not SGLang's loads (an external engine
of another kind) cannot be judged and is left out (`LoadsNotServed`). The windows: slime/utils/deadlines.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import requests

from slime.utils.security import auth_headers

LOADS_PATH = "/v1/loads?include=core"
WORK_FIELDS = ("num_used_tokens", "total_prefill_uncached_tokens", "decode_moments")


class LoadsNotServed(RuntimeError):
    """The engine answered, but not with SGLang's /v1/loads: its progress cannot be read."""


@dataclass(frozen=True)
class RankLoad:
    """One DP rank of an engine, as one read saw it."""

    held: int
    work: tuple
    """The work counters (WORK_FIELDS), compared whole: any change is progress."""


EngineLoads = Mapping[int, RankLoad]
"""DP rank -> its load."""


def parse_loads(body: Any) -> dict[int, RankLoad]:
    """SGLang's /v1/loads answer as DP rank -> load; LoadsNotServed when it is not one."""
    entries = body.get("loads") if isinstance(body, dict) else None
    if not isinstance(entries, list) or not entries:
        raise LoadsNotServed(f"no 'loads' list in {str(body)[:200]!r}")
    loads = {}
    for entry in entries:
        try:
            held = int(entry["num_running_reqs"]) + int(entry["num_waiting_reqs"])
            work = tuple(_counter(entry.get(name)) for name in WORK_FIELDS)
            loads[int(entry.get("dp_rank", 0))] = RankLoad(held=held, work=work)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LoadsNotServed(f"a /v1/loads entry without SGLang's fields ({exc!r}): {str(entry)[:200]!r}") from None
    return loads


def _counter(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def read_loads(url: str, timeout_s: float) -> dict[int, RankLoad] | None:
    """The engine's loads; None when it did not answer within timeout_s (or the connection failed)."""
    try:
        response = requests.get(url + LOADS_PATH, headers=auth_headers(), timeout=timeout_s)
    except requests.RequestException:
        return None
    if response.status_code >= 500:
        return None  # up but failing: no progress seen
    if response.status_code != 200:
        raise LoadsNotServed(f"GET {LOADS_PATH} answered HTTP {response.status_code}")
    try:
        body = response.json()
    except ValueError:
        raise LoadsNotServed(f"GET {LOADS_PATH} answered no JSON") from None
    return parse_loads(body)


@dataclass(frozen=True)
class Stall:
    """An engine found stalled: what the error or the failure says of it."""

    rank: int
    url: str
    silent_s: float
    """Seconds since its last progress (answered) or its last answer (not answered)."""
    held: int | None
    """Requests it holds (at its last answer; None: it never answered)."""
    answered: bool
    dp_rank: int | None = None

    def describe(self) -> str:
        where = f"engine {self.rank} at {self.url}" + (f" (DP rank {self.dp_rank})" if self.dp_rank else "")
        if self.answered:
            return f"{where} holds {self.held} request(s) and made no progress for {self.silent_s:.0f}s"
        held = "it never answered" if self.held is None else f"it held {self.held} request(s) at its last answer"
        return f"{where} did not answer GET /v1/loads for {self.silent_s:.0f}s ({held})"


@dataclass
class _Engine:
    url: str
    answered_at: float
    """Its last answer (when first looked at: the start of its silence)."""
    loads: dict[int, RankLoad] = field(default_factory=dict)
    since: dict[int, float] = field(default_factory=dict)
    """Per DP rank: its last progress, or the last read where it held nothing."""


class ProgressWatch:
    """The no-progress rule over successive looks at the engines (pure: the caller reads and keeps the time)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._engines: dict[int, _Engine] = {}

    def restart(self) -> None:
        """Forget every engine: the next look is a new baseline (a rollout starts, generation was held)."""
        self._engines.clear()

    def look(self, reads: Mapping[int, tuple[str, EngineLoads | None]], now: float) -> None:
        """One look: engine rank -> (its URL, its loads or None when it did not answer). Engines not in it (not
        serving any more) are forgotten; an engine at a new URL (restarted) starts anew."""
        for rank in set(self._engines) - set(reads):
            del self._engines[rank]
        for rank, (url, loads) in reads.items():
            engine = self._engines.get(rank)
            if engine is None or engine.url != url:
                engine = self._engines[rank] = _Engine(url=url, answered_at=now)
            if loads is not None:
                _observe(engine, loads, now)

    def stalled(self, now: float) -> list[Stall]:
        stalls = []
        for rank, engine in sorted(self._engines.items()):
            silent = now - engine.answered_at
            if silent >= self.window_s:
                held = sum(load.held for load in engine.loads.values()) if engine.loads else None
                stalls.append(Stall(rank, engine.url, silent, held, answered=False))
                continue
            for dp_rank, load in sorted(engine.loads.items()):
                idle = now - engine.since[dp_rank]
                if load.held > 0 and idle >= self.window_s:
                    stalls.append(Stall(rank, engine.url, idle, load.held, answered=True, dp_rank=dp_rank))
                    break
        return stalls


def _observe(engine: _Engine, loads: EngineLoads, now: float) -> None:
    engine.answered_at = now
    for dp_rank, load in loads.items():
        before = engine.loads.get(dp_rank)
        if before is None or load.held == 0 or load.work != before.work or load.held < before.held:
            engine.since[dp_rank] = now
        engine.loads[dp_rank] = load


def stalled_message(label: str, stalls: list[Stall], window_s: float) -> str:
    """The one line of a rollout ended by stalled engines."""
    return (f"{label}: {'; '.join(s.describe() for s in stalls)} (--rollout-no-progress-timeout {window_s:g}s); "
            "pass --use-fault-tolerance to restart stalled engines and go on")
