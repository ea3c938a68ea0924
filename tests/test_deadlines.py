"""The deadline model: progress-based windows on the ranks, the watchdog's race, the derived limits.

Single-process tests: ledgers and watchdogs in one process, peers simulated by a second ledger
writing its file into the same directory (as another rank would).
"""
from __future__ import annotations

import ast
import threading
import time
import types
from pathlib import Path

import pytest

from slime.distributed import HangError, Ledger, Watchdog
from slime.distributed.progress import ProgressView, latest_file_progress
from slime.utils.arguments import parse_args
from slime.utils.deadlines import DeadlineModel, default_group_timeout_minutes

WINDOW_S = 0.5


def _busy(seconds: float, tick=None, every_s: float = 0.05) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(every_s)
        if tick is not None:
            tick()


def test_phase_several_windows_long_passes_while_it_progresses_and_fails_once_it_stalls(tmp_path):
    ledger = Ledger(0, 1, str(tmp_path))
    watchdog = Watchdog(WINDOW_S, str(tmp_path), 0, 1, ledger=ledger, grace_s=2.0)
    start = time.monotonic()
    with watchdog.phase("actor_train/forward_backward"):
        _busy(8 * WINDOW_S, ledger.note_progress)  # a micro-batch every 50 ms for 8 windows
    assert time.monotonic() - start >= 8 * WINDOW_S
    stalled_at = time.monotonic()
    with pytest.raises(HangError, match=r"phase=actor_train/forward_backward .*no progress for 0.5s"):
        with watchdog.phase("actor_train/forward_backward"):
            _busy(10)
    assert time.monotonic() - stalled_at < 8.0  # the stall alone lasts 10 s; a loaded machine's delay is not 6 s
    watchdog.close()
    ledger.close()


def test_a_phase_waiting_in_a_fence_leaves_the_stall_to_the_fences_own_error_first(tmp_path):
    """The fence polls its peers once a second and names the lagging ranks; the watchdog (polling every 0.1 s)
    waits FENCE_REPORT_MARGIN_S past its window before it trips a phase whose thread waits in a fence."""
    from slime.utils.deadlines import FENCE_REPORT_MARGIN_S

    ledger = Ledger(0, 1, str(tmp_path))
    watchdog = Watchdog(WINDOW_S, str(tmp_path), 0, 1, ledger=ledger, grace_s=2.0)
    tripped_after = {}
    for op, group in (("fence:sleep", "fence"), ("all_reduce", "tp")):
        start = time.monotonic()
        with pytest.raises(HangError):
            with watchdog.phase("sleep"):
                entry = ledger.begin_named(op, group, (0,))
                _busy(10)
        ledger.end(entry, error="interrupted")
        tripped_after[group] = time.monotonic() - start
    assert tripped_after["fence"] >= WINDOW_S + FENCE_REPORT_MARGIN_S
    assert tripped_after["tp"] < WINDOW_S + FENCE_REPORT_MARGIN_S
    watchdog.close()
    ledger.close()


def test_a_peer_that_keeps_progressing_keeps_a_waiting_rank_alive(tmp_path):
    waiting = Ledger(0, 2, str(tmp_path), flush_interval_s=0.05)
    working = Ledger(1, 2, str(tmp_path), flush_interval_s=0.05)
    # a 4 s window (not WINDOW_S): the peer's file is written and read back by threads that a loaded 2-core
    # machine can starve for seconds; a 2 s window tripped there while the peer was still progressing
    window_s, grace_s = 4.0, 2.0
    watchdog = Watchdog(window_s, str(tmp_path), 0, 2, ledger=waiting, grace_s=grace_s)
    with watchdog.phase("weight_sync/push"):  # rank 0 only waits (like a replica at the closing fence)
        _busy(3 * window_s, working.note_progress)
    stopped = time.monotonic()
    with pytest.raises(HangError):
        with watchdog.phase("weight_sync/push"):
            _busy(6 * window_s)  # nobody progresses any more
    assert time.monotonic() - stopped < 2 * window_s + grace_s + 4.0
    watchdog.close()
    waiting.close()
    working.close()


def test_failed_ops_are_not_progress_and_files_carry_the_progress_time(tmp_path):
    ledger = Ledger(0, 1, str(tmp_path))
    before = ledger.progress_at
    time.sleep(0.01)
    ledger.end(ledger.begin_named("fence:x", "fence", (0,)), error="TimeoutError: gave up")
    assert ledger.progress_at == before
    ledger.end(ledger.begin_named("fence:y", "fence", (0,)))
    assert ledger.progress_at > before
    ledger.flush()
    assert latest_file_progress(str(tmp_path), 1) == ledger.progress_at
    view = ProgressView(ledger)
    assert view.last_progress(since=0.0, window_s=10.0) == ledger.progress_at
    assert view.last_progress(since=ledger.progress_at + 5, window_s=10.0) == ledger.progress_at + 5
    ledger.close()


