"""Turn a stalled phase into an error that names the phase and the ranks others wait for.

A daemon thread watches the phases armed by `with watchdog.phase(name, window_s):`. A phase is
stalled when neither this rank nor any peer (the progress hub, or ledger files) made progress for
its window (slime/distributed/progress.py), however long the phase has run. Then the watchdog
writes the hang table and this process's stacks to `<ledger dir>/stacks_rank<N>.txt`, prints one
line, and raises HangError in the thread that armed the phase (HubUnreachableError when the
progress hub stopped answering for the window: the peers' progress is then unknown). If that
thread is blocked in native code and the error has not landed within `grace_s`, the process exits
with code 3 after printing `HANG: phase=<p> stuck ranks=[...]`.

No HangError outlives its phase: the decision to trip and the injection are made under the lock
the phase takes to disarm, a phase that ends after the decision but before the injection raises
HangError itself at its exit (and is never injected), and one that ends after the injection clears
any error still pending.
"""
from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator

from slime.distributed.errors import HangError, HubUnreachableError
from slime.distributed.ledger import Ledger
from slime.distributed.progress import ProgressView, hang_table, suspects
from slime.utils.deadlines import FENCE_REPORT_MARGIN_S, WATCHDOG_EXIT_GRACE_S

HANG_EXIT_CODE = 3


@dataclass(eq=False)  # identity: two phases may share name and window
class _Armed:
    name: str
    window_s: float
    thread_id: int
    armed_at: float  # wall clock, the ledger's clock
    tripped: bool = False  # the watchdog decided this phase is hung (under the lock)
    injected: bool = False  # HangError was sent to the thread (under the lock)
    delivered: bool = False  # it landed (set when the exception is instantiated in the thread)
    path: str = ""  # the ledger's phase path when the watchdog decided
    summary: str = ""
    stuck: tuple[int, ...] = ()  # the ranks the trip blames (HangError.lagging_ranks: a restart counts them)
    error_type: type[Exception] = HangError


class Watchdog:
    def __init__(
        self,
        deadline_s: float,
        ledger_dir: str | None,
        rank: int,
        world_size: int,
        *,
        ledger: Ledger | None = None,
        grace_s: float = WATCHDOG_EXIT_GRACE_S,
        poll_s: float = 0.1,
    ):
        self.deadline_s = deadline_s
        self.ledger_dir = ledger_dir
        self.rank = rank
        self.world_size = world_size
        self.ledger = ledger
        self.grace_s = grace_s
        self.poll_s = poll_s
        self._progress = ProgressView(ledger)
        self._armed: list[_Armed] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextlib.contextmanager
    def phase(self, name: str, deadline_s: float | None = None) -> Iterator[None]:
        """Arm a no-progress window (and a ledger phase of the same name) around a block."""
        window = self.deadline_s if deadline_s is None else deadline_s
        armed = _Armed(name, window, threading.get_ident(), time.time())
        self._ensure_thread()
        ledger_phase = self.ledger.phase(name) if self.ledger else contextlib.nullcontext()
        with ledger_phase:
            with self._lock:
                self._armed.append(armed)
            try:
                yield
            finally:
                self._disarm(armed)
            if armed.tripped:  # declared hung, then finished: the error belongs here, nowhere later
                error = armed.error_type(armed.summary or f"HANG: phase={name} made no progress for {window:g}s")
                error.lagging_ranks = armed.stuck
                raise error

    def close(self) -> None:
        self._closed = True

    def _disarm(self, armed: _Armed) -> None:
        with self._lock:  # no injection can start once this holds: injecting takes the same lock
            if armed in self._armed:
                self._armed.remove(armed)
            if armed.injected and not armed.delivered:
                _clear_async_error(armed.thread_id)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"watchdog-{self.rank}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._closed:
            time.sleep(self.poll_s)
            stalled = self._next_stalled()
            if stalled is not None:
                self._trip(stalled)

    def _next_stalled(self) -> _Armed | None:
        """The innermost armed phase whose window ran out, marked tripped; progress is read unlocked."""
        with self._lock:
            candidates = [a for a in reversed(self._armed) if not a.tripped]
        # A fence that waits reports the stall itself, naming the lagging ranks: it gets its last wait slices.
        in_fence = self.ledger is not None and self.ledger.waiting_in_fence
        for armed in candidates:
            window = armed.window_s + (FENCE_REPORT_MARGIN_S if in_fence else 0.0)
            try:
                stalled = self._progress.idle_s(since=armed.armed_at, window_s=window) > window
            except HubUnreachableError as exc:
                stalled, armed.error_type, armed.summary = True, HubUnreachableError, f"{exc} (phase {armed.name})"
            if stalled:
                with self._lock:
                    if armed in self._armed and not armed.tripped:
                        armed.tripped = True
                        armed.path = self._phase_path(armed)
                        return armed
        return None

    def _phase_path(self, armed: _Armed) -> str:
        return self.ledger.current_phase if self.ledger else armed.name

    def _trip(self, armed: _Armed) -> None:
        if self.ledger:
            self.ledger.flush()
        if armed.error_type is HangError:
            stuck = list(suspects(self.ledger, self.world_size, self.ledger_dir)) or [self.rank]
            armed.stuck = tuple(stuck)
            armed.summary = (f"HANG: phase={armed.path} stuck ranks={stuck} (rank {self.rank}, "
                             f"no progress for {armed.window_s:g}s)")
        self._dump(armed.summary)
        if armed.error_type is HangError and self.ledger is not None and self.ledger.hub is not None:
            self.ledger.hub.report(armed.summary)  # for the driver, should this process exit
        with self._lock:
            if armed not in self._armed:
                return  # the phase ended meanwhile and raises at its exit
            armed.injected = True
            _raise_in_thread(armed.thread_id, armed.error_type, armed.summary, lambda: setattr(armed, "delivered", True),
                             lagging_ranks=armed.stuck)
        if self._landed(armed, self.grace_s):
            return
        sys.stderr.write(f"{armed.summary}; thread blocked in native code, exiting with code {HANG_EXIT_CODE}\n")
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)

    def _dump(self, summary: str) -> None:
        """The table and every thread's stack to this rank's stacks file; one line to stderr (the driver
        renders the table once for all ranks). Without a ledger directory, everything to stderr."""
        if not self.ledger_dir:
            sys.stderr.write(f"\n{summary}\n(no ledger dir)\n")
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            return
        path = os.path.join(self.ledger_dir, f"stacks_rank{self.rank}.txt")
        with open(path, "w") as f:
            hub = self.ledger.hub if self.ledger is not None else None
            f.write(f"{summary}\n{hang_table(hub, self.world_size, self.ledger_dir)}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        sys.stderr.write(f"{summary}; table and stacks in {path}\n")
        sys.stderr.flush()

    def _landed(self, armed: _Armed, wait_s: float) -> bool:
        """Did the error land (or the phase end) within wait_s?"""
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            with self._lock:
                if armed.delivered or armed not in self._armed:
                    return True
            time.sleep(0.05)
        return False


def _clear_async_error(thread_id: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)


def _raise_in_thread(thread_id: int, error_type: type[Exception], message: str, on_delivery, **fields) -> None:
    """Deliver error_type(message) asynchronously; it lands at the thread's next Python bytecode.

    CPython instantiates the exception in that thread when it lands (at the first handler or
    frame exit), which is when `on_delivery` runs; `fields` become the error's attributes.
    """
    def init(self) -> None:
        error_type.__init__(self, message)
        self.__dict__.update(fields)
        on_delivery()

    delivered = type(error_type.__name__, (error_type,), {"__init__": init})
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(delivered))
