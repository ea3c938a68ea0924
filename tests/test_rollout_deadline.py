"""Rollout-side deadlines: the default rule, the flags, requests bounded by the rollout's clock, the
in-flight registry, the fault-tolerance retry, the guard's errors and the driver's engine targets.

Single process: the servers are in-process aiohttp apps (tests/rollout_testing.py); the one engine
"process" whose death the guard must notice is a plain `sleep`.
"""
from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
import types
import warnings

import pytest
from aiohttp import web

from rollout_testing import AppThread, FakeEngine
from slime.config.health import HealthConfig
from slime.backends.sglang_utils.http_client import SGLangHTTPClient
from slime.ray.engines.recovery import EngineFleet, LocalEngine, local_process_state
from slime.ray.rollout_manager.errors import EngineFailedError, EngineStalledError, RolloutTimeoutError
from slime.ray.rollout_manager.guard import RolloutGuard
from slime.ray.driver.rollout_wait import EngineTargets
from slime.utils.deadlines import DeadlineModel, RolloutClock, rollout_deadline_s, rollout_timeout_s
from slime.utils.deadlines import rollout_driver_margin_s as driver_margin_s
from slime.utils import http_utils
from slime.utils.arguments import parse_args

MINIMAL = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "8", "--num-rollout", "1",
           "--actor-num-gpus-per-node", "1", "--train-backend-device", "cpu", "--rollout-backend", "embedded"]


def _parse(*extra: str):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = parse_args([*MINIMAL, *extra])
    return args, [str(w.message) for w in caught]


# ----- the default rule and the flags ---------------------------------------------------------
def test_default_timeout_grows_with_response_length_and_batch():
    base = rollout_timeout_s(samples=64, max_new_tokens=1000, engines=2, concurrency=512)
    assert base == pytest.approx(300 + 0.1 * 1000)
    assert rollout_timeout_s(samples=64, max_new_tokens=2000, engines=2, concurrency=512) - 300 == pytest.approx(200)
    # more samples than the engines take at once: one more wave each time they fill up
    assert rollout_timeout_s(samples=2048, max_new_tokens=1000, engines=2, concurrency=512) == pytest.approx(300 + 200)
    assert rollout_timeout_s(samples=2048, max_new_tokens=1000, engines=4, concurrency=512) == pytest.approx(300 + 100)


def test_deadline_from_flags_and_override():
    args, _ = _parse("--rollout-max-response-len", "1000", "--rollout-num-gpus", "2")
    assert rollout_deadline_s(args, args.run_config) == pytest.approx(300 + 100)
    args, _ = _parse("--rollout-max-response-len", "1000", "--over-sampling-batch-size", "2000",
                     "--sglang-server-concurrency", "1000", "--rollout-num-gpus", "2")
    # 2000 x 8 samples over 2 x 1000
    assert rollout_deadline_s(args, args.run_config) == pytest.approx(300 + 0.1 * 1000 * 8)
    args, _ = _parse("--rollout-max-response-len", "1000", "--eval-max-response-len", "50",
                     "--n-samples-per-eval-prompt", "2")
    assert rollout_deadline_s(args, args.run_config, evaluation=True, eval_prompts=10) == pytest.approx(300 + 5)
    args, _ = _parse("--rollout-timeout", "42", "--rollout-health-check-timeout", "3", "--use-fault-tolerance")
    run = args.run_config
    assert rollout_deadline_s(args, run) == 42 and rollout_deadline_s(args, run, evaluation=True) == 42
    assert driver_margin_s(args) > 2 * 3


def test_bad_deadline_flags_are_refused_and_idle_ones_warned(capsys):
    for flags in (["--rollout-timeout", "0"], ["--rollout-health-check-interval", "-1"]):
        with pytest.raises(SystemExit):
            _parse(*flags)
        assert "must be positive" in capsys.readouterr().err
    _, messages = _parse("--rollout-health-check-interval", "2")
    assert any("only take effect with --use-fault-tolerance" in m for m in messages), messages
    _, messages = _parse("--rollout-health-check-interval", "2", "--use-fault-tolerance")
    assert not any("--use-fault-tolerance" in m for m in messages)


def test_clock_extends_and_expires():
    clock = RolloutClock()
    assert clock.left_s() is None and not clock.expired()
    clock.start(0.2)
    assert 0 < clock.left_s() <= 0.2
    clock.extend(10)
    assert clock.left_s() > 10 and clock.budget_s == pytest.approx(10.2)
    clock.start(0.0)
    assert clock.expired()


