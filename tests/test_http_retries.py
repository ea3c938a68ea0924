"""A request is sent again only when it never reached the server.

The rollout's HTTP helpers (slime/utils/http_utils.py) and the slime router (slime/router/router.py) retry a
request whose connection could not be opened; a connection that breaks after the request went out (the server
read the body, then dropped it) is an error: the server may have acted on it, so a second send could generate a
sample twice or apply a reward service's side effect twice. Real aiohttp servers in this process.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
import requests
from aiohttp import web

from rollout_testing import AppThread
from slime.router.router import SlimeRouter, build_router_app
from slime.utils import http_utils
from slime.utils.security import auth_headers, current_key

pytestmark = pytest.mark.timeout(60)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def _app(handler) -> web.Application:
    app = web.Application()
    app.router.add_post("/generate", handler)
    app.router.add_get("/health", _health)
    return app


def _dropping(received: list) -> web.Application:
    """Reads the whole request, then closes the connection without an answer."""
    async def generate(request: web.Request) -> web.Response:
        received.append(await request.json())
        request.transport.close()
        return web.json_response({"text": "never delivered"})

    return _app(generate)


def _answering(name: str, received: list) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.json_response({"text": name})

    return _app(generate)


def _post(url: str, payload: dict):
    async def call():
        try:
            return await http_utils.post(url, payload, timeout_s=20)
        finally:
            await http_utils.close_session()

    return asyncio.run(call())


def test_a_request_the_server_received_is_not_sent_again():
    received: list = []
    server = AppThread(_dropping(received)).start()
    try:
        with pytest.raises(ConnectionError, match="after the request was sent.*not sent again"):
            _post(f"http://127.0.0.1:{server.port}/generate", {"rid": "a", "input_ids": [1]})
    finally:
        server.stop()
    assert received == [{"rid": "a", "input_ids": [1]}]  # once


def test_a_request_that_could_not_connect_is_sent_once_the_server_listens():
    """Connection refused: nothing was sent, so the helper tries again (the server comes up meanwhile)."""
    received: list = []
    server = AppThread(_answering("late", received))
    url = f"http://127.0.0.1:{server.port}/generate"
    threading.Timer(0.2, server.start).start()  # after the first attempt was refused, before the retry
    try:
        assert _post(url, {"rid": "b"}) == {"text": "late"}
    finally:
        server.stop()
    assert received == [{"rid": "b"}]


def test_router_answers_502_for_a_request_its_worker_dropped_and_sends_it_nowhere_else():
    dropped, other = [], []
    dropping, answering = AppThread(_dropping(dropped)).start(), AppThread(_answering("other", other)).start()
    workers = [f"http://127.0.0.1:{dropping.port}", f"http://127.0.0.1:{answering.port}"]  # the first is picked first
    router = AppThread(build_router_app(SlimeRouter(api_key=current_key()), workers)).start()
    try:
        reply = requests.post(f"http://127.0.0.1:{router.port}/generate", json={"rid": "c"}, headers=auth_headers(),
                              timeout=30)
        assert reply.status_code == 502, reply.text
        assert "closed the connection after the request was sent" in reply.json()["error"]["message"]
        listed = requests.get(f"http://127.0.0.1:{router.port}/list_workers", headers=auth_headers(), timeout=5)
        healthy = {w["url"]: w["healthy"] for w in listed.json()["workers"]}
    finally:
        for server in (router, dropping, answering):
            server.stop()
    assert dropped == [{"rid": "c"}] and other == []  # the dropping worker got it once, nobody else
    assert healthy == {workers[0]: False, workers[1]: True}
