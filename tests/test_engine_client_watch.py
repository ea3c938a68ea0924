"""The embedded engine drops requests whose client is gone, and /health_generate reports progress.

The engine (a one-layer tiny Qwen3) is served in-process from a background thread.
"""
from __future__ import annotations

import threading
import time

import pytest
import requests

from rollout_testing import AppThread
from slime.backends.embedded_engine.engine import EmbeddedEngine
from slime.backends.embedded_engine.server import build_app
from slime.utils.security import auth_headers, current_key

pytestmark = pytest.mark.timeout(300)

LONG = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 1.0}}


@pytest.fixture(scope="module")
def engine_url(small_run_inputs):
    server = AppThread(build_app(EmbeddedEngine(str(small_run_inputs["checkpoint"]), seed=3), api_key=current_key())).start()
    yield f"http://127.0.0.1:{server.port}"
    server.stop()


def _held(url: str) -> list[str]:
    return requests.get(url + "/server_info", headers=auth_headers(), timeout=10).json()["request_ids"]


def _wait_for(condition, timeout_s: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "condition not met in time"
        time.sleep(0.05)
    return time.monotonic() - start


def test_request_of_a_client_that_went_away_stops_generating(engine_url):
    def client_that_gives_up():
        with pytest.raises(requests.Timeout):
            requests.post(engine_url + "/generate", json={**LONG, "rid": "gone-1"}, headers=auth_headers(), timeout=1.0)

    thread = threading.Thread(target=client_that_gives_up)
    thread.start()
    _wait_for(lambda: "gone-1" in _held(engine_url), 10)
    thread.join()
    # a 3000-token generation takes far longer than this: it was aborted, not finished
    assert _wait_for(lambda: not _held(engine_url), 5) < 5
    reply = requests.post(engine_url + "/generate", headers=auth_headers(), timeout=30, json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}, "rid": "next"})
    assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 4


def test_busy_engine_answers_health_generate_at_once(engine_url):
    thread = threading.Thread(target=lambda: requests.post(
        engine_url + "/generate", json={**LONG, "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 600},
                                        "rid": "busy"}, headers=auth_headers(), timeout=120))
    thread.start()
    _wait_for(lambda: "busy" in _held(engine_url), 10)
    start = time.monotonic()
    assert requests.get(engine_url + "/health_generate", headers=auth_headers(), timeout=10).status_code == 200
    assert time.monotonic() - start < 1.0, "the probe waited behind the running batch"
    assert "busy" in _held(engine_url)  # still generating: the probe did not wait for it
    requests.post(engine_url + "/abort_request", json={"abort_all": True}, headers=auth_headers(), timeout=10)
    thread.join(timeout=60)
