"""Async JSON POST/GET with a deadline on every request (rollout -> engine/router traffic).

`await post(url, payload)` is the call users' custom generate functions make upstream; it keeps
that name. One aiohttp session per event loop is reused so thousands of concurrent requests do
not each open a connection pool.

A request is sent again here only when it never left: the connection could not be opened (refused,
unreachable). A connection that breaks after the request went out (the server closed it, a reset) may
have been served, so it is an error, never a silent second send (a /generate would be generated twice,
a POST to a reward service applied twice).

The rollout manager bounds every request of a rollout from outside (`set_request_bounds`): no
request outlives the rollout's deadline, requests still in flight can be listed for an error report
(`outstanding_requests`), those of a rollout that ended in an error are cancelled here (`abandon_requests`: a
stopped engine answers neither them nor an abort), and with --use-fault-tolerance a /generate that failed because
its engine did is sent again once an engine serves (`retry`: that flag's choice, as upstream).

Every request carries the run's key (slime/utils/security.py): these helpers talk to the run's own
engines and router; call other services with a client of your own.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import aiohttp

from slime.utils.deadlines import PLUGIN_HTTP_CALL_S
from slime.utils.security import auth_headers

logger = logging.getLogger(__name__)

_CONNECT_RETRIES = 3  # only for connections that could not be opened; a timeout is final
# A pooled connection is dropped before the servers' own keep-alive closes it (SGLang: 5 s), so a request is not
# written to a connection the server is closing (aiohttp re-sends only idempotent methods in that case, not POST).
POOLED_CONNECTION_IDLE_S = 4.0
_sessions: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession]" = weakref.WeakKeyDictionary()


class HTTPStatusError(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, method: str, url: str, status: int, body: str) -> None:
        super().__init__(f"{method} {url} -> HTTP {status}: {body}")
        self.url = url
        self.status = status


class RequestAbandonedError(RuntimeError):
    """The rollout this request belonged to ended in an error: it was cancelled on the client side."""


@dataclass(frozen=True)
class OutstandingRequest:
    """A request in flight, as the rollout's error report lists it."""

    method: str
    url: str
    rid: str | None
    prompt_tokens: int | None
    max_new_tokens: int | None
    started: float  # time.monotonic()
    attempt: int


# A policy deciding, after a failed request, whether to send it again (it waits for a serving engine first).
RetryPolicy = Callable[[str, BaseException, int], Awaitable[bool]]


@dataclass
class _Bounds:
    deadline: float | None = None  # time.monotonic() by which every request must have ended
    retry: RetryPolicy | None = None
    abandoned: str | None = None  # why requests are refused until the bounds are set again


_bounds = _Bounds()
_in_flight: dict[int, tuple[OutstandingRequest, asyncio.Future]] = {}  # what is listed, and what abandoning cancels
_abandoned: dict[int, str] = {}  # key -> why it was cancelled
_outstanding_lock = threading.Lock()
_ids = itertools.count()


def set_request_bounds(deadline: float | None, retry: RetryPolicy | None = None) -> None:
    """Bound every request of this process by `deadline` (time.monotonic()) and retry per `retry`;
    None, None lifts both (between rollouts)."""
    _bounds.deadline, _bounds.retry, _bounds.abandoned = deadline, retry, None


def abandon_requests(reason: str) -> int:
    """Cancel every request of this process in flight (each raises RequestAbandonedError naming `reason`) and
    refuse new ones until the bounds are set again; the number cancelled. Thread-safe."""
    _bounds.abandoned = reason
    with _outstanding_lock:
        cancelled = {key: future for key, (_, future) in _in_flight.items()}
        _abandoned.update(dict.fromkeys(cancelled, reason))
    for future in cancelled.values():
        try:
            future.get_loop().call_soon_threadsafe(future.cancel)
        except RuntimeError:  # its loop is closed: the request ended with it
            pass
    return len(cancelled)


