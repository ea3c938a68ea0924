"""The rollout engines as the rollout manager sees them, and how a failed one comes back.

Each engine is in one state:

  serving       in the router, at the current weights
  failed        detected dead or unresponsive: its process tree is killed and it is out of the router
  starting      a new process on a new port is starting (--use-fault-tolerance only)
  needs_weights started, not yet in the router: it holds the checkpoint's weights, not the trainer's

A `needs_weights` engine joins the router only after the trainer pushed the current weights to it and
its weight_version reads back as that version (`caught_up`); until then no request can reach it.
Without --use-fault-tolerance a failure is final: it is recorded for the rollout to raise.
"""
from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import psutil

from slime.backends.sglang_utils.http_client import ClientTimeouts, SGLangHTTPClient
from slime.ray.rollout_manager.errors import EngineFailedError, EngineRecoveryError
from slime.router.workers import RouterWorkers, RouterWorkersError
from slime.utils.deadlines import ENGINE_ACTOR_CALL_S

logger = logging.getLogger(__name__)

SERVING, FAILED, STARTING, NEEDS_WEIGHTS = "serving", "failed", "starting", "needs_weights"


@dataclass(frozen=True)
class EngineFailure:
    rank: int
    url: str
    reason: str
    requests: tuple[str, ...]
    """Request ids the engine held at its last look before failing (empty when it did not say)."""
    at: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        held = f"; it held {len(self.requests)} request(s): {', '.join(self.requests[:8])}" if self.requests else ""
        return f"engine {self.rank} at {self.url}: {self.reason}{held}"


class EngineProcess(Protocol):
    """What the fleet needs of a started engine, wherever its process runs: `LocalEngine` for a child of
    this process, `slime.ray.engines.actor.RemoteEngine` for one started by its engine actor on its bundle."""

    url: str

    def exit_code(self) -> int | None: ...

    def signal(self, sig: int) -> None:
        """Send `sig` to the engine's whole process tree."""

    def process_state(self) -> str:
        """'alive', 'stopped (SIGSTOP)' or 'exited with code N', for reports."""


@dataclass
class FleetSlot:
    rank: int
    handle: EngineProcess
    state: str = SERVING
    last_request_ids: tuple[str, ...] = ()
    restarts: int = 0

    @property
    def url(self) -> str:
        return self.handle.url

    def exit_code(self) -> int | None:
        return self.handle.exit_code()


def signal_process_tree(pid: int, sig: int) -> None:
    """Send sig to a process and all its descendants (SGLang runs its scheduler in child processes)."""
    try:
        root = psutil.Process(pid)
        processes = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def local_process_state(process: subprocess.Popen) -> str:
    code = process.poll()
    if code is not None:
        return f"exited with code {code}"
    try:
        if psutil.Process(process.pid).status() == psutil.STATUS_STOPPED:
            return "stopped (SIGSTOP)"
    except psutil.NoSuchProcess:
        return "exited"
    return "alive"