# ----- requests bounded by the rollout's clock, listed while in flight, retried on failure ---------
@pytest.fixture
def slow_engine():
    engine = FakeEngine(delay_s=4.0).start()  # longer than every deadline below
    yield engine
    engine.stop()


def _post(url: str, payload: dict, timeout_s: float = 600.0):
    async def call():
        try:
            return await http_utils.post(url, payload, timeout_s=timeout_s)
        finally:
            await http_utils.close_session()

    return asyncio.run(call())


def test_request_never_outlives_the_rollout_deadline_and_is_listed_meanwhile(slow_engine):
    url = f"http://127.0.0.1:{slow_engine.port}/generate"
    payload = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 7}, "rid": "sample3-abc"}
    seen = []
    http_utils.set_request_bounds(time.monotonic() + 1.0)
    try:
        threading.Timer(0.5, lambda: seen.extend(http_utils.outstanding_requests())).start()
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            _post(url, payload)
        assert time.monotonic() - start < 5
    finally:
        http_utils.set_request_bounds(None)
    assert [(r.rid, r.prompt_tokens, r.max_new_tokens, r.attempt) for r in seen] == [("sample3-abc", 3, 7, 1)]
    assert http_utils.outstanding_requests() == []


def test_failed_request_is_sent_again_only_when_the_policy_says_so():
    calls = []

    async def flaky(request: web.Request) -> web.Response:
        calls.append(await request.json())
        if len(calls) == 1:
            return web.json_response({"error": "worker died"}, status=503)
        return web.json_response({"text": "ok"})

    app = web.Application()
    app.router.add_post("/generate", flaky)
    server = AppThread(app).start()
    url = f"http://127.0.0.1:{server.port}/generate"
    attempts = []

    async def retry(url_: str, error: BaseException, attempt: int) -> bool:
        attempts.append((isinstance(error, http_utils.HTTPStatusError) and error.status, attempt))
        return True

    try:
        with pytest.raises(http_utils.HTTPStatusError, match="HTTP 503"):
            _post(url, {"rid": "a"})  # no policy: the error stands
        http_utils.set_request_bounds(time.monotonic() + 30, retry)
        calls.clear()
        assert _post(url, {"rid": "b"}) == {"text": "ok"}
    finally:
        http_utils.set_request_bounds(None)
        server.stop()
    assert attempts == [(503, 1)] and len(calls) == 2


# ----- the guard: a deadline or a failed engine ends the rollout with a named error ----------------
def _no_restart(rank: int):
    raise RuntimeError(f"engine {rank}: this test restarts no engine")  # a relaunch gives a handle or raises


def _guard(engines=(), fault_tolerant=False) -> RolloutGuard:
    fleet = EngineFleet([LocalEngine(e) for e in engines], relaunch=_no_restart, router=None,
                        fault_tolerant=fault_tolerant)
    return RolloutGuard(HealthConfig(fault_tolerant=fault_tolerant, timeout_s=1.0), fleet, grace_s=1.0)


def test_guard_deadline_names_the_requests_outstanding(slow_engine):
    guard = _guard()
    url = f"http://127.0.0.1:{slow_engine.port}/generate"
    start = time.monotonic()
    with pytest.raises(RolloutTimeoutError) as raised:
        guard.run("generate", 4, lambda: _post(url, {"input_ids": [1] * 5, "rid": "sample9-x"}), budget_s=1.0,
                  weights_version=None)
    assert time.monotonic() - start < 30  # the 1 s budget and its report, not a hang
    error = raised.value
    assert "rollout 4: generate did not finish within --rollout-timeout 1s; 1 request(s) outstanding" in str(error)
    assert "rid=sample9-x" in error.details and "5 prompt tokens" in error.details
    guard.monitor.close()


class _Process:
    """What the fleet reads of an engine: its URL, its process and how to stop it."""

    def __init__(self, url: str):
        self.url = url
        self.server = types.SimpleNamespace(process=subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))

    def stop(self) -> None:
        self.server.process.kill()
        self.server.process.wait()


def test_guard_ends_the_rollout_when_an_engine_dies_without_fault_tolerance(slow_engine):
    engine = _Process(f"http://127.0.0.1:{slow_engine.port}")
    guard = _guard([engine])
    threading.Timer(0.5, engine.server.process.kill).start()
    start = time.monotonic()
    try:
        with pytest.raises(EngineFailedError) as raised:
            guard.run("generate", 2, lambda: _post(engine.url + "/generate", {"rid": "sample1-y"}), budget_s=60,
                      weights_version=None)
    finally:
        guard.monitor.close()
        engine.stop()
    assert time.monotonic() - start < 40  # the process watch, not the 60 s deadline
    message = str(raised.value)
    assert "engine 0 at" in message and "process exited with code -9" in message
    assert "--use-fault-tolerance" in message
    assert "rid=sample1-y" in raised.value.details


