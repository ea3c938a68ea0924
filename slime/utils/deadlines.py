"""Every deadline of the loop, and its derivation from flags: each wait takes its limit from here.

Three kinds of limits, one rule for each:

Progress windows (the trainer ranks and the driver's wait on them). `--fence-timeout` is not how long
a phase may take but how long a rank may go without progress: no collective completing, no
micro-batch, no weight bucket, no checkpoint bytes written. A healthy phase of any length passes; a
stall fails one window after the last progress (`DeadlineModel`):

  rank window     --fence-timeout: the watchdog's phases and the fences. Peers' progress counts (read
                  through the progress hub, from every node): a rank waiting at a fence for peers that
                  keep working is not hung. The hub sees a peer up to two heartbeat intervals (2 s) late.
  first set-up    FIRST_SETUP_WINDOWS windows per warm-up op (+ FIRST_SETUP_EXTRA_S for the phase):
                  the first communicator set-up at job start is slower than any later one.
  process groups  --distributed-timeout-minutes, strictly above every rank window (by at least
                  GROUP_TIMEOUT_MARGIN_S), so the watchdog names the phase before NCCL or gloo abort.
                  Derived when not given; checked at parse time when given.
  driver          no rank progressed for DRIVER_MARGIN windows + DRIVER_EXTRA_S (the ranks' own named
                  errors arrive first); init adds INIT_ALLOWANCE_S for model build and weight loading,
                  which are not fenced.
  manager steps   each step of the rollout manager outside generation (user hooks, the data save,
                  metrics) gets one rank window (`rollout_step_window_s`).
  engines         --rollout-no-progress-timeout: while a rollout generates, an engine that holds requests
                  and whose work counters (tokens in its KV cache, decode steps, prefill tokens: SGLang's
                  /v1/loads) do not move for this long, or that does not answer them at all, is stalled.
                  The rollout manager looks every window / ENGINE_LOOKS_PER_WINDOW, each read bounded by
                  --rollout-health-check-timeout's default (a quarter of a shorter window), so a stall is
                  found within `engine_stall_found_s`.

The driver's limits follow the ranks' progress, so they grow with --num-steps-per-rollout and with
the checkpoint size of a save without a fixed total.

Rollout budgets (the rollout manager, every request of a rollout, the driver's wait on the manager).
`--rollout-timeout SECONDS` bounds one whole rollout in the rollout manager: every sampling round,
every /generate request, reward calls included. Left unset, it scales with the work:

    rollout timeout = 300 s + 0.1 s x max_new_tokens x waves
    waves           = ceil(samples / (engines x --sglang-server-concurrency))
    samples         = max(--rollout-batch-size, --over-sampling-batch-size) x --n-samples-per-prompt
    max_new_tokens  = --rollout-max-response-len (else --rollout-max-context-len, else 4096)

An eval uses the same rule with every eval prompt x --n-samples-per-eval-prompt and
--eval-max-response-len. 0.1 s per token is several times a loaded GPU engine's decode step; the
300 s cover start-up, queueing and rewards. A rollout that needs several sampling rounds (dynamic
sampling) can take longer: set --rollout-timeout for it. Derived from the same rule: each request's
own timeout never outlives the rollout's deadline (plus REQUEST_GRACE_S, so that the manager reports
the requests still outstanding before they end), and the driver waits on the manager for the
deadline plus `rollout_driver_margin_s` (the time the manager needs to probe the engines and raise a
report), so that the error naming engines and requests fires first. `RolloutClock` is the budget of
the rollout in progress, which engine recoveries extend.

Fixed limits (control calls that do no work proportional to the job): starting an engine, one call
that releases, resumes or flushes the engines, the driver's calls on the rollout manager, placement.
Each is a named function below, named after what waits; the ones built on another say so.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

DEFAULT_NO_PROGRESS_S = 180.0
"""--fence-timeout's default. The longest gap without progress a healthy run of upstream's sizes shows is the first
step's kernel compile (25-69 s on one H200, docs/gpu.md); start-up gets FIRST_SETUP_WINDOWS windows (+10 s), 370 s,
enough to load a node's share of a resumed Qwen3-30B-A3B checkpoint with its optimizer state (~430 GB) at 2 GB/s.
A stalled step then ends within 3 minutes on the ranks and within 5 at the driver (DRIVER_MARGIN windows +
DRIVER_EXTRA_S)."""
DEFAULT_ENGINE_NO_PROGRESS_S = 180.0
"""--rollout-no-progress-timeout's default. SGLang's scheduler publishes the counters the rollout manager reads after
every prefill batch and every 15 decode steps (tens of milliseconds each at upstream's sizes), so a healthy engine
moves them within seconds; the longest healthy gap is a first batch's kernel compile (the engines are launched
without SGLang's warm-up request; the trainer's first step compiles in 25-69 s on one H200), which 180 s covers more
than twice over. A stalled engine is then found within the window and one look (`engine_stall_found_s`, 200 s) and
the rollout ends, its report and the rollout function's grace included (`rollout_driver_margin_s`), within 5 minutes
of the engine's last progress."""
ENGINE_LOOKS_PER_WINDOW = 12
FIRST_SETUP_WINDOWS = 2
FIRST_SETUP_EXTRA_S = 10.0
GROUP_TIMEOUT_MARGIN_S = 30.0
DRIVER_MARGIN = 1.5
DRIVER_EXTRA_S = 30.0
INIT_ALLOWANCE_S = 600.0