class LocalEngine:
    """An engine process that is a child of this process (launcher.EngineHandle: `.url`, `.server.process`,
    `.stop()`)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.url = handle.url

    def exit_code(self) -> int | None:
        return self.handle.server.process.poll()

    def signal(self, sig: int) -> None:
        signal_process_tree(self.handle.server.process.pid, sig)

    def process_state(self) -> str:
        return local_process_state(self.handle.server.process)

    def stop(self) -> None:
        if self.process_state().startswith("stopped"):
            self.signal(signal.SIGKILL)  # a stopped process never handles SIGTERM
        self.handle.stop()


class EngineFleet:
    def __init__(self, engines: list[EngineProcess], *, relaunch: Callable[[int], EngineProcess],
                 router: RouterWorkers | None,
                 fault_tolerant: bool, control_timeout_s: float = ENGINE_ACTOR_CALL_S) -> None:
        self.slots = [FleetSlot(rank, handle) for rank, handle in enumerate(engines)]
        self.relaunch = relaunch
        self.router = router
        self.fault_tolerant = fault_tolerant
        self.timeouts = ClientTimeouts(control=control_timeout_s)
        self.failures: list[EngineFailure] = []
        self.fatal: BaseException | None = None  # a failure the rollout must raise (no fault tolerance, or a failed restart)
        self.weights_version: str | None = None  # what a restarted engine must reach before serving; None: its own
        self.epoch = 0  # bumped whenever an engine's URL changes
        self.changed = threading.Event()  # set at every failure, for the rollout guard's wait
        self.on_recovered: Callable[[float], None] | None = None  # seconds from a failure to serving again
        self._lock = threading.RLock()
        self._restarts: list[threading.Thread] = []
        self._restarts_begun: list[int] = []  # engine ranks, one entry per restart

    # ----- views ------------------------------------------------------------------------
    def urls(self) -> list[str]:
        """Engines that hold or may receive weights (everything but failed and starting ones), in rank order."""
        with self._lock:
            return [s.url for s in self.slots if s.state in (SERVING, NEEDS_WEIGHTS)]

    def serving(self) -> list[FleetSlot]:
        with self._lock:
            return [s for s in self.slots if s.state == SERVING]

    def needing_weights(self) -> list[str]:
        with self._lock:
            return [s.url for s in self.slots if s.state == NEEDS_WEIGHTS]

    def any_serving(self) -> bool:
        return bool(self.serving())

    def counts(self) -> dict[str, int]:
        """Failures seen and restarts begun so far (a restart may end after the rollout that began it)."""
        with self._lock:
            return {"failures": len(self.failures), "restarts": len(self._restarts_begun)}

    # ----- failure and restart ----------------------------------------------------------
    def fail(self, rank: int, reason: str) -> None:
        """An engine was found dead or unresponsive: kill it, take it out of the router, restart it (fault
        tolerance) or record the failure for the rollout to raise."""
        with self._lock:
            slot = self.slots[rank]
            if slot.state != SERVING:
                return
            slot.state = FAILED
            failure = EngineFailure(rank, slot.url, reason, slot.last_request_ids)
            self.failures.append(failure)
            if self.fault_tolerant:  # counted with the failure: a rollout that ends meanwhile sees both or neither
                self._restarts_begun.append(rank)
        logger.error("rollout %s", failure.describe())
        slot.handle.signal(signal.SIGKILL)
        self._leave_router(slot.url)
        if self.fault_tolerant:
            thread = threading.Thread(target=self._restart, args=(slot,), name=f"restart-engine-{rank}", daemon=True)
            self._restarts.append(thread)
            thread.start()
        elif self.fatal is None:
            self.fatal = EngineFailedError(
                f"{failure.describe()}; pass --use-fault-tolerance to restart failed engines and go on")
        self.changed.set()

    def _restart(self, slot: FleetSlot) -> None:
        with self._lock:
            slot.state = STARTING
        start = time.monotonic()
        try:
            handle = self.relaunch(slot.rank)
        except Exception as exc:  # noqa: BLE001 - the rollout raises it, with the engine named
            logger.exception("engine %d could not be restarted", slot.rank)
            self.fatal = self.fatal or EngineRecoveryError(f"engine {slot.rank} could not be restarted: {exc}")
            self.changed.set()
            return
        with self._lock:
            slot.handle, slot.restarts, slot.last_request_ids = handle, slot.restarts + 1, ()
            slot.state = NEEDS_WEIGHTS
            self.epoch += 1
        logger.info("engine %d restarted at %s in %.1fs", slot.rank, handle.url, time.monotonic() - start)
        if self.weights_version is None:  # nothing was ever pushed: the checkpoint's weights are current
            self.caught_up([handle.url], None)
        self.changed.set()

    def wait_restarts(self, timeout_s: float) -> None:
        """Wait for restarts in progress (a sync or the next rollout then sees the new engines)."""
        end = time.monotonic() + timeout_s
        for thread in list(self._restarts):
            thread.join(max(0.0, end - time.monotonic()))
        self._restarts = [t for t in self._restarts if t.is_alive()]
        if self._restarts:
            raise EngineRecoveryError(f"{len(self._restarts)} engine restart(s) still running after {timeout_s:.0f}s")

    def check_processes(self) -> None:
        """Fail every serving engine whose process has exited (cheap: no HTTP)."""
        for slot in self.serving():
            code = slot.exit_code()
            if code is not None:
                self.fail(slot.rank, f"process exited with code {code}")

    def caught_up(self, urls: list[str], version: str | None) -> None:
        """The trainer pushed `version` to these restarted engines: check it reads back, then let them serve."""
        for url in urls:
            with self._lock:
                slot = next((s for s in self.slots if s.url == url and s.state == NEEDS_WEIGHTS), None)
            if slot is None:
                continue
            if version is not None:
                got = SGLangHTTPClient(url, self.timeouts).weight_version()
                if got != version:
                    raise EngineRecoveryError(f"restarted engine {slot.rank} at {url} reports weight_version "
                                              f"{got!r} after the push of {version!r}")
            self._join_router(url)
            with self._lock:
                slot.state = SERVING
                failed_at = max((f.at for f in self.failures if f.rank == slot.rank), default=time.monotonic())
            logger.info("engine %d serves again at %s (weights %s)", slot.rank, url, version or "of the checkpoint")
            if self.on_recovered is not None:
                self.on_recovered(time.monotonic() - failed_at)

    # ----- router -----------------------------------------------------------------------
    def _leave_router(self, url: str) -> None:
        if self.router is None:
            return
        try:
            self.router.remove(url)
        except RouterWorkersError as exc:  # the router's own retries skip a dead worker meanwhile
            logger.warning("could not remove %s from the router: %s", url, exc)

    def _join_router(self, url: str) -> None:
        if self.router is not None:
            self.router.add(url)