class _HeldDumpWatchdog(Watchdog):
    """Holds the trip between the decision and the injection (where the report is written)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.decided = threading.Event()
        self.release = threading.Event()

    def _dump(self, summary: str) -> None:
        self.decided.set()
        self.release.wait(10)


def test_a_phase_ending_between_trip_and_injection_leaves_no_stray_hang_error(tmp_path):
    ledger = Ledger(0, 1, str(tmp_path))
    watchdog = _HeldDumpWatchdog(WINDOW_S, str(tmp_path), 0, 1, ledger=ledger, grace_s=1.0)
    with pytest.raises(HangError, match="phase=logging") as raised:  # it was declared hung: the error lands here
        with watchdog.phase("logging"):
            assert watchdog.decided.wait(10)
    assert raised.value.lagging_ranks == (0,)
    watchdog.release.set()
    _busy(2.0)  # unrelated code: an error injected after the phase ended would land here
    watchdog.close()
    ledger.close()


def test_an_error_injected_during_a_native_wait_lands_inside_its_phase_without_an_exit(tmp_path):
    ledger = Ledger(0, 1, str(tmp_path))
    watchdog = Watchdog(WINDOW_S, str(tmp_path), 0, 1, ledger=ledger, grace_s=5.0)
    done = threading.Event()
    with pytest.raises(HangError):
        with watchdog.phase("weight_sync"):
            done.wait(3 * WINDOW_S + 1)  # a lock wait: the injected error cannot land inside it
    _busy(1.0)
    watchdog.close()
    ledger.close()


def test_group_timeout_is_derived_above_every_rank_window_and_checked_at_parse_time():
    model = DeadlineModel(no_progress_s=600.0)
    assert model.first_setup_s == 1210.0
    assert model.group_timeout >= model.first_setup_s + 30 and model.group_timeout == 60 * 21
    assert model.driver_window_s > model.no_progress_s
    assert default_group_timeout_minutes(30.0) == 2
    minimal = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
               "--train-backend-device", "cpu"]
    assert parse_args(minimal + ["--fence-timeout", "30"]).distributed_timeout_minutes == 2
    assert parse_args(minimal + ["--fence-timeout", "30", "--distributed-timeout-minutes", "5"]
                      ).distributed_timeout_minutes == 5
    with pytest.raises(SystemExit):
        parse_args(minimal + ["--distributed-timeout-minutes", "5"])  # 300 s is under 2 x 180 + 10 (+ 30)
    assert parse_args(minimal).distributed_timeout_minutes == 7  # the default window: upstream's 10 is accepted


def test_parse_error_says_which_flags_to_change(capsys):
    minimal = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
               "--train-backend-device", "cpu"]
    with pytest.raises(SystemExit):
        parse_args(minimal + ["--distributed-timeout-minutes", "5"])
    err = capsys.readouterr().err
    assert "--distributed-timeout-minutes 7" in err and "lower --fence-timeout to 130" in err, err


class _Ref(str):
    """A rank's call as the fakes below see it; `future()` is how the driver settles a call it stops watching."""

    settled = False

    def future(self):
        self.settled = True


class _FakeRay:
    """ray.wait / ray.get for the driver's waiting logic: every rank finishes at `finish_at`."""

    def __init__(self, finish_at: float):
        self.finish_at = finish_at

    def wait(self, pending, num_returns, timeout):
        if time.time() >= self.finish_at:
            return pending[:1], pending[1:]
        time.sleep(min(timeout, max(0.0, self.finish_at - time.time())))
        return [], pending

    def get(self, refs):
        return [f"result of {r}" for r in refs] if isinstance(refs, list) else f"result of {refs}"


def _ticking(stop: threading.Event) -> list[float]:
    latest = [time.time()]

    def tick() -> None:
        while not stop.wait(0.05):
            latest[0] = time.time()

    threading.Thread(target=tick, daemon=True).start()
    return latest