def outstanding_requests() -> list[OutstandingRequest]:
    """Requests of this process in flight now, oldest first."""
    with _outstanding_lock:
        return sorted((request for request, _ in _in_flight.values()), key=lambda r: r.started)


def _session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=POOLED_CONNECTION_IDLE_S)
        session = aiohttp.ClientSession(connector=connector, headers=auth_headers())
        _sessions[loop] = session
    return session


async def close_session() -> None:
    """Close this loop's shared session (call before the loop ends)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


def _bounded_timeout(timeout_s: float) -> float:
    if _bounds.deadline is None:
        return timeout_s
    return max(0.001, min(timeout_s, _bounds.deadline - time.monotonic()))


def _describe(method: str, url: str, payload: Any, attempt: int) -> OutstandingRequest:
    body = payload if isinstance(payload, dict) else {}
    ids = body.get("input_ids")
    params = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else {}
    return OutstandingRequest(method=method, url=url, rid=body.get("rid"),
                              prompt_tokens=len(ids) if isinstance(ids, list) else None,
                              max_new_tokens=params.get("max_new_tokens"), started=time.monotonic(), attempt=attempt)


async def _request_once(method: str, url: str, payload: Any, timeout_s: float) -> Any:
    timeout_s = _bounded_timeout(timeout_s)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    for attempt in range(1, _CONNECT_RETRIES + 1):
        try:
            async with _session().request(method, url, json=payload, timeout=timeout) as resp:
                if resp.status >= 400:
                    raise HTTPStatusError(method, url, resp.status, (await resp.text())[:500])
                return await resp.json(content_type=None)
        # timeouts first: aiohttp's read timeouts are also ClientConnectionErrors, and are final
        except asyncio.TimeoutError as exc:
            raise TimeoutError(f"{method} {url}: no reply within {timeout_s:.0f}s") from exc
        except aiohttp.ClientConnectorError as exc:  # the connection was never opened: nothing was sent
            if attempt == _CONNECT_RETRIES:
                raise ConnectionError(f"{method} {url}: cannot connect after {attempt} attempts ({exc!r})") from exc
            logger.warning("%s %s: cannot connect (%r); retry %d", method, url, exc, attempt)
            await asyncio.sleep(0.5 * attempt)
        except aiohttp.ClientConnectionError as exc:  # after the request went out: it may have been served
            raise ConnectionError(f"{method} {url}: the connection broke after the request was sent ({exc!r}); "
                                  "not sent again (the server may have acted on it)") from exc


async def _request(method: str, url: str, payload: Any, timeout_s: float) -> Any:
    for attempt in itertools.count(1):
        if _bounds.abandoned is not None:
            raise RequestAbandonedError(f"{method} {url}: not sent ({_bounds.abandoned})")
        key = next(_ids)
        once = asyncio.ensure_future(_request_once(method, url, payload, timeout_s))
        with _outstanding_lock:
            _in_flight[key] = (_describe(method, url, payload, attempt), once)
        try:
            return await once
        except asyncio.CancelledError:
            with _outstanding_lock:
                reason = _abandoned.get(key)
            if reason is not None and not asyncio.current_task().cancelling():  # not this task's own cancellation
                raise RequestAbandonedError(f"{method} {url}: cancelled ({reason})") from None
            raise
        except (ConnectionError, HTTPStatusError, TimeoutError) as exc:
            retry = _bounds.retry
            if retry is None or not await retry(url, exc, attempt):
                raise
            logger.warning("%s %s failed (%s); sending it again (attempt %d)", method, url, exc, attempt + 1)
        finally:
            with _outstanding_lock:
                _in_flight.pop(key, None)
                _abandoned.pop(key, None)


async def post(url: str, payload: Any, timeout_s: float = PLUGIN_HTTP_CALL_S) -> Any:
    """POST `payload` as JSON, return the decoded JSON reply; errors name the URL."""
    return await _request("POST", url, payload, timeout_s)


async def get(url: str, timeout_s: float = PLUGIN_HTTP_CALL_S) -> Any:
    return await _request("GET", url, None, timeout_s)
