"""Start an HTTP server as a child process, wait for its /health with a deadline, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass
class ServerProcess:
    name: str
    url: str
    command: tuple[str, ...]
    process: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after grace_s; idempotent."""
        if not self.alive():
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=grace_s)

    def wait_healthy(self, deadline_s: float, health_path: str = "/health", poll_s: float = 0.3) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with code {self.process.returncode} before becoming healthy; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if requests.get(self.url + health_path, timeout=2.0).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(poll_s)
        self.stop()
        raise TimeoutError(
            f"{self.name} at {self.url} not healthy within {deadline_s:.0f}s; log {self.log_path}:\n{self.log_tail()}"
        )


@dataclass
class ServerHandle:
    """A started HTTP server (engine or router) and where to reach it."""

    kind: str
    host: str
    port: int
    server: ServerProcess

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.server.alive()

    def stop(self, grace_s: float = 10.0) -> None:
        self.server.stop(grace_s)


def start_server_process(
    name: str, command: list[str], url: str, *, log_dir: str | None = None, env: dict[str, str] | None = None
) -> ServerProcess:
    """Launch `command` with output to a log file (a pipe nobody reads could fill and block it).

    `env`: the child's whole environment (default: this process's); the repo goes on its PYTHONPATH."""
    directory = Path(log_dir or tempfile.gettempdir())
    directory.mkdir(parents=True, exist_ok=True)
    log_path = directory / f"{name}-{os.getpid()}-{time.time_ns()}.log"
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT))
    return ServerProcess(name=name, url=url, command=tuple(command), process=process, log_path=log_path)


def python_module_command(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


def find_free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
