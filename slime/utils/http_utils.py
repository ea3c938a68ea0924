"""Async JSON POST/GET with a deadline on every request (rollout -> engine/router traffic).

`await post(url, payload)` is the call users' custom generate functions make upstream; it keeps
that name. One aiohttp session per event loop is reused so thousands of concurrent requests do
not each open a connection pool.
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800.0  # one generation of a long response on a loaded engine
_CONNECT_RETRIES = 3  # only for connection failures; a timeout is final
_sessions: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession]" = weakref.WeakKeyDictionary()


def _session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        _sessions[loop] = session
    return session


async def close_session() -> None:
    """Close this loop's shared session (call before the loop ends)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


async def _request(method: str, url: str, payload: Any, timeout_s: float) -> Any:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    for attempt in range(1, _CONNECT_RETRIES + 1):
        try:
            async with _session().request(method, url, json=payload, timeout=timeout) as resp:
                if resp.status >= 400:
                    body = (await resp.text())[:500]
                    raise RuntimeError(f"{method} {url} -> HTTP {resp.status}: {body}")
                return await resp.json(content_type=None)
        # timeouts first: aiohttp's read timeouts are also ClientConnectionErrors, and are final
        except asyncio.TimeoutError as exc:
            raise TimeoutError(f"{method} {url}: no reply within {timeout_s:.0f}s") from exc
        except aiohttp.ClientConnectionError as exc:
            if attempt == _CONNECT_RETRIES:
                raise ConnectionError(f"{method} {url}: cannot connect after {attempt} attempts ({exc!r})") from exc
            logger.warning("%s %s: connection failed (%r); retry %d", method, url, exc, attempt)
            await asyncio.sleep(0.5 * attempt)


async def post(url: str, payload: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """POST `payload` as JSON, return the decoded JSON reply; errors name the URL."""
    return await _request("POST", url, payload, timeout_s)


async def get(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    return await _request("GET", url, None, timeout_s)