@dataclass(frozen=True, kw_only=True)
class DeadlineModel:
    """The progress windows of the ranks and of the driver's wait on them, from --fence-timeout and
    --distributed-timeout-minutes, and of the rollout engines, from --rollout-no-progress-timeout."""

    no_progress_s: float = DEFAULT_NO_PROGRESS_S
    """A rank (or, seen from a fence, the whole world) that makes no progress this long is hung."""
    group_timeout_s: float | None = None
    """NCCL's and gloo's own timeout; None: derived, GROUP_TIMEOUT_MARGIN_S above the longest rank window."""
    engine_no_progress_s: float = DEFAULT_ENGINE_NO_PROGRESS_S
    """An engine that holds requests and makes no progress this long while a rollout generates is stalled."""

    @classmethod
    def from_args(cls, args) -> "DeadlineModel":
        minutes = args.distributed_timeout_minutes
        return cls(no_progress_s=float(args.fence_timeout),
                   group_timeout_s=60.0 * float(minutes) if minutes else None,
                   engine_no_progress_s=float(args.rollout_no_progress_timeout))

    @property
    def first_setup_op_s(self) -> float:
        """Deadline of each communicator warm-up op at job start."""
        return FIRST_SETUP_WINDOWS * self.no_progress_s

    @property
    def first_setup_s(self) -> float:
        """The watchdog window of the first set-up phase: the longest window a rank uses."""
        return self.first_setup_op_s + FIRST_SETUP_EXTRA_S

    @property
    def group_timeout(self) -> float:
        if self.group_timeout_s is not None:
            return self.group_timeout_s
        return 60.0 * default_group_timeout_minutes(self.no_progress_s)

    @property
    def driver_window_s(self) -> float:
        """The driver fails a phase when no rank progressed for this long."""
        return DRIVER_MARGIN * self.no_progress_s + DRIVER_EXTRA_S

    @property
    def driver_init_window_s(self) -> float:
        """The same for init: model build and weight loading make no ledger progress."""
        return INIT_ALLOWANCE_S + self.first_setup_s + self.driver_window_s

    @property
    def engine_look_s(self) -> float:
        """How often the rollout manager reads every engine's progress while a rollout generates."""
        return self.engine_no_progress_s / ENGINE_LOOKS_PER_WINDOW

    @property
    def engine_read_s(self) -> float:
        """The limit of one such read (an engine that does not answer within it made no progress): a quarter of the
        window, at most --rollout-health-check-timeout's default."""
        return min(DEFAULT_HEALTH_CHECK_TIMEOUT_S, self.engine_no_progress_s / 4)

    @property
    def engine_stall_found_s(self) -> float:
        """From an engine's last progress to the look that finds it stalled, at the latest."""
        return self.engine_no_progress_s + self.engine_look_s + self.engine_read_s

    def group_timeout_error(self) -> str | None:
        """What to change when an explicit group timeout does not sit above every rank window."""
        if self.group_timeout_s is None or self.group_timeout_s >= self.first_setup_s + GROUP_TIMEOUT_MARGIN_S:
            return None
        need = default_group_timeout_minutes(self.no_progress_s)
        most = (self.group_timeout_s - GROUP_TIMEOUT_MARGIN_S - FIRST_SETUP_EXTRA_S) / FIRST_SETUP_WINDOWS
        lower = f"or lower --fence-timeout to {math.floor(most)}" if most >= 1 else "or lower --fence-timeout"
        return (f"--distributed-timeout-minutes {self.group_timeout_s / 60:g} ({self.group_timeout_s:g}s) must exceed "
                f"the ranks' longest watchdog window, {self.first_setup_s:g}s (the first communicator set-up: "
                f"{FIRST_SETUP_WINDOWS} x --fence-timeout {self.no_progress_s:g} + {FIRST_SETUP_EXTRA_S:g}s), by "
                f"{GROUP_TIMEOUT_MARGIN_S:g}s, so that the watchdog names the phase before a communicator aborts: "
                f"pass --distributed-timeout-minutes {need} (or leave it unset) {lower}")


