"""Weight-update sessions and per-consumer payloads, on recorded HTTP calls (no servers)."""
from __future__ import annotations

import types

import pytest
import torch

from slime.backends.weight_sync.transport import EngineSet, TensorTransport
from slime.backends.sglang_utils.http_client import ClientTimeouts, EngineHTTPError


class _Engine:
    """Answers like an SGLang server: `has_sessions=False` is an older SGLang without the routes (404)."""

    def __init__(self, has_sessions: bool) -> None:
        self.has_sessions = has_sessions
        self.calls: list[tuple[str, dict | None]] = []

    def request(self, method, url, json=None, timeout=None):
        route = "/" + url.split("//", 1)[1].partition("/")[2].partition("?")[0]
        self.calls.append((route, json))
        if route.endswith("_weight_update") and not self.has_sessions:
            return types.SimpleNamespace(status_code=404, json=lambda: {"detail": "Not Found"}, text="Not Found")
        return types.SimpleNamespace(status_code=200, json=lambda: {"success": True}, text="")

    def close(self) -> None:
        pass

    def routes(self) -> list[str]:
        return [route for route, _ in self.calls]


def engine_set(*has_sessions: bool) -> tuple[EngineSet, list[_Engine]]:
    engines = EngineSet(tuple(f"http://127.0.0.1:{i + 1}" for i in range(len(has_sessions))), ClientTimeouts())
    fakes = [_Engine(flag) for flag in has_sessions]
    for client, fake in zip(engines.clients, fakes):
        client._session = fake
    return engines, fakes


def test_session_wraps_the_push_where_the_engine_has_one():
    engines, (new, old) = engine_set(True, False)
    engines.begin_session()
    TensorTransport(engines, "embedded", 1).send(0, [("w", torch.ones(2))], version="1", flush_cache=True)
    engines.end_session()
    assert new.routes() == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
    assert old.routes() == ["/begin_weight_update", "/update_weights_from_tensor"]  # 404: no session to end
    body = new.calls[1][1]
    assert body["load_format"] == "slime_shm" and body["weight_version"] == "1" and body["flush_cache"]


def test_a_failing_begin_is_an_error_not_a_fallback():
    engines, (fake,) = engine_set(True)
    fake.request = lambda *a, **k: types.SimpleNamespace(status_code=400, json=lambda: {"message": "busy"},
                                                         text="busy")
    with pytest.raises(EngineHTTPError, match="HTTP 400"):
        engines.begin_session()


def test_cuda_ipc_goes_only_to_engines_that_see_the_senders_gpu():
    from slime.backends.weight_sync.transport import ipc_reach

    gpus = [frozenset({"GPU-a"}), frozenset({"GPU-b"}), frozenset({"GPU-a", "GPU-b"}), frozenset()]
    assert ipc_reach("GPU-a", gpus) == [True, False, True, False]
    assert ipc_reach(None, gpus) == [False] * 4  # a bucket on the host: shared memory for all


def test_host_buckets_never_ask_engines_for_their_gpus():
    engines, (engine,) = engine_set(True)
    TensorTransport(engines, "embedded", 1).send(0, [("w", torch.ones(2))], version="1", flush_cache=True)
    assert "/server_info" not in engine.routes() and engine.calls[0][1]["load_format"] == "slime_shm"


class _IdleScheduler:
    """The session routes never reach the model: the embedded engine's app without one."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


@pytest.fixture
def session_app(monkeypatch):
    """The embedded engine's own app (its session routes, auth and error handling) on a port."""
    from rollout_testing import AppThread
    from slime.backends.embedded_engine import server
    from slime.utils.security import current_key

    monkeypatch.setattr(server, "BatchScheduler", _IdleScheduler)
    app = AppThread(server.build_app(object(), api_key=current_key())).start()
    yield f"http://127.0.0.1:{app.port}"
    app.stop()


def test_an_engine_holds_one_session_and_a_session_left_open_is_closed_first(session_app, caplog):
    """Two senders each opening a session on one engine (begin, begin) is refused, as SGLang refuses it: the sync's
    coordinator owns the one session of a push. A session a dead trainer left open is closed before the next."""
    from slime.backends.sglang_utils.http_client import SGLangHTTPClient

    client = SGLangHTTPClient(session_app)
    assert client.begin_weight_update()
    with pytest.raises(EngineHTTPError, match="already open") as err:
        client.begin_weight_update()
    assert err.value.status == 400
    engines = EngineSet((session_app,), ClientTimeouts())  # the next push's coordinator
    engines.begin_session()
    assert engines.in_session and "left open by an earlier push" in caplog.text
    assert engines.end_session() == [] and not engines.in_session
    with pytest.raises(EngineHTTPError, match="No weight update session is open"):
        client.end_weight_update()  # exactly one session was open, and it is closed
    client.close()
    engines.close()
