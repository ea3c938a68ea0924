"""Test-only engine faults (SLIME_FAULT_INJECT, slime/distributed/fault_inject.py), injected by the
rollout manager into the engine's process tree while rollout <rollout_id> generates on it:

  kill_engine@<engine>[#<rollout_id>]   SIGKILL: the engine process exits mid-generation
  stall_engine@<engine>[#<rollout_id>]  SIGSTOP: it stops answering anything, /health included, with its
                                        connections open (upstream #1487's symptom: nothing moves, nothing fails)

"Mid-generation": the signal goes out once the engine reports requests it holds (the embedded engine's
/server_info; an engine that does not report them gets it after FIRE_AFTER_S); a fault whose
rollout ended first does not fire (it says so in the log), and the engine goes on as it was.
A killed engine is paused in place (/pause_generation in_place) before the rollout's first request, so what
it holds when the SIGKILL lands is certainly unfinished and must be generated again: on a loaded machine a
short rollout's requests could otherwise all end between the engine's report and the signal, and the kill
would prove nothing about recovery.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

import requests

from slime.backends.sglang_utils.http_client import ClientTimeouts, EngineHTTPError, SGLangHTTPClient
from slime.distributed.fault_inject import ENGINE_FAULT_KINDS, fault_active
from slime.ray.engines.recovery import EngineFleet, FleetSlot
from slime.utils.deadlines import ENGINE_FAULT_READ_S, ENGINE_HTTP_CONTROL_S
from slime.utils.security import auth_headers

logger = logging.getLogger(__name__)

SIGNALS = {"kill_engine": signal.SIGKILL, "stall_engine": signal.SIGSTOP}
FIRE_AFTER_S = 30.0
POLL_S = 0.05
HELD_UNTIL_KILLED = frozenset({"kill_engine"})


def inject_engine_faults(fleet: EngineFleet, rollout_id: int, rollout_done: threading.Event) -> list[threading.Thread]:
    """Start one thread per fault configured for this rollout; each fires once, while the rollout runs. Called
    before the rollout function starts: an engine to be killed is paused here, before any request reaches it."""
    threads = []
    for slot in fleet.serving():
        for kind in ENGINE_FAULT_KINDS:
            if fault_active(kind, slot.rank, rollout_id):
                if kind in HELD_UNTIL_KILLED:
                    _pause_in_place(slot)
                thread = threading.Thread(target=_fire, args=(kind, slot, rollout_id, rollout_done), daemon=True,
                                          name=f"fault-{kind}-{slot.rank}")
                thread.start()
                threads.append(thread)
    return threads


def _fire(kind: str, slot: FleetSlot, rollout_id: int, rollout_done: threading.Event) -> None:
    end = time.monotonic() + FIRE_AFTER_S
    engine, url = slot.handle, slot.url  # the engine as it is now, not a later restart of it
    held = 0
    while time.monotonic() < end and not (held := _held_requests(url)):
        if rollout_done.wait(POLL_S):
            logger.warning("fault injection: %s on engine %d did not fire: rollout %d ended first", kind, slot.rank,
                           rollout_id)
            if kind in HELD_UNTIL_KILLED:
                _continue(slot)
            return
    logger.warning("fault injection: %s on engine %d (%s) during rollout %d, holding %d request(s)", kind, slot.rank,
                   url, rollout_id, held)
    engine.signal(SIGNALS[kind])


def _held_requests(url: str) -> int:
    """Requests the engine runs or has queued (0 when it does not say or does not answer)."""
    try:
        info = requests.get(url + "/server_info", headers=auth_headers(), timeout=ENGINE_FAULT_READ_S).json()
        return int(info.get("running_requests") or 0) + int(info.get("queued_requests") or 0)
    except (requests.RequestException, ValueError, AttributeError, TypeError):
        return 0


def _pause_in_place(slot: FleetSlot) -> None:
    """Requests that reach the engine from now on wait in it, unfinished, until the kill."""
    try:
        SGLangHTTPClient(slot.url, ClientTimeouts(generate=ENGINE_HTTP_CONTROL_S)).pause_generation("in_place")
    except EngineHTTPError as exc:  # the fault still fires, only without the guarantee
        logger.warning("fault injection: could not pause engine %d before killing it: %s", slot.rank, exc)


def _continue(slot: FleetSlot) -> None:
    try:
        SGLangHTTPClient(slot.url, ClientTimeouts(control=ENGINE_HTTP_CONTROL_S)).continue_generation()
    except EngineHTTPError as exc:
        logger.warning("fault injection: could not let engine %d continue: %s", slot.rank, exc)
