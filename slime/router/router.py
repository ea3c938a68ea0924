"""slime's router (`--use-slime-router`): load-balances /generate over registered engines.

    SLIME_API_KEY=KEY python -m slime.router.router --host 127.0.0.1 --port P [--listen-fd FD] \
        [--worker-urls URL ...]

Policy: least in-flight requests, ties broken round-robin. A worker that cannot be connected to is
taken out of rotation and the request goes to another one (it never reached the first). A worker whose
connection breaks after the request was sent is taken out of rotation too, but the request is answered
502, not sent again: that worker may have generated it. A periodic /health probe puts a worker back.
Every upstream call has a timeout.
Every route wants the run's key; the router sends the same key to its workers.
Without --use-slime-router, `launch_router` starts sglang-router instead.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from slime.utils.deadlines import (ROUTER_CONNECT_S, ROUTER_HEALTH_PROBE_S, ROUTER_REQUEST_S, ROUTER_STARTUP_S,
                                   SERVER_SHUTDOWN_S)
from slime.utils.http_utils import POOLED_CONNECTION_IDLE_S
from slime.utils.server_process import (
    ServerHandle,
    python_module_command,
    serve_on,
    start_bound_server,
    start_server_process,
)
from slime.utils.ports import find_free_port, retry_port_clash
from slime.utils.security import ApiKey, require_api_key, server_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    request_timeout_s: float = ROUTER_REQUEST_S
    """Deadline for one proxied /generate (--request-timeout-secs: the run's --sglang-router-request-timeout-secs)."""
    connect_timeout_s: float = ROUTER_CONNECT_S
    """Deadline to open a connection to a worker; past it the worker counts as dead."""
    health_interval_s: float = 5.0
    """Seconds between /health probes of every worker."""
    health_timeout_s: float = ROUTER_HEALTH_PROBE_S
    max_request_bytes: int = 256 * 1024**2
    """Largest /generate body forwarded (sglang-router's default payload limit)."""


@dataclass
class Worker:
    url: str
    order: int
    inflight: int = 0
    healthy: bool = True
    served: int = 0


@dataclass
class WorkerPool:
    workers: dict[str, Worker] = field(default_factory=dict)
    _order: itertools.count = field(default_factory=itertools.count)
    _turn: int = 0

    def add(self, url: str) -> Worker:
        url = url.rstrip("/")
        if url not in self.workers:
            self.workers[url] = Worker(url=url, order=next(self._order))
        self.workers[url].healthy = True
        return self.workers[url]

    def remove(self, url: str) -> None:
        self.workers.pop(url.rstrip("/"), None)

    def pick(self, exclude: set[str] = frozenset()) -> Worker | None:
        """Least in-flight healthy worker; among equals, the one after the last pick in turn."""
        candidates = [w for w in self.workers.values() if w.healthy and w.url not in exclude]
        if not candidates:
            return None
        n = len(candidates)
        candidates.sort(key=lambda w: w.order)
        start = self._turn % n
        rotated = candidates[start:] + candidates[:start]
        chosen = min(rotated, key=lambda w: w.inflight)
        self._turn = candidates.index(chosen) + 1
        return chosen


class SlimeRouter:
    def __init__(self, config: RouterConfig = RouterConfig(), *, api_key: ApiKey) -> None:
        self.api_key = api_key
        self.config = config
        self.pool = WorkerPool()
        self._session: aiohttp.ClientSession | None = None

    # ----- lifecycle ---------------------------------------------------------------------
    async def start(self, app: web.Application):
        connector = aiohttp.TCPConnector(keepalive_timeout=POOLED_CONNECTION_IDLE_S)
        # workers want the run's key too
        self._session = aiohttp.ClientSession(connector=connector, headers=self.api_key.headers())
        probe = asyncio.create_task(self._probe_loop())
        yield
        probe.cancel()
        await self._session.close()

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await asyncio.gather(*(self._probe(w) for w in list(self.pool.workers.values())))

    async def _probe(self, worker: Worker) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with self._session.get(worker.url + "/health", timeout=timeout) as response:
                healthy = response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            healthy = False
        if healthy != worker.healthy:
            logger.warning("worker %s is now %s", worker.url, "healthy" if healthy else "unhealthy")
        worker.healthy = healthy

    # ----- proxy -------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await request.read()
        tried: set[str] = set()
        while (worker := self.pool.pick(exclude=tried)) is not None:
            tried.add(worker.url)
            try:
                return await self._forward(worker, body)
            except aiohttp.ClientConnectorError as exc:  # never connected: the request did not reach it
                worker.healthy = False
                logger.warning("worker %s cannot be reached (%s); taken out of rotation", worker.url, exc)
            except aiohttp.ClientConnectionError as exc:  # broke after the request went out: not sent twice
                worker.healthy = False
                logger.warning("worker %s dropped a request it was sent (%s); taken out of rotation", worker.url, exc)
                return _error(502, f"worker {worker.url} closed the connection after the request was sent ({exc!r}); "
                                   "not sent again: it may have been served")
            except asyncio.TimeoutError:
                return _error(504, f"worker {worker.url} did not answer within {self.config.request_timeout_s}s")
        return _error(503, f"no healthy worker could take the request (tried {sorted(tried)})")

    async def _forward(self, worker: Worker, body: bytes) -> web.Response:
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s)
        worker.inflight += 1
        try:
            async with self._session.post(
                worker.url + "/generate", data=body, headers={"Content-Type": "application/json"}, timeout=timeout
            ) as response:
                payload = await response.read()
                worker.served += 1
                return web.Response(body=payload, status=response.status, content_type="application/json")
        finally:
            worker.inflight -= 1

    # ----- management --------------------------------------------------------------------
    async def add_worker(self, request: web.Request) -> web.Response:
        url = request.query.get("url") or request.query.get("worker_url")
        if not url:
            return _error(400, "add_worker needs ?url=http://host:port")
        self.pool.add(url)
        logger.info("added worker %s", url)
        return web.json_response({"status": "ok", "url": url.rstrip("/")})

    async def remove_worker(self, request: web.Request) -> web.Response:
        url = request.query.get("url") or request.query.get("worker_url")
        if not url:
            return _error(400, "remove_worker needs ?url=http://host:port")
        self.pool.remove(url)
        return web.json_response({"status": "ok"})

    async def list_workers(self, request: web.Request) -> web.Response:
        workers = sorted(self.pool.workers.values(), key=lambda w: w.order)
        details = [
            {"url": w.url, "healthy": w.healthy, "inflight": w.inflight, "served": w.served} for w in workers
        ]
        return web.json_response({"urls": [w.url for w in workers], "workers": details})

    async def health(self, request: web.Request) -> web.Response:
        healthy = sum(w.healthy for w in self.pool.workers.values())
        return web.json_response({"status": "ok", "healthy_workers": healthy, "workers": len(self.pool.workers)})


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def build_router_app(router: SlimeRouter, worker_urls: list[str] = ()) -> web.Application:
    for url in worker_urls:
        router.pool.add(url)
    app = web.Application(middlewares=[require_api_key(router.api_key)],
                          client_max_size=router.config.max_request_bytes)
    app.cleanup_ctx.append(router.start)
    app.router.add_post("/generate", router.generate)
    app.router.add_post("/add_worker", router.add_worker)  # state-changing: POST only
    app.router.add_post("/remove_worker", router.remove_worker)
    app.router.add_get("/list_workers", router.list_workers)
    app.router.add_get("/health", router.health)
    return app


