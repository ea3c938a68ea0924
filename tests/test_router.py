"""slime router: least-inflight/round-robin balancing, dead workers, launching either router.

Workers here are small real HTTP servers (SGLang's /generate shape) that say who answered
and can be made slow; the router runs in-process or as a launched process.
"""

from __future__ import annotations

import asyncio
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from aiohttp import web

from slime.config import defaults_namespace
from slime.rollout.sampling_loop import engine_urls
from slime.router.router import RouterConfig, SlimeRouter, WorkerPool, build_router_app, launch_router
from slime.router.workers import RouterWorkers
from slime.utils.ports import find_free_port
from slime.utils.security import auth_headers, current_key

pytestmark = pytest.mark.timeout(120)


class ServerThread:
    """Run an aiohttp app on 127.0.0.1 in a background event loop; stop() tears it down."""

    def __init__(self, app: web.Application) -> None:
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)

    async def _shutdown(self) -> None:
        await self._runner.cleanup()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in handlers:  # e.g. a deliberately stuck /generate
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def fake_engine(name: str, delay_s: float = 0.0) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(delay_s)
        meta = {"finish_reason": {"type": "length", "length": 1}, "prompt_tokens": len(body.get("input_ids", []))}
        return web.json_response({"text": name, "output_ids": [1], "meta_info": meta,
                                  "image_data_seen": body.get("image_data")})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/generate", generate)
    for path in ("/health", "/health_generate", "/model_info", "/server_info"):  # not the deprecated /get_*
        app.router.add_get(path, ok)
    return app


@pytest.fixture
def servers():
    started: list[ServerThread] = []

    def start(app: web.Application) -> ServerThread:
        started.append(ServerThread(app))
        return started[-1]

    yield start
    for server in reversed(started):
        server.stop()


def post_generate(url: str, timeout: float = 30.0) -> requests.Response:
    return requests.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params": {}}, headers=auth_headers(),
                         timeout=timeout)


def test_pool_round_robin_among_equally_loaded():
    pool = WorkerPool()
    for url in ("http://a", "http://b", "http://c"):
        pool.add(url)
    assert [pool.pick().url for _ in range(6)] == ["http://a", "http://b", "http://c"] * 2
    pool.workers["http://a"].inflight = 1
    assert {pool.pick().url for _ in range(4)} == {"http://b", "http://c"}


def test_round_robin_over_http(servers):
    workers = [servers(fake_engine(f"w{i}")) for i in range(3)]
    router = servers(build_router_app(SlimeRouter(api_key=current_key()), [w.url for w in workers]))
    answered = [post_generate(router.url).json()["text"] for _ in range(6)]
    assert answered == ["w0", "w1", "w2"] * 2


def test_least_inflight_avoids_busy_worker(servers):
    slow, fast = servers(fake_engine("slow", delay_s=3.0)), servers(fake_engine("fast"))
    router = servers(build_router_app(SlimeRouter(api_key=current_key()), [slow.url, fast.url]))
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post_generate, router.url)  # first pick: slow (it is first in order)
        deadline = time.monotonic() + 10
        while requests.get(router.url + "/list_workers", headers=auth_headers(), timeout=5).json()["workers"][0]["inflight"] == 0:
            assert time.monotonic() < deadline, "the slow worker never got the first request"
            time.sleep(0.02)
        answered = [post_generate(router.url).json()["text"] for _ in range(3)]
        assert pending.result(timeout=30).json()["text"] == "slow"
    assert answered == ["fast"] * 3


def test_dead_worker_is_skipped_and_marked(servers):
    live = servers(fake_engine("live"))
    dead_url = f"http://127.0.0.1:{find_free_port()}"  # nothing listens there
    router = servers(build_router_app(SlimeRouter(RouterConfig(connect_timeout_s=2.0), api_key=current_key()), [dead_url, live.url]))
    assert [post_generate(router.url).json()["text"] for _ in range(3)] == ["live"] * 3
    workers = {w["url"]: w for w in requests.get(router.url + "/list_workers", headers=auth_headers(), timeout=5).json()["workers"]}
    assert workers[dead_url]["healthy"] is False and workers[live.url]["served"] == 3


def test_no_live_worker_is_a_clear_503(servers):
    dead_url = f"http://127.0.0.1:{find_free_port()}"
    router = servers(build_router_app(SlimeRouter(api_key=current_key()), [dead_url]))
    response = post_generate(router.url)
    assert response.status_code == 503 and "no healthy worker" in response.json()["error"]["message"]