def test_driver_waits_as_long_as_ranks_progress_and_fails_one_window_after_they_stop(monkeypatch):
    from slime.ray.driver import rank_wait as deadline

    monkeypatch.setattr(deadline.ray, "wait", _FakeRay(time.time() + 3.0).wait)
    monkeypatch.setattr(deadline.ray, "get", _FakeRay(0).get)
    stop = threading.Event()
    latest = _ticking(stop)
    # a phase 5 windows long (many steps, a large save) passes while some rank progresses
    assert deadline.wait_ranks(["r0", "r1"], phase="actor_train", window_s=0.6, progress=lambda: latest[0],
                               poll_s=0.1) == ["result of r0", "result of r1"]
    stop.set()
    monkeypatch.setattr(deadline.ray, "wait", _FakeRay(time.time() + 60).wait)
    stopped = time.time()
    refs = [_Ref("r0"), _Ref("r1")]
    with pytest.raises(deadline.RankDeadlineError, match=r"phase 'save': no rank made progress .* ranks \[0, 1\]") as err:
        deadline.wait_ranks(refs, phase="save", window_s=0.6, progress=lambda: latest[0],
                            describe_hang=lambda: "THE TABLE", poll_s=0.1)
    assert time.time() - stopped < 10.0  # one 0.6 s window after the last progress, not the 60 s wait
    assert err.value.details.endswith("THE TABLE") and err.value.ranks == (0, 1)
    assert all(ref.settled for ref in refs)  # their later errors are taken, not printed by Ray as unhandled


def test_a_failed_rank_keeps_its_traceback_and_the_summary_stays_one_line():
    from slime.ray.driver.rank_wait import _failure
    from slime.ray.trainer.rank_actor import RankError

    class TaskError(Exception):
        cause = RankError("CollectiveDivergenceError: ranks [3] diverge at fence 'actor_train/plan'\nrank | plan",
                          'Traceback (most recent call last):\n  File "actor.py", line 1\nCollectiveDivergenceError: ...',
                          stalled=False)

    class Stalled(Exception):
        cause = RankError("HangError: HANG: phase=actor_train/wake stuck ranks=[3]", "Traceback ...", stalled=True)

    failure = _failure("actor_train", 0, TaskError(), ["ranks [1]: CollectiveDivergenceError: ..."], lambda: "THE TABLE",
                       None)
    assert str(failure) == ("phase 'actor_train' failed on rank 0: CollectiveDivergenceError: ranks [3] diverge at "
                            "fence 'actor_train/plan'")
    assert failure.details.startswith("rank 0 traceback:\nTraceback (most recent call last):")
    assert failure.details.endswith("also failed:\nranks [1]: CollectiveDivergenceError: ...")  # no hang table
    stalled = _failure("actor_train", 3, Stalled(), [], lambda: "THE TABLE", None)
    assert stalled.details.endswith("THE TABLE")  # where every rank is, after a stall
    import pickle  # Ray carries the rank's error by pickling it

    carried = pickle.loads(pickle.dumps(TaskError.cause))
    assert str(carried) == TaskError.cause.message and carried.traceback_text == TaskError.cause.traceback_text


def test_a_rank_whose_fence_timed_out_blames_the_peers_it_found_lagging():
    """--max-restarts counts the failing ranks: a rank that timed out waiting names the rank that hung."""
    import pickle

    from slime.distributed.errors import FenceTimeoutError
    from slime.ray.driver.rank_wait import _failure
    from slime.ray.trainer.rank_actor import RankError, TrainRayActor

    class Waiting:  # a rank whose weight push's fence found rank 1 lagging
        def update_weights(self, rollout_id, engine_urls, *, served=False, keep_served=None):
            raise FenceTimeoutError("fence 'weight_sync' timed out", phase="weight_sync", lagging_ranks=(1,))

    with pytest.raises(RankError) as raised:  # the actor's wrapper makes it portable
        TrainRayActor.update_weights(types.SimpleNamespace(actor=Waiting()), 0)
    carried = pickle.loads(pickle.dumps(raised.value))
    assert carried.lagging == (1,) and carried.stalled

    class TaskError(Exception):
        cause = carried

    failure = _failure("actor_train", 0, TaskError(), [], lambda: "THE TABLE", None)
    assert failure.ranks == (0,) and failure.blamed == (1,)


def test_a_rank_whose_process_ended_is_blamed_before_the_peer_that_lost_it(monkeypatch):
    """The peer's error (its collective lost a member) may reach the driver first: the exited rank is at fault."""
    import ray

    from slime.ray.driver import rank_wait as deadline

    class PeerLost(Exception):
        pass

    class Ray:
        exceptions = ray.exceptions

        def wait(self, pending, num_returns, timeout):
            return list(pending), []

        def get(self, ref):
            raise PeerLost("connection closed by peer") if ref == "r0" else ray.exceptions.RayActorError()

    monkeypatch.setattr(deadline, "ray", Ray())
    with pytest.raises(deadline.RankFailedError, match="failed on rank 0") as raised:
        deadline.wait_ranks([_Ref("r0"), _Ref("r1")], phase="actor_train", window_s=30.0)
    assert raised.value.ranks == (0,) and raised.value.blamed == (1,)