# ----- launching (slime router or sglang-router) --------------------------------------------------
RouterHandle = ServerHandle  # a router is a server like an engine; no extra behaviour
METRICS_LISTENER = "prometheus"  # sglang-router's panic when its metrics port is taken names its exporter


def router_command(args: Any, host: str, port: int, worker_urls: list[str],
                   listen_fd: int | None = None) -> tuple[str, list[str]]:
    """The router's command line. Neither holds the run's key: the slime router reads it from its environment,
    sglang-router (which reads `--api-key` from argv only, and sends it to the workers) is started by a launcher
    that hands it the key from the environment inside the process (slime/router/sglang_router_launch.py)."""
    timeout = str(int(args.sglang_router_request_timeout_secs))
    if args.use_slime_router:
        flags = ["--host", host, "--port", str(port), "--request-timeout-secs", timeout]
        flags += ["--listen-fd", str(listen_fd)] if listen_fd is not None else []
        flags += ["--worker-urls", *worker_urls] if worker_urls else []
        return "slime-router", python_module_command("slime.router.router", flags)
    flags = ["--host", host, "--port", str(port), "--policy", args.sglang_router_policy, "--request-timeout-secs", timeout]
    # its metrics listener would default to 0.0.0.0:29000: every interface, and one port for every router of the node
    flags += ["--prometheus-host", host, "--prometheus-port", str(find_free_port(host))]
    flags += ["--worker-urls", *worker_urls] if worker_urls else []
    return "sglang-router", python_module_command("slime.router.sglang_router_launch", flags)


def launch_router(
    args: Any, worker_urls: list[str], *, host: str, port: int | None, startup_timeout_s: float = ROUTER_STARTUP_S,
    log_dir: str | None = None,
) -> RouterHandle:
    """Start slime's router (args.use_slime_router) or sglang-router; return once /health answers.

    `host`: where it listens; `port`: --sglang-router-port (None: a free port).
    The slime router is handed its socket already bound; sglang-router, which cannot take one, is started
    again on fresh ports if another process took one of its ports first (a port the user set is kept: only its
    metrics port is then chosen again).
    """
    given = port
    if args.use_slime_router:
        server, port = start_bound_server(
            "slime-router", lambda p, fd: router_command(args, host, p, worker_urls, listen_fd=fd)[1],
            host=host, port=0 if given is None else given, log_dir=log_dir)
        server.wait_healthy(startup_timeout_s)
        return RouterHandle(kind="slime-router", host=host, port=port, server=server)

    def start() -> RouterHandle:
        port = given or find_free_port(host)
        kind, command = router_command(args, host, port, worker_urls)
        server = start_server_process(kind, command, f"http://{host}:{port}", log_dir=log_dir)
        server.wait_healthy(startup_timeout_s)
        return RouterHandle(kind=kind, host=host, port=port, server=server)

    return retry_port_clash(start, what="sglang-router",
                            chosen_anew=lambda error: given is None or METRICS_LISTENER in error)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="slime router: least-inflight load balancing over engines")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="the port (with --listen-fd: the socket's)")
    parser.add_argument("--listen-fd", type=int, default=None,
                        help="serve on this inherited listening socket (bound by the launcher: no port race)")
    parser.add_argument("--worker-urls", nargs="*", default=[])
    parser.add_argument("--request-timeout-secs", type=float, default=RouterConfig.request_timeout_s)
    parser.add_argument("--health-check-interval-secs", type=float, default=RouterConfig.health_interval_s)
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[slime-router %(asctime)s] %(message)s")
    config = RouterConfig(request_timeout_s=args.request_timeout_secs, health_interval_s=args.health_check_interval_secs)
    app = build_router_app(SlimeRouter(config, api_key=server_key()), args.worker_urls)
    web.run_app(app, print=None, access_log=None, shutdown_timeout=SERVER_SHUTDOWN_S, **serve_on(args.listen_fd, args.host, args.port))


if __name__ == "__main__":
    main()
