"""A server the run starts (engine, router) never outlives the process that owns it: killed with SIGKILL (as Ray
kills an engine actor whose stop timed out), its servers go too, and each server leads a process group of its own
(stopped as a whole)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STARTER = """
import sys, time
from slime.utils.server_process import start_server_process
server = start_server_process("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], "http://127.0.0.1:1",
                              log_dir=sys.argv[1])
print(server.process.pid, flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_server_dies_with_the_process_that_started_it(tmp_path):
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    server = int(starter.stdout.readline())
    try:
        deadline = time.monotonic() + 10
        while "time.sleep(120)" not in Path(f"/proc/{server}/cmdline").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # the tie is made, then the server's own command runs
        assert os.getpgid(server) == server  # a process group of its own
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 10
        while _running(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(server), "the server outlived the process that started it"
    finally:
        starter.kill()
        if _running(server):
            os.kill(server, signal.SIGKILL)
