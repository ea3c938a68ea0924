"""Health of the rollout engines: the monitor thread of a rollout, and the probes of a report.

As upstream, the monitor runs only while a rollout or an eval generates (engines legitimately stop
generating while paused for a weight push or released for training). It watches three things:

  processes   an exited engine process is a failure (EngineFleet.fail), noticed within a second
  health      with --use-fault-tolerance, every --rollout-health-check-interval (the first after
              --rollout-health-check-first-wait), a /health_generate that does not answer 200 within
              --rollout-health-check-timeout is a failure
  progress    every engine's work counters, every window / 12 (slime/ray/engines/progress.py): an engine
              that holds requests without progress for --rollout-no-progress-timeout is stalled. With
              --use-fault-tolerance that is a failure (restarted, its requests sent again); without, the
              rollout guard ends the rollout naming it (`stalls`). Not while generation is held for a
              weight push (its requests are being aborted).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from slime.ray.engines.progress import LoadsNotServed, ProgressWatch, Stall, read_loads
from slime.ray.engines.recovery import EngineFleet, FleetSlot
from slime.rollout import generation_gate
from slime.config.health import HealthConfig
from slime.utils.security import auth_headers

logger = logging.getLogger(__name__)

PROCESS_POLL_S = 1.0  # without fault tolerance: how often exited engine processes are noticed


def probe_health(url: str, timeout_s: float, path: str = "/health_generate") -> str | None:
    """None when the engine answers 200 within timeout_s, else what went wrong."""
    try:
        response = requests.get(url + path, headers=auth_headers(), timeout=timeout_s)
    except requests.Timeout:
        return f"no answer to {path} within {timeout_s:g}s"
    except requests.RequestException as exc:
        return f"{path} failed: {type(exc).__name__}"
    return None if response.status_code == 200 else f"{path} answered HTTP {response.status_code}"


def request_ids(url: str, timeout_s: float) -> tuple[str, ...] | None:
    """The request ids an engine reports holding (the embedded engine does; None when it does not say)."""
    try:
        info = requests.get(url + "/server_info", headers=auth_headers(), timeout=timeout_s).json()
    except (requests.RequestException, ValueError):
        return None
    ids = info.get("request_ids") if isinstance(info, dict) else None
    return tuple(ids) if isinstance(ids, list) else None


def held_count(url: str, timeout_s: float) -> str:
    """The requests an engine holds as its /v1/loads counts them ("?" when it does not say)."""
    try:
        loads = read_loads(url, timeout_s)
    except LoadsNotServed:
        return "?"
    return "?" if loads is None else str(sum(load.held for load in loads.values()))


class HealthMonitor:
    def __init__(self, config: HealthConfig, fleet: EngineFleet) -> None:
        self.config = config
        self.fleet = fleet
        self._active = threading.Event()
        self._closed = threading.Event()
        self._first_resume = True
        self._not_before = 0.0
        self.progress = ProgressWatch(config.progress.engine_no_progress_s)
        self._next_look = 0.0
        self._new_baseline = False
        self._stalls: list[Stall] = []
        self._unwatched: set[str] = set()  # engines that do not serve /v1/loads (said once)
        self._thread = threading.Thread(target=self._run, name="engine-health", daemon=True)
        self._thread.start()

    def resume(self) -> None:
        if self._first_resume and self.config.fault_tolerant:
            self._not_before = time.monotonic() + self.config.first_wait_s
        self._first_resume = False
        self._stalls, self._next_look, self._new_baseline = [], 0.0, True  # the watch is the monitor thread's alone
        self._active.set()

    def stalls(self) -> list[Stall]:
        """Engines found stalled without --use-fault-tolerance (the rollout guard ends the rollout on them)."""
        return list(self._stalls)

    def pause(self) -> None:
        self._active.clear()

    def close(self) -> None:
        self._closed.set()
        self._active.set()
        self._thread.join(timeout=self.config.timeout_s + 5)

    def _run(self) -> None:
        period = self.config.interval_s if self.config.fault_tolerant else PROCESS_POLL_S
        tick = min(period, self.config.progress.engine_look_s)
        next_check = 0.0
        while not self._closed.is_set():
            self._active.wait()
            if self._closed.is_set():
                return
            try:
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + period
                    self.fleet.check_processes()
                    if self.config.fault_tolerant and time.monotonic() >= self._not_before:
                        self._probe_all()
                if time.monotonic() >= self._next_look:
                    self._next_look = time.monotonic() + self.config.progress.engine_look_s
                    self._look_at_progress()
            except Exception:  # noqa: BLE001 - the monitor must outlive one bad look
                logger.exception("engine health check failed")
            self._closed.wait(tick)

    def _look_at_progress(self) -> None:
        held = generation_gate.is_held()  # a weight push aborts the requests: no progress is owed meanwhile
        if self._new_baseline or held:  # (a new rollout, or a push)
            self._new_baseline = False
            self.progress.restart()
        if held:
            return
        slots = [s for s in self.fleet.serving() if s.url not in self._unwatched]
        if not slots:
            return
        with ThreadPoolExecutor(max_workers=len(slots)) as pool:
            reads = list(pool.map(self._read_loads, slots))
        if not self._active.is_set() or generation_gate.is_held():  # paused or held during the reads: moot
            return
        self.progress.look({s.rank: (s.url, loads) for s, loads in zip(slots, reads) if s.url not in self._unwatched},
                           time.monotonic())
        for stall in self.progress.stalled(time.monotonic()):
            if self.config.fault_tolerant:
                self.fleet.fail(stall.rank, f"{stall.describe()} (--rollout-no-progress-timeout "
                                            f"{self.config.progress.engine_no_progress_s:g}s)")
            elif all(s.rank != stall.rank for s in self._stalls):
                self._stalls.append(stall)

    def _read_loads(self, slot: FleetSlot):
        try:
            return read_loads(slot.url, self.config.progress.engine_read_s)
        except LoadsNotServed as exc:
            self._unwatched.add(slot.url)
            logger.warning("engine %d at %s: its progress cannot be read (%s); only --rollout-timeout bounds a stall "
                           "of it", slot.rank, slot.url, exc)
            return None

    def _probe_all(self) -> None:
        slots = self.fleet.serving()
        if not slots:
            return
        with ThreadPoolExecutor(max_workers=len(slots)) as pool:
            problems = list(pool.map(self._probe, slots))
        for slot, problem in zip(slots, problems):
            if problem is not None and self._active.is_set():  # a pause during the probe makes it moot
                self.fleet.fail(slot.rank, problem)

    def _probe(self, slot: FleetSlot) -> str | None:
        problem = probe_health(slot.url, self.config.timeout_s)
        if problem is None:
            ids = request_ids(slot.url, self.config.timeout_s)
            if ids is not None:
                slot.last_request_ids = ids
        return problem


def describe_engines(fleet: EngineFleet, timeout_s: float) -> str:
    """One line per engine: process, /health, the requests it says it holds (a report's table)."""
    slots = list(fleet.slots)

    def look(slot: FleetSlot) -> tuple[str, str, str]:
        process = slot.handle.process_state()
        if not process.startswith("alive"):
            return process, "-", "-"
        health = probe_health(slot.url, timeout_s, path="/health") or "ok"
        if health != "ok":
            return process, health, "?"
        ids = request_ids(slot.url, timeout_s)
        if ids is None:  # SGLang lists no ids: how many its /v1/loads says
            return process, health, held_count(slot.url, timeout_s)
        return process, health, f"{len(ids)}: {', '.join(ids[:6])}" + (" ..." if len(ids) > 6 else "")

    with ThreadPoolExecutor(max_workers=max(1, len(slots))) as pool:
        looks = list(pool.map(look, slots))
    rows = [("engine", "url", "state", "process", "/health", "requests held")]
    rows += [(str(s.rank), s.url, s.state, *look_) for s, look_ in zip(slots, looks)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
