"""Start an HTTP server as a child process, wait for its /health with a deadline, stop it.

A server runs in a process group of its own (stopped as a whole: SGLang's scheduler processes with it) and
dies with the thread that started it (`tied_exec.py`: the kernel kills it when its starter ends, a Ray actor
killed with SIGKILL included), so no server of a run outlives it holding a port or device memory. Start servers
from a thread that lives as long as they should (a Ray actor's, not a short-lived pool thread's).

Ports: a server of this project gets a socket already bound and listening (`start_bound_server`:
an inherited file descriptor), so no other process can take its port between choosing and binding
it. A server that cannot take a socket (SGLang, sglang-router) is started on a free port and started
again on another one if it lost that port (slime/utils/ports.py: `retry_port_clash`, bounded).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from slime.utils.deadlines import SERVER_HEALTH_PROBE_S
from slime.utils.ports import listening_socket
from slime.utils.security import auth_headers

REPO_ROOT = Path(__file__).resolve().parents[2]


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
        """SIGTERM to the server's process group, then SIGKILL after grace_s; idempotent."""
        if not self.alive():
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.process.wait(timeout=grace_s)
        self._signal_group(signal.SIGKILL)  # whatever the server started and left (the group outlives its leader)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)  # its own group: the server's pid is the group's id
        except (ProcessLookupError, PermissionError):
            pass

    def wait_healthy(self, deadline_s: float, health_path: str = "/health", poll_s: float = 0.3) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with code {self.process.returncode} before becoming healthy; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if requests.get(self.url + health_path, headers=auth_headers(), timeout=SERVER_HEALTH_PROBE_S).status_code == 200:
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
    name: str, command: list[str], url: str, *, log_dir: str | None = None, env: dict[str, str] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> ServerProcess:
    """Launch `command` with output to a log file (a pipe nobody reads could fill and block it).

    `env`: the child's whole environment (default: this process's); the repo goes on its PYTHONPATH.
    `pass_fds`: descriptors the child inherits (a listening socket)."""
    directory = Path(log_dir or tempfile.gettempdir())
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_path = directory / f"{name}-{os.getpid()}-{time.time_ns()}.log"
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    # 0600: SGLang logs its server arguments, the run's key among them
    with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as log:
        process = subprocess.Popen(tied_command(command), stdout=log, stderr=subprocess.STDOUT, env=env,
                                   cwd=str(REPO_ROOT), pass_fds=pass_fds, start_new_session=True)
    return ServerProcess(name=name, url=url, command=tuple(command), process=process, log_path=log_path)


def tied_command(command: list[str]) -> list[str]:
    """`command`, run so that it dies with the thread that starts it (tied_exec.py)."""
    return [sys.executable, "-I", str(Path(__file__).with_name("tied_exec.py")), str(os.getpid()), *command]


def python_module_command(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


def start_bound_server(name: str, command_for, *, host: str, port: int = 0, log_dir: str | None = None,
                       env: dict[str, str] | None = None) -> tuple[ServerProcess, int]:
    """Bind host:port (0: a free one) here and start the server on that socket: `command_for(port, fd)`
    is its command line. Returns the process and its port."""
    with listening_socket(host, port) as sock:
        bound = sock.getsockname()[1]
        server = start_server_process(name, command_for(bound, sock.fileno()), f"http://{host}:{bound}",
                                      log_dir=log_dir, env=env, pass_fds=(sock.fileno(),))
    return server, bound


def serve_on(listen_fd: int | None, host: str, port: int) -> dict:
    """`web.run_app` keywords of a server started by `start_bound_server` (or on host:port by hand)."""
    return {"sock": socket.socket(fileno=listen_fd)} if listen_fd is not None else {"host": host, "port": port}
