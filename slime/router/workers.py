"""Adding and removing a router's workers at run time (engine fault tolerance).

Both routers this project starts take their first workers from --worker-urls; a restarted engine
comes back at a new URL and must be registered, the dead one removed:
  slime router   POST /add_worker?url=U, POST /remove_worker?url=U, GET /list_workers
  sglang-router  POST /workers {"url": U} (queued: poll GET /workers until it is listed),
                 DELETE /workers/<worker id>, GET /workers (measured on sglang-router 0.3.2)
Every call has a timeout.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import requests

from slime.utils.deadlines import ROUTER_CALL_S, ROUTER_REGISTER_S
from slime.utils.security import auth_headers



class RouterWorkersError(RuntimeError):
    """The router refused or did not confirm a worker change."""


@dataclass(frozen=True, kw_only=True)
class RouterWorkers:
    kind: str
    """'slime-router' or 'sglang-router' (launch_router's names)."""
    url: str
    """The router's base URL."""

    @classmethod
    def for_args(cls, args) -> "RouterWorkers":
        """The router the rollout sends to (--use-slime-router: ours), where the rollout manager published it: at
        upstream's names, which the rollout functions read (run_state.publish)."""
        kind = "slime-router" if args.use_slime_router else "sglang-router"
        return cls(kind=kind, url=f"http://{args.sglang_router_ip}:{args.sglang_router_port}")

    def urls(self) -> list[str]:
        if self.kind == "slime-router":
            return list(self._json("GET", "/list_workers")["urls"])
        return [w["url"] for w in self._json("GET", "/workers")["workers"]]

    def add(self, worker_url: str, timeout_s: float = ROUTER_REGISTER_S) -> None:
        """Register worker_url; returns once the router lists it."""
        worker_url = worker_url.rstrip("/")
        if self.kind == "slime-router":
            self._json("POST", "/add_worker", params={"url": worker_url})
        else:
            self._json("POST", "/workers", json={"url": worker_url})
        self._wait_listed(worker_url, True, timeout_s, "adding")

    def remove(self, worker_url: str, timeout_s: float = ROUTER_REGISTER_S) -> None:
        """Take worker_url out of rotation (no-op when the router does not list it); returns once the router
        no longer lists it (sglang-router removes a worker in a background workflow)."""
        worker_url = worker_url.rstrip("/")
        if self.kind == "slime-router":
            self._json("POST", "/remove_worker", params={"url": worker_url})
            return
        for worker in self._json("GET", "/workers")["workers"]:
            if worker["url"].rstrip("/") == worker_url:
                self._json("DELETE", f"/workers/{worker['id']}")
        self._wait_listed(worker_url, False, timeout_s, "removing")

    def _wait_listed(self, worker_url: str, listed: bool, timeout_s: float, action: str) -> None:
        end = time.monotonic() + timeout_s
        while (worker_url in self.urls()) != listed:
            if time.monotonic() > end:
                state = "did not list" if listed else "still lists"
                raise RouterWorkersError(f"{self.kind} at {self.url} {state} worker {worker_url} "
                                         f"{timeout_s:.0f}s after {action} it")
            time.sleep(0.2)

    def _json(self, method: str, path: str, **kwargs):
        try:
            response = requests.request(method, self.url + path, headers=auth_headers(), timeout=ROUTER_CALL_S,
                                        **kwargs)
        except requests.RequestException as exc:
            raise RouterWorkersError(f"{self.kind} at {self.url}: {method} {path} failed: {exc}") from exc
        if response.status_code >= 300:
            raise RouterWorkersError(f"{self.kind} at {self.url}: {method} {path} -> HTTP {response.status_code}: "
                                     f"{response.text[:300]}")
        return response.json() if response.content else {}
