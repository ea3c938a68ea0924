"""The rollout side's no-progress rule: an engine holding requests without progress for the window is named (or,
with fault tolerance, failed), a slow engine that keeps generating is not.

The rule itself on successive looks (pure), then the real embedded engine (a one-layer tiny Qwen3, served
in-process) under the rollout guard: made to stall mid-generation while its HTTP server keeps answering (as SGLang's
does when its scheduler hangs in a kernel), and made slow.
"""
from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import pytest
import requests

from rollout_testing import AppThread
from slime.backends.embedded_engine.engine import EmbeddedEngine
from slime.backends.embedded_engine.server import SCHEDULER_KEY, build_app
from slime.config.health import HealthConfig
from slime.ray.engines.health import HealthMonitor
from slime.ray.engines.progress import LoadsNotServed, ProgressWatch, RankLoad, parse_loads, read_loads
from slime.ray.engines.recovery import FAILED, STARTING, EngineFleet
from slime.ray.rollout_manager.errors import EngineStalledError, RolloutTimeoutError
from slime.ray.rollout_manager.guard import RolloutGuard
from slime.rollout import generation_gate
from slime.utils import http_utils
from slime.utils.deadlines import DeadlineModel
from slime.utils.security import auth_headers, current_key

pytestmark = pytest.mark.timeout(300)

WINDOW_S = 10.0


def _load(held: int, used: int, decode_steps: float | None = None) -> dict[int, RankLoad]:
    return {0: RankLoad(held=held, work=(used, None, decode_steps))}


# ----- the rule on successive looks -------------------------------------------------------------------
def test_engine_holding_requests_without_progress_is_stalled_after_the_window_only():
    watch = ProgressWatch(WINDOW_S)
    watch.look({0: ("http://e0", _load(4, 100)), 1: ("http://e1", _load(4, 100))}, now=0.0)
    for now in range(1, 30):  # engine 1 fills its KV cache every second; engine 0 is frozen
        watch.look({0: ("http://e0", _load(4, 100)), 1: ("http://e1", _load(4, 100 + now))}, now=float(now))
        stalls = watch.stalled(float(now))
        if now < WINDOW_S:
            assert stalls == [], now
        else:
            assert [(s.rank, s.held, s.answered) for s in stalls] == [(0, 4, True)], now
    assert stalls[0].describe() == "engine 0 at http://e0 holds 4 request(s) and made no progress for 29s"


