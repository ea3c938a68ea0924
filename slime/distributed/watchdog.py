"""Turn a stalled phase into an error that names the phase and the ranks others wait for.

A daemon thread watches deadlines armed by `with watchdog.phase(name):`. On expiry it reads every
rank's ledger file (a channel independent of the stuck communicators), prints the table and this
process's stacks, then raises HangError in the thread that armed the phase. If that thread is
blocked in native code and cannot take the exception within `grace_s`, the process exits with
code 3 after printing `HANG: phase=<p> stuck ranks=[...]`.
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

from slime.distributed.errors import HangError
from slime.distributed.hang_report import suspects_from_dir, render_hang_report
from slime.distributed.ledger import Ledger

HANG_EXIT_CODE = 3


@dataclass(eq=False)  # identity: two phases may share name and deadline
class _Armed:
    name: str
    deadline_at: float
    deadline_s: float
    thread_id: int
    tripped: bool = False
    summary: str = ""


class Watchdog:
    def __init__(
        self,
        deadline_s: float,
        ledger_dir: str | None,
        rank: int,
        world_size: int,
        *,
        ledger: Ledger | None = None,
        grace_s: float = 5.0,
        poll_s: float = 0.1,
    ):
        self.deadline_s = deadline_s
        self.ledger_dir = ledger_dir
        self.rank = rank
        self.world_size = world_size
        self.ledger = ledger
        self.grace_s = grace_s
        self.poll_s = poll_s
        self._armed: list[_Armed] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextlib.contextmanager
    def phase(self, name: str, deadline_s: float | None = None) -> Iterator[None]:
        """Arm a deadline (and a ledger phase of the same name) around a block."""
        seconds = self.deadline_s if deadline_s is None else deadline_s
        armed = _Armed(name, time.monotonic() + seconds, seconds, threading.get_ident())
        self._ensure_thread()
        ledger_phase = self.ledger.phase(name) if self.ledger else contextlib.nullcontext()
        with ledger_phase:
            with self._lock:
                self._armed.append(armed)
            try:
                yield
            except BaseException:
                raise
            else:
                if armed.tripped:  # finished late: raise here rather than let the async error land elsewhere
                    _clear_async_error(armed.thread_id)
                    raise HangError(armed.summary or f"HANG: phase={name} exceeded {seconds:g}s")
            finally:
                with self._lock:
                    self._armed.remove(armed)

    def close(self) -> None:
        self._closed = True

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"watchdog-{self.rank}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._closed:
            time.sleep(self.poll_s)
            now = time.monotonic()
            with self._lock:
                expired = next((a for a in reversed(self._armed) if not a.tripped and now > a.deadline_at), None)
                if expired:
                    expired.tripped = True
            if expired:
                self._trip(expired)

    def _phase_path(self, armed: _Armed) -> str:
        return self.ledger.current_phase if self.ledger else armed.name

    def _trip(self, armed: _Armed) -> None:
        if self.ledger:
            self.ledger.flush()
        stuck = list(suspects_from_dir(self.ledger_dir, self.world_size)) or [self.rank]
        summary = f"HANG: phase={self._phase_path(armed)} stuck ranks={stuck} (rank {self.rank}, deadline {armed.deadline_s:g}s)"
        armed.summary = summary
        self._dump(summary)
        _raise_in_thread(armed.thread_id, summary)
        if self._left_phase(armed, self.grace_s):
            return
        sys.stderr.write(f"{summary}; thread blocked in native code, exiting with code {HANG_EXIT_CODE}\n")
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)

    def _dump(self, summary: str) -> None:
        report = render_hang_report(self.ledger_dir, self.world_size) if self.ledger_dir else "(no ledger dir)"
        sys.stderr.write(f"\n{summary}\n{report}\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.ledger_dir:
            with open(os.path.join(self.ledger_dir, f"stacks_rank{self.rank}.txt"), "w") as f:
                f.write(f"{summary}\n{report}\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)

    def _left_phase(self, armed: _Armed, wait_s: float) -> bool:
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            with self._lock:
                if armed not in self._armed:
                    return True
            time.sleep(0.05)
        return False


def _clear_async_error(thread_id: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)


def _raise_in_thread(thread_id: int, message: str) -> None:
    """Deliver HangError(message) asynchronously; it lands at the thread's next Python bytecode."""
    error_type = type("HangError", (HangError,), {"__init__": lambda self: HangError.__init__(self, message)})
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(error_type))