def default_group_timeout_minutes(no_progress_s: float) -> int:
    longest = FIRST_SETUP_WINDOWS * no_progress_s + FIRST_SETUP_EXTRA_S
    return max(1, math.ceil((longest + GROUP_TIMEOUT_MARGIN_S) / 60.0))


def run_deadlines(args) -> DeadlineModel:
    """The run's deadline model: the one parse_args builds last (``args.run_config.deadlines``), which every process
    receives with its arguments. Arguments built without a command line (tests, tools: slime/config/defaults.py)
    have no run config; their model is derived from their flags by the same rule."""
    run_config = vars(args).get("run_config")
    return run_config.deadlines if run_config is not None else DeadlineModel.from_args(args)


def rollout_step_window_s(args) -> float:
    """The window of each rollout-manager step outside generation (user hooks, the data save, metrics):
    the loop's no-progress window, --fence-timeout."""
    return run_deadlines(args).no_progress_s


# -- rollout budgets ---------------------------------------------------------------------------------

ROLLOUT_BASE_S = 300.0
SECONDS_PER_TOKEN = 0.1
DEFAULT_MAX_NEW_TOKENS = 4096
REQUEST_GRACE_S = 15.0
ROLLOUT_DRIVER_EXTRA_S = 60.0
DEFAULT_HEALTH_CHECK_TIMEOUT_S = 5.0  # --rollout-health-check-timeout's default


def rollout_timeout_s(*, samples: int, max_new_tokens: int, engines: int, concurrency: int) -> float:
    """The default rollout deadline for this much work (the formula of the module docstring)."""
    waves = math.ceil(max(1, samples) / (max(1, engines) * max(1, concurrency)))
    return ROLLOUT_BASE_S + SECONDS_PER_TOKEN * max(1, max_new_tokens) * waves


def _max_new_tokens(args, evaluation: bool) -> int:
    value = args.eval_max_response_len if evaluation else None
    for candidate in (value, args.rollout_max_response_len, args.rollout_max_context_len):
        if candidate:
            return int(candidate)
    return DEFAULT_MAX_NEW_TOKENS


def rollout_deadline_s(args, run, *, evaluation: bool = False, eval_prompts: int = 0) -> float:
    """--rollout-timeout, or the default rule for a training rollout (or an eval of `eval_prompts` prompts), of
    `run`, the run's config (slime/config/run_config.py: its rollout size and engine count)."""
    if args.rollout_timeout:
        return float(args.rollout_timeout)
    size = run.rollout
    samples = eval_prompts * size.eval_samples_per_prompt if evaluation else size.samples_drawn
    return rollout_timeout_s(samples=samples, max_new_tokens=_max_new_tokens(args, evaluation),
                             engines=run.roles.engines, concurrency=size.concurrency_per_engine)


def unreported_deadline_s(margin_s: float) -> float:
    """How long the driver waits on a manager call that reports no deadline (not started yet, or between its
    steps): the driver's margin, twice over. Past it the call is failed as unbounded."""
    return 2 * margin_s


