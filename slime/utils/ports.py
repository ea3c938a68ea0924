"""Ports without races: bind first, then tell; or, for a server that binds by itself, retry on a clash.

A port chosen free and bound later can be taken in between by another process (seen on a busy
machine: an engine died with "address already in use"). `listening_socket` binds port 0 and keeps
the socket, so the port is held from the moment it is known; `retry_port_clash` covers the servers
that cannot be handed a socket.
"""
from __future__ import annotations

import logging
import socket

logger = logging.getLogger(__name__)

PORT_CLASH = "address already in use"  # aiohttp, uvicorn and the Rust router all say it (case varies)
PORT_ATTEMPTS = 3


def listening_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket bound to host:port (0: a free port, chosen by the kernel) and listening, ready to hand
    to a child server: the port is the child's from this moment on."""
    bare = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in bare else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bare, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port free now. Only for servers that cannot take a socket, behind `retry_port_clash`."""
    with listening_socket(host) as sock:
        return sock.getsockname()[1]


def retry_port_clash(launch, attempts: int = PORT_ATTEMPTS, what: str = "server", chosen_anew=lambda error: True):
    """`launch()` again, on a fresh port, when the server lost its port to another process before binding
    it; at most `attempts` times, then the last error. `chosen_anew(error)`: whether the port that clashed is
    one the next launch picks again (a port the user set is not: trying it again would clash again)."""
    for attempt in range(1, attempts + 1):
        try:
            return launch()
        except RuntimeError as exc:
            error = str(exc).lower()
            if PORT_CLASH not in error or not chosen_anew(error) or attempt == attempts:
                raise
            logger.warning("%s lost its port to another process (attempt %d of %d); starting it on another port",
                           what, attempt, attempts)