def test_the_default_windows_end_a_stalled_step_within_five_minutes_and_help_says_why():
    from slime.config.parser import build_parser

    model = DeadlineModel()
    assert model.no_progress_s == 180 and model.driver_window_s <= 300  # the ranks' error, else the driver's
    assert model.group_timeout == 60 * 7
    options = build_parser()._option_string_actions
    said = " ".join(options["--fence-timeout"].help.split())
    assert f"Default {model.no_progress_s:.0f}" in said and f"{model.first_setup_s:.0f} s" in said
    assert "within 3 minutes on the ranks and 5 at the driver" in said
    assert "7 with --fence-timeout 180" in " ".join(options["--distributed-timeout-minutes"].help.split())
    for flag in ("--rollout-timeout", "--rollout-health-check-interval", "--rollout-health-check-timeout",
                 "--rollout-health-check-first-wait", "--sglang-router-request-timeout-secs"):
        assert "default" in options[flag].help, flag


def test_the_default_engine_window_ends_a_hung_rollout_within_five_minutes_and_help_says_why():
    """A stalled engine is found within the window and one look; the manager's report and the rollout function's
    grace (what the driver's margin covers) still end the rollout within 5 minutes of the engine's last progress,
    where the rollout timeout of upstream's Qwen3-4B launcher is ~19 minutes."""
    from slime.config.parser import build_parser
    from slime.utils.deadlines import rollout_deadline_s, rollout_driver_margin_s

    args = parse_args(["--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--num-rollout", "1",
                       "--rollout-max-response-len", "8192", "--rollout-num-gpus", "8", "--actor-num-gpus-per-node", "1",
                       "--train-backend-device", "cpu", "--rollout-backend", "embedded"])
    model = args.run_config.deadlines
    assert model.engine_no_progress_s == 180 and model.engine_look_s == 15 and model.engine_read_s == 5
    found_s = model.engine_stall_found_s + rollout_driver_margin_s(args)
    assert found_s <= 300 < rollout_deadline_s(args, args.run_config)
    said = " ".join(build_parser()._option_string_actions["--rollout-no-progress-timeout"].help.split())
    assert f"Default {model.engine_no_progress_s:.0f}" in said and "within 5 minutes" in said
    assert f"window / {round(model.engine_no_progress_s / model.engine_look_s)}" in said
    assert "25-69 s" in said  # the longest healthy gap, as --fence-timeout's help gives it


def test_engine_window_flag_is_checked(capsys):
    flags = ["--rollout-batch-size", "4", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
             "--train-backend-device", "cpu", "--rollout-backend", "embedded"]
    with pytest.raises(SystemExit):
        parse_args([*flags, "--rollout-no-progress-timeout", "0"])
    assert "--rollout-no-progress-timeout must be positive" in capsys.readouterr().err
    assert parse_args([*flags, "--rollout-no-progress-timeout", "30"]).run_config.deadlines.engine_no_progress_s == 30


# ---------------------------------------------------------------- one home for the fixed limits

REPO = Path(__file__).resolve().parents[1]