def rollout_driver_margin_s(args) -> float:
    """What the driver adds to the manager's deadline: the manager's report (engine probes) comes first."""
    return ROLLOUT_DRIVER_EXTRA_S + 2 * float(args.rollout_health_check_timeout)



@dataclass
class RolloutClock:
    """The deadline of the rollout in progress (monotonic seconds); `extend` adds time spent recovering
    engines, which the rollout could not use to generate."""

    deadline: float | None = None
    budget_s: float = 0.0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def start(self, budget_s: float) -> None:
        with self._lock:
            self.budget_s = budget_s
            self.deadline = time.monotonic() + budget_s

    def stop(self) -> None:
        with self._lock:
            self.deadline = None

    def extend(self, seconds: float) -> None:
        with self._lock:
            if self.deadline is not None:
                self.deadline += seconds
                self.budget_s += seconds

    def left_s(self) -> float | None:
        """Seconds until the deadline (negative once past it); None when no rollout runs."""
        deadline = self.deadline
        return None if deadline is None else deadline - time.monotonic()

    def expired(self) -> bool:
        left = self.left_s()
        return left is not None and left <= 0


# -- fixed limits: control calls, named after what waits ---------------------------------------------

ENGINE_STARTUP_S = 900.0
"""One engine's process: started, listening and healthy (SGLang loads its weights here)."""
ENGINE_CONTROL_CALL_S = 300.0
"""One engine-control call of the rollout manager (release or resume memory, flush, the engine list);
generation is bounded by the rollout's budget, not here."""
ENGINE_ACTOR_CALL_S = 30.0
"""A call on an engine's Ray actor (exit code, signal to its process tree), and an HTTP control call the
engine fleet makes (weight version read-back, abort)."""
ROLLOUT_STATUS_CALL_S = 60.0
"""The driver's status poll of a rollout in flight (and the catch-up report that may follow it)."""
ROLLOUT_MANAGER_SHUTDOWN_S = 60.0
"""The rollout manager stopping its engines and router; each engine actor's stop, the same."""
TRAINER_RENDEZVOUS_CALL_S = 120.0
"""Rank 0 reporting the rendezvous address (master address and port) of the trainer ranks."""
PLACEMENT_S = 300.0
"""Ray reserving every bundle of the job, then a probe on each bundle reporting its node and GPU."""
WANDB_INIT_S = 300.0
"""`wandb.init` on the driver (login, run creation on the server); WANDB_MODE=offline needs no server."""
ENGINE_CALL_S = 600.0
"""A generate or weight-update call of an engine client given no window of its own (the weight push passes the
rank window, --fence-timeout)."""
ENGINE_MEMORY_CALL_S = 120.0
"""An engine releasing or resuming its memory (SGLang moves its weights and KV cache to or from the host)."""
ENGINE_HTTP_CONTROL_S = 30.0
"""An HTTP control call of an engine (health, pause and continue, flush, server info, abort, the weight version):
the engine answers from memory, between two scheduler steps."""
EMBEDDED_WEIGHT_GROUP_S = 600.0
"""The embedded engine's --weight-update-timeout when it is started by hand; the launcher passes the run's
--fence-timeout."""
EMBEDDED_DECODE_STEP_S = 30.0
"""The embedded engine: a running batch that made no decode step for this long reports itself unhealthy
(a decode step of the sizes it serves takes well under a second on a loaded CPU)."""
SERVER_HEALTH_PROBE_S = 2.0
"""One /health probe of a server (engine, router) while it starts, and of an engine that a weight push found
late; a live server answers in milliseconds, and the start-up or push deadline bounds the probes together."""
SERVER_SHUTDOWN_S = 2.0
"""An HTTP server (router, embedded engine) finishing its open requests when it is stopped."""
ROUTER_STARTUP_S = 120.0
"""The router's process: started, listening and healthy (it loads no model)."""
ROUTER_CALL_S = 10.0
"""One call on the router's worker list (list, add, remove): the router answers from memory."""
ROUTER_REGISTER_S = 60.0
"""Until the router lists a worker it was told to add, or no longer lists one it was told to remove
(sglang-router does both in a background workflow that first checks the worker's health)."""
ROUTER_CONNECT_S = 5.0
"""The slime router opening a connection to a worker: past it the worker counts as dead."""
ROUTER_HEALTH_PROBE_S = 5.0
"""The slime router's /health probe of each worker; a loopback or LAN answer takes milliseconds."""
ROUTER_REQUEST_S = 14400.0
"""One proxied /generate: --sglang-router-request-timeout-secs's default (upstream's); the slime router started by
hand takes it too. A request of a rollout is bounded by the rollout's budget first."""
PLUGIN_HTTP_CALL_S = 1800.0
"""An HTTP call of a rollout plug-in that gives no limit (upstream's `post(url, payload)`): one long generation on
a loaded engine; a call made during a rollout is bounded by the rollout's budget first."""
REMOTE_REWARD_CALL_S = 120.0
"""One call to a remote reward model (--rm-type remote_rm, tried up to 3 times): one forward of one sample."""
TEACHER_CALL_S = 300.0
"""One call on the on-policy-distillation teacher: the prefill of one sample, behind the teacher's queue."""
HUB_CALL_S = 10.0
"""One call on the progress hub (a heartbeat, the table): past it the caller counts the hub as unreachable; a live
hub answers within its heartbeat interval."""
FENCE_REPORT_MARGIN_S = 2.0
"""How long past its window the watchdog leaves a phase that waits in a fence to the fence's own error (two of the
fence's wait slices), which names the lagging ranks."""
WATCHDOG_EXIT_GRACE_S = 5.0
"""After a phase's window, how long the watchdog waits for the error it raised into a thread blocked in native code
to land before it ends the process (exit code 3) with the phase named."""
NCCL_WATCHDOG_MARGIN_S = 60.0
"""NCCL's own watchdog on a weight-update group is set this far above the deadline the sender polls against (NCCL
ends the process past its limit; the sender's named error must come first)."""
SESSION_CLOSE_AFTER_FAILURE_S = 2.0
"""Closing the engines' weight-update sessions after a failed push: a stalled engine may be why it failed, and
what is left open the next push closes first."""
RANK_CLOSE_S = 5.0
"""A trainer rank closing its ledger at shutdown (milliseconds when healthy)."""
OTHER_RANK_FAILURES_S = 2.0
"""After one rank failed, how long the driver waits for the other ranks' errors (ranks that meet at a fence fail
together), so that one report names them all."""
METRICS_CLOSE_S = 60.0
"""The metrics logger writing what it still holds at shutdown (wandb and TensorBoard flush to disk or server)."""
RAY_ADDRESS_PROBE_S = 10.0
"""Reaching a RAY_ADDRESS the user gave (Ray itself retries a dead address for minutes)."""
ENGINE_FAULT_JOIN_S = 5.0
"""A test fault aimed at an engine finishing after its rollout ended (it has fired, or it no longer will)."""
ENGINE_EXIT_SEEN_S = 5.0
"""A rollout function failed with no engine seen failing: how long the guard looks for an exited one first (a SIGKILLed
engine closes its connections before its exit code can be read; longer on a loaded machine)."""
ENGINE_FAULT_READ_S = 1.0
"""A test fault reading an engine's running requests (it reads every 50 ms until the requests arrive)."""


def engines_startup_s() -> float:
    """The rollout manager waiting for every engine's actor to report it started."""
    return ENGINE_STARTUP_S + 120.0


def engine_restart_call_s() -> float:
    """The rollout manager waiting for one engine's actor to start the engine again (fault tolerance)."""
    return ENGINE_STARTUP_S + 60.0


def rollout_manager_startup_s() -> float:
    """The driver waiting for the rollout manager to come up with its engines and router."""
    return ENGINE_STARTUP_S + 180.0


def hold_generation_s() -> float:
    """The driver waiting for a background generator's requests to pause before a weight push."""
    return ENGINE_CONTROL_CALL_S + 60.0


def engines_for_sync_s() -> float:
    """The driver asking which engines a weight sync must reach (engine restarts in flight finish first)."""
    return ENGINE_STARTUP_S + ENGINE_CONTROL_CALL_S
