"""Liveness as SGLang answers it, and requests whose client is gone are dropped.

- A /generate whose HTTP connection closes (the client timed out, the router gave up, the rollout
  ended) is aborted, as SGLang aborts requests of disconnected clients: it must not keep generating.
- /health_generate reports progress: a busy engine that made a decode step recently is healthy
  without queueing a probe behind its batch (SGLang: any output since the probe started); an idle
  engine generates one token.
"""
from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from slime.backends.embedded_engine.engine import GenerationRequest, GenerationResult
from slime.backends.embedded_engine.scheduler import BatchScheduler
from slime.utils.deadlines import EMBEDDED_DECODE_STEP_S

logger = logging.getLogger(__name__)

CLIENT_POLL_S = 0.2


class ClientGoneError(RuntimeError):
    """The client closed the connection before its requests finished; they were aborted."""


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def submit_while_connected(request: web.Request, scheduler: BatchScheduler,
                                 requests: list[GenerationRequest]) -> list[GenerationResult]:
    """The requests' results; if the client disconnects first, abort them and raise ClientGoneError."""
    results = asyncio.ensure_future(scheduler.submit(requests))
    while True:
        done, _ = await asyncio.wait({results}, timeout=CLIENT_POLL_S)
        if done:
            return results.result()
        if client_gone(request):
            for generation in requests:  # queued ones leave at once, running ones at their next step
                scheduler.abort(rid=generation.rid)
            results.cancel()
            logger.info("client of %s went away: %d request(s) aborted", requests[0].rid, len(requests))
            raise ClientGoneError(f"client disconnected; aborted {[r.rid for r in requests]}")


def made_progress(scheduler: BatchScheduler) -> bool:
    """A batch runs and made a decode step within EMBEDDED_DECODE_STEP_S."""
    running, _ = scheduler.request_ids()
    return bool(running) and time.monotonic() - scheduler.last_progress < EMBEDDED_DECODE_STEP_S
