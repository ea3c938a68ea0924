"""One rollout (or eval) of the rollout manager under its deadline, with the engines watched.

`RolloutGuard.run` starts the rollout's clock (its budget: slime/utils/deadlines.py), bounds every HTTP request
of this process by it, resumes the health monitor, injects the test-only engine faults, and runs the
rollout function in a worker thread while it watches three things:

  the function ends        its result (or its error, named after a failed engine when one failed)
  an engine fails          with --use-fault-tolerance the fleet restarts it and requests that failed are
                           sent again once an engine serves; without, the rollout ends at once with
                           EngineFailedError naming the engine and what it held
  the deadline passes      RolloutTimeoutError with a table of the engines (process, /health, requests
                           they hold) and the requests still outstanding, taken before they are aborted
  an engine stalls         it holds requests without progress for --rollout-no-progress-timeout (the
                           monitor's progress watch): with --use-fault-tolerance a failure as above; without,
                           EngineStalledError naming it and what it holds, with the same tables

On either error the engines are told to abort everything (the rollout's requests stop generating), but for one
found stalled without answering (a stopped process answers no abort either): then the requests still in flight are
cancelled on the client side (those on that engine would never end). The worker gets `grace_s` (REQUEST_GRACE_S)
to end.

Between calls no rollout deadline bounds requests (each keeps its own timeout), but a background generator
(slime/rollout/fully_async_rollout.py) keeps sending them: with --use-fault-tolerance a /generate that failed
with its engine is sent again then too, once an engine serves (a dead engine process is failed and its restart
begun at once; the wait for a serving engine is bounded by BETWEEN_CALLS_WAIT_S). The retries count in the
next call's `retried_requests`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, TypeVar

from slime.ray.engines.faults import inject_engine_faults
from slime.config.health import HealthConfig
from slime.ray.engines.health import HealthMonitor, describe_engines
from slime.ray.engines.recovery import EngineFleet
from slime.ray.engines.progress import stalled_message
from slime.ray.rollout_manager.errors import EngineFailedError, EngineStalledError, RolloutError, RolloutTimeoutError
from slime.utils.deadlines import (ENGINE_EXIT_SEEN_S, ENGINE_FAULT_JOIN_S, ENGINE_STARTUP_S, REQUEST_GRACE_S,
                                    RolloutClock)
from slime.utils.http_utils import (HTTPStatusError, OutstandingRequest, abandon_requests, outstanding_requests,
                                    set_request_bounds)

logger = logging.getLogger(__name__)
T = TypeVar("T")

WATCH_POLL_S = 0.2
MAX_ATTEMPTS = 20  # a request is sent at most this often (fault tolerance)
RETRY_STATUSES = frozenset({500, 502, 503, 504})  # what routers answer when the engine behind them failed
BETWEEN_CALLS_WAIT_S = ENGINE_STARTUP_S  # between calls, a retry waits this long at most for a serving engine


class RolloutGuard:
    def __init__(self, config: HealthConfig, fleet: EngineFleet, grace_s: float = REQUEST_GRACE_S) -> None:
        self.config = config
        self.fleet = fleet
        self.grace_s = grace_s
        self.clock = RolloutClock()
        self.monitor = HealthMonitor(config, fleet)
        self.retried = 0  # requests sent again since the last call ended (between calls) and during this one
        fleet.on_recovered = self._recovered
        self._between_calls()

    def run(self, what: str, rollout_id: int, fn: Callable[[], T], *, budget_s: float,
            weights_version: str | None, inject_faults: bool = False) -> tuple[T, dict[str, float]]:
        """fn's result and this run's engine-fault counters, or a RolloutError naming engines and requests."""
        self.fleet.weights_version = weights_version
        self.fleet.changed.clear()
        before = self.fleet.counts()
        self.clock.start(budget_s)
        self._bound_requests()
        self.monitor.resume()
        done = threading.Event()
        faults = inject_engine_faults(self.fleet, rollout_id, done) if inject_faults else []
        worker = RolloutWorker(fn)
        label = f"rollout {rollout_id}: {what}"
        try:
            result = self._watch(worker, label, budget_s)
            done.set()
            for fault in faults:  # a fault that fired during the rollout is seen by the check below
                fault.join(timeout=ENGINE_FAULT_JOIN_S)
            self.fleet.check_processes()  # an engine that died while the others (or the router) covered for it
            if self.fleet.fatal is not None:
                raise self._end(worker, self.fleet.fatal, label)
        finally:
            done.set()
            self.monitor.pause()
            self.clock.stop()
            self._between_calls()
        after = self.fleet.counts()
        counters = {"engine_failures": after["failures"] - before["failures"],
                    "engine_restarts": after["restarts"] - before["restarts"], "retried_requests": self.retried}
        self.retried = 0
        return result, {key: float(value) for key, value in counters.items()}

    def left_s(self) -> float | None:
        return self.clock.left_s()

    def _bound_requests(self) -> None:
        set_request_bounds(self.clock.deadline + self.grace_s, self._retry if self.config.fault_tolerant else None)

    def _between_calls(self) -> None:
        """No rollout deadline; fault tolerance's retry stays for what a background generator sends."""
        set_request_bounds(None, self._retry_between_calls if self.config.fault_tolerant else None)

    def _recovered(self, seconds: float) -> None:
        """An engine serves again: the time it was lost is given back to the rollout's deadline."""
        if self.clock.deadline is not None:
            self.clock.extend(seconds)
            self._bound_requests()

    # ----- watching ---------------------------------------------------------------------
    def _watch(self, worker: "RolloutWorker", label: str, budget_s: float):
        while not worker.done.wait(WATCH_POLL_S):
            if self.fleet.fatal is not None:
                raise self._end(worker, self.fleet.fatal, label)
            if self.clock.expired():
                outstanding = outstanding_requests()
                table = describe_engines(self.fleet, self.config.timeout_s)
                message = (f"{label} did not finish within --rollout-timeout {budget_s:.0f}s; "
                           f"{len(outstanding)} request(s) outstanding")
                raise self._end(worker, RolloutTimeoutError(message, _details(table, outstanding)), label)
            stalls = self.monitor.stalls()
            if stalls:
                message = stalled_message(label, stalls, self.config.progress.engine_no_progress_s)
                raise self._end(worker, EngineStalledError(message), label)
        if worker.error is None:
            return worker.result
        if not isinstance(worker.error, RolloutError):
            self._see_exits()  # the function may have failed before the watch saw an engine die
        if self.fleet.fatal is not None:
            raise self._end(worker, self.fleet.fatal, label) from worker.error
        if self.fleet.failures and not isinstance(worker.error, RolloutError):
            failure = self.fleet.failures[-1]
            raise EngineFailedError(f"{label} failed after {failure.describe()}: {worker.error}",
                                    describe_engines(self.fleet, self.config.timeout_s)) from worker.error
        raise worker.error

    def _see_exits(self) -> None:
        """Look for exited engines until one is found or ENGINE_EXIT_SEEN_S passed: a request its engine's death failed
        can end the function before that engine's exit code reads as exited."""
        before = len(self.fleet.failures)
        end = time.monotonic() + ENGINE_EXIT_SEEN_S
        while True:
            self.fleet.check_processes()
            if len(self.fleet.failures) > before or time.monotonic() >= end:
                return
            time.sleep(WATCH_POLL_S)

    def _end(self, worker: "RolloutWorker", error: RolloutError, label: str) -> RolloutError:
        if not error.details:
            error.details = _details(describe_engines(self.fleet, self.config.timeout_s), outstanding_requests())
        logger.error("%s\n%s", error, error.details)
        silent = {stall.rank for stall in self.monitor.stalls() if not stall.answered}
        self._abort_engines(silent)
        if silent:  # what those engines hold would never end; the others' requests come back aborted as ever
            abandon_requests(f"{label} ended: {type(error).__name__}")
        if not worker.done.wait(self.grace_s + 5):
            logger.warning("%s: the rollout function did not return after its requests were aborted", label)
        return error

    def _abort_engines(self, silent: set[int]) -> None:
        """Abort the requests of every serving engine but the `silent` ones (each abort would wait out its timeout)."""
        from slime.backends.sglang_utils.http_client import ClientTimeouts, EngineHTTPError, SGLangHTTPClient

        for slot in self.fleet.serving():
            if slot.rank in silent:
                continue
            try:
                SGLangHTTPClient(slot.url, ClientTimeouts(control=self.config.timeout_s)).abort_all()
            except EngineHTTPError as exc:
                logger.warning("could not abort the requests of engine %d: %s", slot.rank, exc)

    # ----- fault tolerance: a request whose engine failed is sent again ------------------
    async def _retry(self, url: str, error: BaseException, attempt: int) -> bool:
        if attempt >= MAX_ATTEMPTS or not url.endswith("/generate"):
            return False
        if isinstance(error, HTTPStatusError) and error.status not in RETRY_STATUSES:
            return False
        if isinstance(error, TimeoutError):  # it ran out of the deadline as it was; recoveries may have extended it
            return not self.clock.expired()
        await asyncio.sleep(min(0.25 * 2 ** attempt, 5.0))  # let the monitor see the failure first
        while not self.fleet.any_serving():
            if self.clock.expired():
                return False
            await asyncio.sleep(0.5)
        self.retried += 1
        return True

    async def _retry_between_calls(self, url: str, error: BaseException, attempt: int) -> bool:
        """As `_retry`, with no rollout running: no health monitor looks at the engines, so a dead engine process
        is failed here (its restart begins), and the wait for a serving engine has a bound of its own."""
        if attempt >= MAX_ATTEMPTS or not url.endswith("/generate") or isinstance(error, TimeoutError):
            return False  # a timeout between calls is the request's own, final
        if isinstance(error, HTTPStatusError) and error.status not in RETRY_STATUSES:
            return False
        await asyncio.to_thread(self.fleet.check_processes)
        await asyncio.sleep(min(0.25 * 2 ** attempt, 5.0))
        end = time.monotonic() + BETWEEN_CALLS_WAIT_S
        while not self.fleet.any_serving():
            if time.monotonic() > end:
                logger.error("%s failed (%s) between rollouts and no engine served within %.0fs: not sent again",
                             url, error, BETWEEN_CALLS_WAIT_S)
                return False
            await asyncio.sleep(0.5)
        self.retried += 1
        return True


class RolloutWorker:
    """fn in a thread of its own, so the guard can stop waiting for it."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(fn,), name="rollout-fn", daemon=True).start()

    def _run(self, fn) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the guard's thread
            self.error = exc
        finally:
            self.done.set()


def _details(engine_table: str, outstanding: list[OutstandingRequest]) -> str:
    now = time.monotonic()
    lines = [engine_table, f"requests outstanding (client side, oldest first): {len(outstanding)}"]
    for request in outstanding[:20]:
        lines.append(f"  rid={request.rid or '-'}  {now - request.started:.1f}s  attempt {request.attempt}  "
                     f"{request.prompt_tokens if request.prompt_tokens is not None else '?'} prompt tokens  "
                     f"max_new_tokens={request.max_new_tokens}  {request.method} {request.url}")
    if len(outstanding) > 20:
        lines.append(f"  ... and {len(outstanding) - 20} more")
    return "\n".join(lines)