class _DyingEngine:
    """An engine whose connections closed at once but whose exit code reads as exited only `exit_seen_s` later
    (a SIGKILLed process on a loaded machine)."""

    def __init__(self, url: str, exit_seen_s: float):
        self.url, self._seen_at = url, time.monotonic() + exit_seen_s

    def exit_code(self) -> int | None:
        return -9 if time.monotonic() >= self._seen_at else None

    def signal(self, sig: int) -> None:
        pass

    def process_state(self) -> str:
        return "exited with code -9" if self.exit_code() is not None else "alive"


def test_a_request_failed_by_an_engine_dying_ends_the_rollout_naming_the_engine():
    fleet = EngineFleet([_DyingEngine("http://127.0.0.1:9", exit_seen_s=1.0)], relaunch=lambda rank: None,
                        router=None, fault_tolerant=False)
    guard = RolloutGuard(HealthConfig(fault_tolerant=False, timeout_s=1.0), fleet, grace_s=1.0)

    def rollout():
        raise ConnectionError("worker http://127.0.0.1:9 closed the connection after the request was sent")

    try:
        with pytest.raises(EngineFailedError) as raised:
            guard.run("generate", 0, rollout, budget_s=60, weights_version=None)
    finally:
        guard.monitor.close()
    assert "engine 0 at http://127.0.0.1:9" in str(raised.value) and "process exited with code -9" in str(raised.value)
    assert "--use-fault-tolerance" in str(raised.value)