def _numeric(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def fixed_timeouts(path: Path) -> list[str]:
    """Numbers given to a timeout in this file: `timeout...=<number>` in a call, a parameter's default, or a name
    assigned one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            found += [f"{path.name}:{node.lineno} {kw.arg}" for kw in node.keywords
                      if kw.arg and "timeout" in kw.arg.lower() and _numeric(kw.value)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults),
                     *zip(args.kwonlyargs, args.kw_defaults)]
            found += [f"{path.name}:{node.lineno} {arg.arg}" for arg, default in pairs
                      if default is not None and "timeout" in arg.arg.lower() and _numeric(default)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _numeric(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [f"{path.name}:{node.lineno} {t.id}" for t in targets
                      if isinstance(t, ast.Name) and "timeout" in t.id.lower()]
    return found


def test_every_fixed_timeout_is_named_in_the_deadline_module():
    """A fixed limit lives in slime/utils/deadlines.py with a line on why it is that long; elsewhere a timeout is a
    name from there or a window of the run. The command-line tools (slime/tools) pass flags, not limits."""
    home = REPO / "slime" / "utils" / "deadlines.py"
    files = [p for top in ("slime", "slime_plugins") for p in sorted((REPO / top).rglob("*.py"))
             if p != home and (REPO / "slime" / "tools") not in p.parents]
    assert [hit for path in files for hit in fixed_timeouts(path)] == []


def test_the_fixed_timeout_scan_sees_each_form(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("CALL_TIMEOUT_S = 10.0\ndef f(timeout_s=2.0, *, connect_timeout=1):\n"
                     "    g(timeout=5)\n    g(timeout=CALL_TIMEOUT_S)\n")
    assert fixed_timeouts(probe) == ["probe.py:1 CALL_TIMEOUT_S", "probe.py:2 timeout_s", "probe.py:2 connect_timeout",
                                     "probe.py:3 timeout"]


# ---------------------------------------------------------------- one value from the parser to every reader

DEADLINE_FLAGS = ("fence_timeout", "distributed_timeout_minutes", "rollout_no_progress_timeout")
"""The flags the deadline model is derived from (DeadlineModel.from_args)."""
DERIVED_ONCE_IN = ("slime/utils/deadlines.py", "slime/config/")
"""Where those flags are read: the deadline module, and the parser with its checks (which run before the run
config, built last by parse_args, derives the run's model)."""


def _reads_args(node: ast.AST) -> bool:
    """`args.x` or `self.args.x`."""
    owner = node.value if isinstance(node, ast.Attribute) else None
    return (isinstance(owner, ast.Name) and owner.id == "args") or (
        isinstance(owner, ast.Attribute) and owner.attr == "args")


def deadline_fallbacks(path: Path) -> list[str]:
    """`args.<a timeout flag> or <anything>`: a second default beside the parser's (the flag is checked positive)."""
    return [f"{path.name}:{node.lineno} {node.values[0].attr}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and isinstance(node.values[0], ast.Attribute)
            and _reads_args(node.values[0]) and "timeout" in node.values[0].attr]


def deadline_rederivations(path: Path) -> list[str]:
    """A read of a flag the deadline model is derived from, or a new derivation of the model."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in DEADLINE_FLAGS:
            found.append(f"{path.name}:{node.lineno} {node.attr}")
        elif (isinstance(node, ast.Attribute) and node.attr == "from_args" and isinstance(node.value, ast.Name)
              and node.value.id == "DeadlineModel"):
            found.append(f"{path.name}:{node.lineno} DeadlineModel.from_args")
    return found


def _product_files() -> list[Path]:
    return [p for top in ("slime", "slime_plugins") for p in sorted((REPO / top).rglob("*.py"))] + [
        REPO / "train.py", REPO / "train_async.py"]


def test_no_deadline_flag_is_read_with_a_fallback():
    """A timeout flag has one default, the parser's: `args.fence_timeout or 600.0` would be a second one, silently
    used by arguments that lack the flag (the weight push once waited 600 s where the ranks' window was 180 s)."""
    assert [hit for path in _product_files() for hit in deadline_fallbacks(path)] == []


def test_the_fence_timeout_reaches_every_reader_through_the_one_deadline_model():
    """--fence-timeout (and the two flags beside it) are read in the deadline module and the parser's checks alone;
    everything else reads the run's DeadlineModel (`run_deadlines(args)`: args.run_config.deadlines)."""
    hits = [hit for path in _product_files() if not str(path.relative_to(REPO)).startswith(DERIVED_ONCE_IN)
            for hit in deadline_rederivations(path)]
    assert hits == []


def test_the_deadline_scans_see_each_form(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("a = float(args.fence_timeout or 600.0)\nb = self.args.rollout_health_check_timeout or LIMIT\n"
                     "c = args.sglang_server_concurrency or 512\nd = DeadlineModel.from_args(args)\n"
                     "e = self.args.distributed_timeout_minutes\n")
    assert sorted(deadline_fallbacks(probe)) == ["probe.py:1 fence_timeout", "probe.py:2 rollout_health_check_timeout"]
    assert sorted(deadline_rederivations(probe)) == ["probe.py:1 fence_timeout", "probe.py:4 DeadlineModel.from_args",
                                             "probe.py:5 distributed_timeout_minutes"]


def test_the_run_reads_the_deadline_model_parse_args_built():
    """Every process receives args with their run config: a rank, the engines' launcher and the weight push read the
    window parse_args derived, not the flag again."""
    from slime.utils.deadlines import run_deadlines

    args = parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
                       "--train-backend-device", "cpu", "--fence-timeout", "42"])
    assert run_deadlines(args) is args.run_config.deadlines and run_deadlines(args).no_progress_s == 42.0
    from slime.config import defaults_namespace

    assert run_deadlines(defaults_namespace(fence_timeout=7.0)).no_progress_s == 7.0  # no command line: same rule
