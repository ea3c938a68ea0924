"""Test-only engine faults (SLIME_FAULT_INJECT, slime/distributed/fault_inject.py), injected by the
rollout manager into the engine's process tree while rollout <rollout_id> generates on it:

  kill_engine@<engine>[#<rollout_id>]   SIGKILL: the engine process exits mid-generation
  stall_engine@<engine>[#<rollout_id>]  SIGSTOP: it stops answering anything, /health included, with its
                                        connections open (upstream #1487's symptom: nothing moves, nothing fails)

"Mid-generation": the signal goes out once the engine reports running requests (the embedded engine's
/server_info; an engine that does not report them gets it after FIRE_AFTER_S); a fault whose
rollout ended first does not fire (it says so in the log).
"""
from __future__ import annotations

import logging
import signal
import threading
import time

import requests

from slime.distributed.fault_inject import ENGINE_FAULT_KINDS, fault_active
from slime.ray.engines.recovery import EngineFleet, FleetSlot
from slime.utils.deadlines import ENGINE_FAULT_READ_S
from slime.utils.security import auth_headers

logger = logging.getLogger(__name__)

SIGNALS = {"kill_engine": signal.SIGKILL, "stall_engine": signal.SIGSTOP}
FIRE_AFTER_S = 30.0
POLL_S = 0.05


def inject_engine_faults(fleet: EngineFleet, rollout_id: int, rollout_done: threading.Event) -> list[threading.Thread]:
    """Start one thread per fault configured for this rollout; each fires once, while the rollout runs."""
    threads = []
    for slot in fleet.serving():
        for kind in ENGINE_FAULT_KINDS:
            if fault_active(kind, slot.rank, rollout_id):
                thread = threading.Thread(target=_fire, args=(kind, slot, rollout_id, rollout_done), daemon=True,
                                          name=f"fault-{kind}-{slot.rank}")
                thread.start()
                threads.append(thread)
    return threads


def _fire(kind: str, slot: FleetSlot, rollout_id: int, rollout_done: threading.Event) -> None:
    end = time.monotonic() + FIRE_AFTER_S
    engine, url = slot.handle, slot.url  # the engine as it is now, not a later restart of it
    while time.monotonic() < end and not _running_requests(url):
        if rollout_done.wait(POLL_S):
            logger.warning("fault injection: %s on engine %d did not fire: rollout %d ended first", kind, slot.rank,
                           rollout_id)
            return
    logger.warning("fault injection: %s on engine %d (%s) during rollout %d", kind, slot.rank, url, rollout_id)
    engine.signal(SIGNALS[kind])


def _running_requests(url: str) -> int:
    try:
        return int(requests.get(url + "/server_info", headers=auth_headers(), timeout=ENGINE_FAULT_READ_S).json().get("running_requests") or 0)
    except (requests.RequestException, ValueError, AttributeError):
        return 0