def test_slow_engine_that_keeps_generating_is_never_stalled():
    watch = ProgressWatch(WINDOW_S)
    for now in range(0, 200, 3):  # one decode step (SGLang's counter) every 9 s, each under the window
        watch.look({0: ("http://e0", _load(8, 500, decode_steps=float(now // 9)))}, now=float(now))
        assert watch.stalled(float(now)) == [], now


def test_idle_engine_and_one_finishing_requests_are_not_stalled():
    watch = ProgressWatch(WINDOW_S)
    for now in range(0, 100, 5):  # nothing to do: no progress is owed
        watch.look({0: ("http://e0", _load(0, 0))}, now=float(now))
        assert watch.stalled(float(now)) == []
    watch = ProgressWatch(WINDOW_S)
    for now in range(0, 40, 5):  # requests end one by one (the KV cache keeps their tokens): progress
        watch.look({0: ("http://e0", _load(8 - now // 5, 300))}, now=float(now))
        assert watch.stalled(float(now)) == []


def test_engine_that_does_not_answer_is_stalled_after_the_window_with_what_it_held():
    watch = ProgressWatch(WINDOW_S)
    watch.look({0: ("http://e0", _load(3, 100)), 1: ("http://e1", None)}, now=0.0)
    for now in (4.0, 8.0, 12.0):
        watch.look({0: ("http://e0", None), 1: ("http://e1", None)}, now=now)
    stalls = watch.stalled(12.0)
    assert [(s.rank, s.held, s.answered) for s in stalls] == [(0, 3, False), (1, None, False)]
    assert stalls[0].describe() == ("engine 0 at http://e0 did not answer GET /v1/loads for 12s "
                                    "(it held 3 request(s) at its last answer)")
    assert "it never answered" in stalls[1].describe()


def test_a_restarted_engine_starts_anew_and_one_that_left_is_forgotten():
    watch = ProgressWatch(WINDOW_S)
    watch.look({0: ("http://e0", _load(2, 10)), 1: ("http://e1", _load(2, 10))}, now=0.0)
    watch.look({0: ("http://e0-new", _load(2, 10))}, now=9.0)  # engine 0 restarted at a new URL, 1 failed
    assert watch.stalled(12.0) == []
    assert [s.url for s in watch.stalled(19.0)] == ["http://e0-new"]
    watch.restart()  # a new rollout (or generation held for a weight push): a new baseline
    assert watch.stalled(100.0) == []


def test_one_dp_rank_stuck_names_the_engine_and_the_rank():
    watch = ProgressWatch(WINDOW_S)
    for now in range(0, 15):
        loads = {0: RankLoad(held=5, work=(100 + now, None, None)), 3: RankLoad(held=2, work=(40, None, None))}
        watch.look({2: ("http://e2", loads)}, now=float(now))
    (stall,) = watch.stalled(14.0)
    assert (stall.rank, stall.dp_rank, stall.held) == (2, 3, 2)
    assert stall.describe().startswith("engine 2 at http://e2 (DP rank 3) holds 2 request(s)")


def test_loads_that_are_not_sglangs_are_refused():
    with pytest.raises(LoadsNotServed):
        parse_loads({"detail": "Not Found"})
    with pytest.raises(LoadsNotServed):
        parse_loads({"loads": [{"dp_rank": 0, "num_used_tokens": 3}]})
    loads = parse_loads({"loads": [{"dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 1, "num_used_tokens": 9,
                                    "decode_moments": [3.0, 6.0]}]})
    assert loads == {1: RankLoad(held=3, work=(9, None, (3.0, 6.0)))}


# ----- the real embedded engine under the guard ---------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(small_run_inputs):
    return small_run_inputs["checkpoint"]


class _Served:
    """An embedded engine served in-process; `step` runs in its generation thread after every token."""

    def __init__(self, checkpoint) -> None:
        self.server = AppThread(build_app(EmbeddedEngine(str(checkpoint), seed=3), api_key=current_key())).start()
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.scheduler = self.server.app[SCHEDULER_KEY]
        self.signals: list[int] = []
        self.released = threading.Event()
        self.step = lambda: None
        should_abort = self.scheduler._should_abort

        def each_token(rid: str) -> bool:
            self.step()
            return should_abort(rid)

        self.scheduler._should_abort = each_token

    # what the fleet reads of an engine process (EngineProcess)
    def exit_code(self):
        return None

    def signal(self, sig: int) -> None:
        self.signals.append(sig)

    def process_state(self) -> str:
        return "alive"

    def stop(self) -> None:
        self.released.set()
        self.server.stop()


@pytest.fixture(scope="module")
def engine(checkpoint):
    served = _Served(checkpoint)
    yield served
    served.stop()


@pytest.fixture
def served(engine):
    """The engine for one test: generating normally at first; afterwards released and emptied."""
    engine.step, engine.signals = (lambda: None), []
    engine.released.clear()
    yield engine
    engine.released.set()
    requests.post(engine.url + "/abort_request", json={"abort_all": True}, headers=auth_headers(), timeout=10)
    deadline = time.monotonic() + 30
    while any(load.held for load in read_loads(engine.url, 10.0).values()):
        assert time.monotonic() < deadline, "the engine did not empty after the test"
        time.sleep(0.05)


def _generate(url: str, tokens: int, rid: str):
    payload = {"input_ids": [1, 2, 3, 4], "rid": rid,
               "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0}}

    async def call():
        try:
            return await http_utils.post(url + "/generate", payload)
        finally:
            await http_utils.close_session()

    return asyncio.run(call())


def _guard(engine: _Served, window_s: float, fault_tolerant: bool = False, relaunch=None) -> RolloutGuard:
    fleet = EngineFleet([engine], relaunch=relaunch or (lambda rank: None), router=None, fault_tolerant=fault_tolerant)
    config = HealthConfig(fault_tolerant=fault_tolerant, timeout_s=2.0, first_wait_s=600.0,
                          progress=DeadlineModel(engine_no_progress_s=window_s))
    return RolloutGuard(config, fleet, grace_s=1.0)


def test_engine_stalled_mid_generation_ends_the_rollout_naming_it_within_the_window(served):
    """Its scheduler hangs after 5 tokens while its HTTP server answers on: /health is fine, /v1/loads says it
    holds the request, its counters stop. The rollout's own deadline (120 s) is far away."""
    tokens = []

    def hang_after_five():
        tokens.append(time.monotonic())
        if len(tokens) >= 5:
            served.released.wait(120)

    served.step = hang_after_five
    window = 3.0
    guard = _guard(served, window)
    try:
        with pytest.raises(EngineStalledError) as raised:
            guard.run("generate", 7, lambda: _generate(served.url, 400, "sample5-stuck"), budget_s=120.0,
                      weights_version=None)
    finally:
        guard.monitor.close()
    stalled_after = time.monotonic() - tokens[4]
    model = DeadlineModel(engine_no_progress_s=window)
    assert window <= stalled_after <= model.engine_stall_found_s + 30, stalled_after  # + the report and the grace
    error = raised.value
    assert isinstance(error, RolloutTimeoutError)  # the rollout timeout's path: healing and the driver treat it alike
    match = re.fullmatch(rf"rollout 7: generate: engine 0 at {served.url} holds 1 request\(s\) and made no progress "
                         r"for (\d+)s \(--rollout-no-progress-timeout 3s\); pass --use-fault-tolerance .*", str(error))
    assert match and window <= int(match.group(1)) <= window + 5, str(error)
    assert "rid=sample5-stuck" in error.details and "sample5-stuck" in error.details.splitlines()[1]
    assert served.signals == []  # left running as it was for inspection, its requests aborted


def test_slow_engine_that_keeps_generating_finishes_its_rollout(served):
    """A token every 0.4 s: the generation takes over two windows, never one without progress."""
    served.step = lambda: time.sleep(0.4)
    window = 2.0
    guard = _guard(served, window)
    start = time.monotonic()
    try:
        result, _ = guard.run("generate", 1, lambda: _generate(served.url, 12, "slow"), budget_s=120.0,
                              weights_version=None)
    finally:
        guard.monitor.close()
    assert time.monotonic() - start > 2 * window
    assert result["meta_info"]["completion_tokens"] == 12 and guard.monitor.stalls() == []


def test_with_fault_tolerance_a_stalled_engine_is_failed_and_restarted(served):
    served.step = lambda: served.released.wait(120)  # hangs at its first token
    relaunched = threading.Event()

    def relaunch(rank: int) -> _Served:
        relaunched.set()
        served.released.wait(120)
        return served

    guard = _guard(served, 2.0, fault_tolerant=True, relaunch=relaunch)
    http_utils.set_request_bounds(time.monotonic() + 60)
    worker = threading.Thread(target=lambda: _generate(served.url, 50, "held-1"), daemon=True)
    try:
        guard.monitor.resume()
        worker.start()
        assert relaunched.wait(30), "the stalled engine was not restarted"
    finally:
        guard.monitor.close()
        http_utils.set_request_bounds(None)
    (failure,) = guard.fleet.failures
    assert failure.rank == 0 and "holds 1 request(s) and made no progress for" in failure.reason
    assert "--rollout-no-progress-timeout 2s" in failure.reason
    assert served.signals == [signal.SIGKILL] and guard.fleet.slots[0].state in (FAILED, STARTING)
    assert guard.monitor.stalls() == []  # a failure to recover from, not one that ends the rollout


def test_progress_is_not_owed_while_generation_is_held_for_a_weight_push(served):
    served.step = lambda: served.released.wait(120)
    guard = _guard(served, 1.0)
    worker = threading.Thread(target=lambda: _generate(served.url, 50, "held-2"), daemon=True)
    generation_gate.hold()
    try:
        guard.monitor.resume()
        worker.start()
        time.sleep(3.0)  # three windows with a request held and nothing generated
        assert guard.monitor.stalls() == []
        generation_gate.release()
        deadline = time.monotonic() + 20
        while not guard.monitor.stalls() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [s.rank for s in guard.monitor.stalls()] == [0]
    finally:
        generation_gate.release()
        guard.monitor.close()


def test_embedded_engine_serves_sglangs_loads_with_counters_that_move(served):
    served.step = lambda: time.sleep(0.05)
    prefilled = sum(load.work[1] for load in read_loads(served.url, 10.0).values())
    thread = threading.Thread(target=lambda: _generate(served.url, 20, "watched"), daemon=True)
    thread.start()
    seen = []
    while thread.is_alive() and len(seen) < 200:
        loads = read_loads(served.url, 5.0)
        if loads[0].held:
            seen.append(loads[0])
        time.sleep(0.05)
    thread.join(30)
    assert len({load.work for load in seen}) > 3 and all(load.held == 1 for load in seen), seen
    body = requests.get(served.url + "/v1/loads", headers=auth_headers(), timeout=10).json()
    assert body["loads"][0]["num_running_reqs"] == 0 and body["loads"][0]["num_used_tokens"] == 0
    assert body["loads"][0]["total_prefill_uncached_tokens"] == prefilled + 4  # the prompt's tokens


# ----- engines as SGLang answers them (route shapes only) -----------------------------------------------
def _sglang_like(loads: list[dict] | None) -> AppThread:
    """/health, /server_info without request ids (as SGLang's), and /v1/loads when `loads` is given."""
    from aiohttp import web

    def answer(body=None):
        async def handler(request):
            return web.json_response(body) if body is not None else web.Response(status=200)

        return handler

    app = web.Application()
    app.router.add_get("/health", answer())
    app.router.add_get("/server_info", answer({"version": "0.5.23"}))
    if loads is not None:
        app.router.add_get("/v1/loads", answer({"version": "0.5.23", "loads": loads}))
    return AppThread(app).start()


class _Alive:
    def __init__(self, url: str) -> None:
        self.url = url

    def exit_code(self):
        return None

    def signal(self, sig: int) -> None:
        raise AssertionError("no engine here is failed")

    def process_state(self) -> str:
        return "alive"


def test_report_says_how_many_requests_an_sglang_engine_holds_and_an_unreadable_one_is_not_judged(caplog):
    from slime.ray.engines.health import describe_engines

    frozen = [{"dp_rank": 0, "num_running_reqs": 4, "num_waiting_reqs": 3, "num_used_tokens": 900},
              {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 60}]
    servers = [_sglang_like(frozen), _sglang_like(None)]
    fleet = EngineFleet([_Alive(f"http://127.0.0.1:{s.port}") for s in servers], relaunch=lambda rank: None,
                        router=None, fault_tolerant=False)
    monitor = HealthMonitor(HealthConfig(progress=DeadlineModel(engine_no_progress_s=1.0)), fleet)
    try:
        rows = describe_engines(fleet, 5.0).splitlines()
        assert rows[1].split()[-1] == "8" and rows[2].split()[-1] == "?"  # 4 + 3 + 1 over two DP ranks
        monitor.resume()
        deadline = time.monotonic() + 20
        while not monitor.stalls() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # over a window more for the engine without /v1/loads
        stalls = monitor.stalls()
    finally:
        monitor.close()
        for server in servers:
            server.stop()
    assert [(s.rank, s.dp_rank, s.held) for s in stalls] == [(0, 0, 7)]  # the first DP rank found
    assert "engine 1 at" in caplog.text and "its progress cannot be read" in caplog.text