def test_request_timeout_is_504(servers):
    stuck = servers(fake_engine("stuck", delay_s=10.0))
    router = servers(build_router_app(SlimeRouter(RouterConfig(request_timeout_s=0.5), api_key=current_key()), [stuck.url]))
    response = post_generate(router.url)
    assert response.status_code == 504 and "did not answer" in response.json()["error"]["message"]


def test_add_and_list_workers(servers):
    worker = servers(fake_engine("added"))
    router = servers(build_router_app(SlimeRouter(api_key=current_key())))
    assert post_generate(router.url).status_code == 503
    assert requests.post(router.url + "/add_worker", params={"url": worker.url}, headers=auth_headers(), timeout=5).status_code == 200
    assert requests.get(router.url + "/list_workers", headers=auth_headers(), timeout=5).json()["urls"] == [worker.url]
    assert post_generate(router.url).json()["text"] == "added"
    assert requests.get(router.url + "/health", headers=auth_headers(), timeout=5).json()["healthy_workers"] == 1


@pytest.mark.parametrize("use_slime_router", [True, False], ids=["slime-router", "sglang-router"])
def test_launch_router_process(servers, tmp_path, use_slime_router):
    workers = [servers(fake_engine(f"w{i}")) for i in range(2)]
    args = defaults_namespace(use_slime_router=use_slime_router)
    handle = launch_router(args, [w.url for w in workers], host="127.0.0.1", port=None, startup_timeout_s=60,
                           log_dir=str(tmp_path))
    try:
        answered = {post_generate(handle.url).json()["text"] for _ in range(4)}
        assert answered == {"w0", "w1"}, handle.server.log_tail()
        # SGLang's image_data (what a sample with images sends) reaches the engine as sent
        images = ["data:image/png;base64,iVBORw0KGgo=", "data:image/jpeg;base64,/9j/4AAQ"]
        reply = requests.post(handle.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {},
                                                              "image_data": images}, headers=auth_headers(), timeout=30)
        assert reply.json()["image_data_seen"] == images, reply.text
        check_worker_changes(args, handle, workers, servers(fake_engine("w2")))
    finally:
        handle.stop()
    assert not handle.server.alive()


def test_sglang_router_keeps_the_users_port_and_chooses_its_metrics_port_again_after_a_clash(servers, tmp_path,
                                                                                             monkeypatch):
    """sglang-router binds its metrics port itself, so another process can take it between the choice and the
    bind: that one is chosen again while the port the user set is kept; a clash on the user's port is not
    retried (it would clash again)."""
    import socket

    from slime.router import router as router_module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    metrics_ports = []

    def choose(host):  # the first metrics port chosen is the taken one
        metrics_ports.append(taken.getsockname()[1] if not metrics_ports else find_free_port(host))
        return metrics_ports[-1]

    monkeypatch.setattr(router_module, "find_free_port", choose)
    args = defaults_namespace(use_slime_router=False)
    given = find_free_port()
    handle = launch_router(args, [servers(fake_engine("w0")).url], host="127.0.0.1", port=given, startup_timeout_s=60,
                           log_dir=str(tmp_path))
    try:
        assert handle.port == given and len(metrics_ports) == 2
        assert post_generate(handle.url).json()["text"] == "w0"
    finally:
        handle.stop()
    metrics_ports[:] = [None]  # from here on every metrics port chosen is free
    with pytest.raises(RuntimeError, match="(?i)address already in use"):
        launch_router(args, [], host="127.0.0.1", port=taken.getsockname()[1], startup_timeout_s=60,
                      log_dir=str(tmp_path))
    assert len(metrics_ports) == 2  # one launch
    taken.close()


def check_worker_changes(args, handle, workers, extra) -> None:
    """What the sampling loop's abort and the engine fleet's restarts ask of the router they launched."""
    args = types.SimpleNamespace(**{**vars(args), "sglang_router_ip": handle.host, "sglang_router_port": handle.port})
    router = RouterWorkers.for_args(args)
    assert router.kind == handle.kind
    assert sorted(asyncio.run(engine_urls(args))) == sorted(w.url for w in workers), handle.server.log_tail()
    router.add(extra.url, timeout_s=30)
    assert extra.url in router.urls()
    assert {post_generate(handle.url).json()["text"] for _ in range(6)} == {"w0", "w1", "w2"}
    router.remove(workers[0].url)
    assert sorted(router.urls()) == sorted([workers[1].url, extra.url]), handle.server.log_tail()