class _SlowRouter:
    """A router whose removal of a worker blocks until released (an HTTP call on a loaded machine)."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def remove(self, url: str) -> None:
        self.entered.set()
        self.release.wait(10)


def test_a_failure_and_its_restart_are_counted_together_while_the_router_is_slow():
    """A rollout that ends while the monitor is still taking a failed engine out of the router reads its
    failure and the restart it began in the same counts (they were once a restart apart: lost from both
    rollouts' counters)."""
    router, relaunched = _SlowRouter(), threading.Event()

    def relaunch(rank: int):
        relaunched.set()
        raise RuntimeError("this test restarts no engine")

    fleet = EngineFleet([_DyingEngine("http://127.0.0.1:9", exit_seen_s=0.0)], relaunch=relaunch, router=router,
                        fault_tolerant=True)
    failing = threading.Thread(target=fleet.fail, args=(0, "process exited with code -9"))
    failing.start()
    try:
        assert router.entered.wait(10)
        assert fleet.counts() == {"failures": 1, "restarts": 1}
    finally:
        router.release.set()
        failing.join(10)
    assert relaunched.wait(10) and fleet.counts() == {"failures": 1, "restarts": 1}


def _flaky_generate(failures: int):
    """A /generate that answers 503 (the router's answer when its engine died) `failures` times, then 200."""
    calls = []

    async def generate(request: web.Request) -> web.Response:
        calls.append(await request.json())
        if len(calls) <= failures:
            return web.json_response({"error": "worker died"}, status=503)
        return web.json_response({"text": "ok"})

    app = web.Application()
    app.router.add_post("/generate", generate)
    return AppThread(app).start(), calls


def test_requests_between_rollouts_get_the_fault_tolerance_retry(slow_engine):
    """What a background generator (fully-async) sends after a call ended is retried as inside one, counted in
    the next call's retried_requests; without --use-fault-tolerance the error stands."""
    server, calls = _flaky_generate(failures=1)
    url = f"http://127.0.0.1:{server.port}/generate"
    engine = _Process(f"http://127.0.0.1:{slow_engine.port}")  # one serving engine behind the router
    tolerant, plain = _guard([engine], fault_tolerant=True), _guard([engine], fault_tolerant=False)
    try:
        tolerant.run("generate", 0, lambda: None, budget_s=30, weights_version=None)
        assert _post(url, {"rid": "between-1"}, timeout_s=30) == {"text": "ok"} and len(calls) == 2
        _, counters = tolerant.run("generate", 1, lambda: None, budget_s=30, weights_version=None)
        assert counters["retried_requests"] == 1.0
        plain.run("generate", 0, lambda: None, budget_s=30, weights_version=None)
        calls.clear()
        with pytest.raises(http_utils.HTTPStatusError, match="HTTP 503"):
            _post(url, {"rid": "between-2"}, timeout_s=30)
    finally:
        for guard in (tolerant, plain):
            guard.monitor.close()
        http_utils.set_request_bounds(None)
        engine.stop()
        server.stop()


def test_between_rollouts_a_dead_engine_is_failed_and_the_wait_for_a_serving_one_is_bounded(monkeypatch):
    from slime.ray.rollout_manager import guard as guard_module

    monkeypatch.setattr(guard_module, "BETWEEN_CALLS_WAIT_S", 1.0)
    server, calls = _flaky_generate(failures=100)
    engine = _Process("http://127.0.0.1:1")
    guard = _guard([engine], fault_tolerant=True)
    released = threading.Event()

    def restart_that_does_not_serve_within_the_wait(rank: int):
        released.wait(60)
        raise RuntimeError(f"engine {rank}: the test's restart ended")

    guard.fleet.relaunch = restart_that_does_not_serve_within_the_wait
    try:
        guard.run("generate", 0, lambda: None, budget_s=30, weights_version=None)
        engine.server.process.kill()
        engine.server.process.wait()
        start = time.monotonic()
        with pytest.raises(http_utils.HTTPStatusError, match="HTTP 503"):
            _post(f"http://127.0.0.1:{server.port}/generate", {"rid": "between-3"}, timeout_s=30)
        assert time.monotonic() - start < 10 and len(calls) == 1
        assert [f.rank for f in guard.fleet.failures] == [0]  # noticed at the failed request, no monitor running
    finally:
        released.set()
        guard.monitor.close()
        http_utils.set_request_bounds(None)
        engine.stop()
        server.stop()


class _StoppedEngine:
    """A real engine-like process stopped with SIGSTOP: the kernel still accepts its connections, nothing answers
    them (a request, /v1/loads or an abort waits out its own timeout)."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, "-c", (
            "import socket, sys, time\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(64)\n"
            "print(s.getsockname()[1], flush=True); time.sleep(600)")], stdout=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{int(self.process.stdout.readline())}"
        self.process.send_signal(signal.SIGSTOP)

    def exit_code(self) -> int | None:
        return self.process.poll()

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def process_state(self) -> str:
        return local_process_state(self.process)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def test_a_stopped_engine_ends_the_rollout_at_once_with_its_requests_cancelled_not_after_the_grace(monkeypatch):
    """Without fault tolerance a stalled engine ends the rollout; its requests are cancelled on the client side at
    once (the rollout function returns before the guard does) and it is sent no abort that it could not answer."""
    engine = _StoppedEngine()
    fleet = EngineFleet([engine], relaunch=lambda rank: None, router=None, fault_tolerant=False)
    config = HealthConfig(fault_tolerant=False, timeout_s=1.0, first_wait_s=600.0,
                          progress=DeadlineModel(engine_no_progress_s=2.0))
    guard = RolloutGuard(config, fleet, grace_s=60.0)  # the old end waited the grace out: over a minute
    aborts, ended = [], []
    abort_all = SGLangHTTPClient.abort_all

    def rollout():
        try:
            _post(engine.url + "/generate", {"input_ids": [1, 2], "rid": "sample4-held"})
        except BaseException as exc:
            ended.append(exc)
            raise

    monkeypatch.setattr(SGLangHTTPClient, "abort_all", lambda client: (aborts.append(client.base_url), abort_all(client)))
    try:
        with pytest.raises(EngineStalledError) as raised:
            guard.run("generate", 3, rollout, budget_s=300, weights_version=None)
    finally:
        guard.monitor.close()
        engine.stop()
    assert re.fullmatch(rf"rollout 3: generate: engine 0 at {engine.url} did not answer GET /v1/loads for \d+s "
                        r"\(it never answered\) \(--rollout-no-progress-timeout 2s\); .*", str(raised.value))
    assert "stopped (SIGSTOP)" in raised.value.details and "rid=sample4-held" in raised.value.details
    assert aborts == []
    assert [type(exc) for exc in ended] == [http_utils.RequestAbandonedError], ended
    assert f"POST {engine.url}/generate: cancelled (rollout 3: generate ended: EngineStalledError)" in str(ended[0])
    assert http_utils.outstanding_requests() == []


# ----- the driver's targets -----------------------------------------------------------------------
def test_engine_targets_reaim_the_sync_after_a_catch_up():
    pushes = []
    targets = EngineTargets(urls=("a", "b"), push=lambda urls, version: pushes.append((urls, version)) or {})
    assert targets.catch_up(["c"]) is None  # nothing pushed yet: the checkpoint's weights are current
    targets.pushed(["a", "b"], 3)
    assert targets.for_sync(["a", "b"]) is None
    assert targets.catch_up(["c"]) == 3 and pushes == [(["c"], 3)]
    assert targets.for_sync(["a", "c"]) == ["a", "c"]  # the trainer aims at ["c"] now: re-aim at every engine


def test_a_trainer_ahead_of_the_engines_catches_up_with_its_own_version():
    pushes = []
    targets = EngineTargets(push=lambda urls, version: pushes.append((urls, version)) or {},
                            trainer_version=lambda: 5)
    targets.pushed(["a", "b"], 4)  # train_async.py: the engines hold 4, the trainer trained on to 5
    assert targets.catch_up(["b2"]) == 5 and pushes == [(["b2"], 5)]


def test_driver_fails_a_manager_call_that_reports_no_deadline_for_too_long():
    from slime.ray.driver.rollout_wait import ManagerDeadline
    from slime.utils.deadlines import unreported_deadline_s

    deadline = ManagerDeadline("generate", margin_s=10.0)
    limit = unreported_deadline_s(10.0)
    assert deadline.check(None, 100.0) is None  # the call has not started its clock yet
    assert deadline.check(None, 100.0 + limit - 1) is None
    assert deadline.check(5.0, 100.0 + limit + 1) is None  # a reported deadline resets the silence
    assert deadline.check(None, 200.0) is None
    message = deadline.check(None, 200.0 + limit + 1)
    assert message is not None and "'generate' reported no deadline for" in message
    assert "passed its deadline by 11s" in ManagerDeadline("eval", margin_s=10.0).check(-11.0, 0.0)
    assert ManagerDeadline("eval", margin_s=10.0).check(-9.0, 0.0) is None


def _manager_with_hanging_log(window_s: float):
    """A RolloutManager whose guarded generation returns at once and whose log hook never returns."""
    import hook_plugins
    from slime.ray.rollout_manager.manager import RolloutManager
    from slime.ray.rollout_manager.steps import RolloutSteps

    from slime.config import defaults_namespace

    args = defaults_namespace(use_fault_tolerance=False, save_debug_rollout_data=None, save=None,
                              custom_convert_samples_to_train_data_path=None, rollout_timeout=60,
                              custom_rollout_log_function_path=f"{hook_plugins.__file__}:hanging_rollout_log")
    manager = object.__new__(RolloutManager)
    guard = types.SimpleNamespace(run=lambda *a, **k: (([], {}), {}), left_s=lambda: None)
    fleet = types.SimpleNamespace(needing_weights=lambda: [])
    vars(manager).update(args=args, guard=guard, fleet=fleet, steps=RolloutSteps(window_s), _train_data=lambda s: {})
    return manager


def test_a_hanging_log_hook_ends_in_a_named_error_within_its_window():
    from slime.ray.rollout_manager.errors import RolloutStepTimeoutError

    manager = _manager_with_hanging_log(window_s=1.0)
    status: list = []
    poller = threading.Timer(0.5, lambda: status.append(manager.rollout_status()["left_s"]))
    poller.start()
    start = time.monotonic()
    with pytest.raises(RolloutStepTimeoutError, match=r"rollout 4: --custom-rollout-log-function-path .*hanging_"
                                                      r"rollout_log did not return within 1s"):
        manager.generate(4)
    assert time.monotonic() - start < 30  # its 1 s window and the report; the hook alone never returns
    poller.join()
    assert status and 0 < status[0] <= 1.0  # the driver's wait had a deadline while the hook hung
    assert manager.rollout_status()["left_s"] is None  # the call is over


class _UnpicklableError(Exception):
    """Like an aiohttp error that holds its session: Ray cannot carry it to the driver."""

    def __init__(self, message: str):
        super().__init__(message)
        self.session = threading.Lock()


def test_any_other_error_of_a_rollout_crosses_to_the_driver_as_a_rollout_error():
    import pickle

    from slime.ray.rollout_manager.errors import RolloutFailedError

    manager = _manager_with_hanging_log(window_s=1.0)

    def engine_answers_500():
        raise _UnpicklableError("HTTP 500 from http://127.0.0.1:1/generate")

    manager.guard = types.SimpleNamespace(run=lambda *a, **k: engine_answers_500(), left_s=lambda: None)
    with pytest.raises(RolloutFailedError) as raised:
        manager.generate(3)
    with pytest.raises(TypeError):
        pickle.dumps(_UnpicklableError("x"))  # what Ray would have had to carry
    carried = pickle.loads(pickle.dumps(raised.value))
    assert str(carried) == "generate of rollout 3: _UnpicklableError: HTTP 500 from http://127.0.0.1:1/generate"
    assert "engine_answers_500" in carried.details  # the manager's traceback travels with it

