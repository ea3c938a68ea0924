"""How long a rollout (or an eval) may take, and the clock every request of it reads.

`--rollout-timeout SECONDS` bounds one whole rollout in the rollout manager: every sampling round,
every /generate request, reward calls included. Left unset, it scales with the work:

    rollout timeout = 300 s + 0.1 s x max_new_tokens x waves
    waves           = ceil(samples / (engines x --sglang-server-concurrency))
    samples         = max(--rollout-batch-size, --over-sampling-batch-size) x --n-samples-per-prompt
    max_new_tokens  = --rollout-max-response-len (else --rollout-max-context-len, else 4096)

An eval uses the same rule with every eval prompt x --n-samples-per-eval-prompt and
--eval-max-response-len. 0.1 s per token is several times a loaded GPU engine's decode step; the
300 s cover start-up, queueing and rewards. A rollout that needs several sampling rounds (dynamic
sampling) can take longer: set --rollout-timeout for it.

Derived from the same rule: each request's own timeout never outlives the rollout's deadline (plus
REQUEST_GRACE_S, so that the manager reports the requests still outstanding before they end), and
the driver waits on the manager for the deadline plus `driver_margin_s` (the time the manager needs
to probe the engines and raise a report), so that the error naming engines and requests fires first.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

BASE_S = 300.0
SECONDS_PER_TOKEN = 0.1
DEFAULT_MAX_NEW_TOKENS = 4096
DEFAULT_CONCURRENCY = 512  # upstream's --sglang-server-concurrency
REQUEST_GRACE_S = 15.0
DRIVER_EXTRA_S = 60.0


def rollout_timeout_s(*, samples: int, max_new_tokens: int, engines: int, concurrency: int) -> float:
    """The default rollout deadline for this much work (the formula of the module docstring)."""
    waves = math.ceil(max(1, samples) / (max(1, engines) * max(1, concurrency)))
    return BASE_S + SECONDS_PER_TOKEN * max(1, max_new_tokens) * waves


def _max_new_tokens(args, evaluation: bool) -> int:
    value = getattr(args, "eval_max_response_len", None) if evaluation else None
    for candidate in (value, getattr(args, "rollout_max_response_len", None),
                      getattr(args, "rollout_max_context_len", None)):
        if candidate:
            return int(candidate)
    return DEFAULT_MAX_NEW_TOKENS


def num_engines(args) -> int:
    if getattr(args, "debug_train_only", False):
        return 0
    gpus = getattr(args, "rollout_num_gpus", None) or 1
    return max(1, gpus // (getattr(args, "rollout_num_gpus_per_engine", None) or 1))


def train_samples(args) -> int:
    prompts = max(args.rollout_batch_size, getattr(args, "over_sampling_batch_size", None) or 0)
    return prompts * args.n_samples_per_prompt


def rollout_deadline_s(args, *, evaluation: bool = False, eval_prompts: int = 0) -> float:
    """--rollout-timeout, or the default rule for a training rollout (or an eval of `eval_prompts` prompts)."""
    if getattr(args, "rollout_timeout", None):
        return float(args.rollout_timeout)
    samples = (eval_prompts * (getattr(args, "n_samples_per_eval_prompt", None) or 1) if evaluation
               else train_samples(args))
    return rollout_timeout_s(samples=samples, max_new_tokens=_max_new_tokens(args, evaluation),
                             engines=num_engines(args),
                             concurrency=getattr(args, "sglang_server_concurrency", None) or DEFAULT_CONCURRENCY)


def driver_margin_s(args) -> float:
    """What the driver adds to the manager's deadline: the manager's report (engine probes) comes first."""
    return DRIVER_EXTRA_S + 2 * float(getattr(args, "rollout_health_check_timeout", None) or 5.0)


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


def step_window_s(args) -> float:
    """The window of each rollout-manager step outside generation (user hooks, the data save, metrics):
    the loop's no-progress window, --fence-timeout (slime/utils/deadlines.py)."""
    from slime.utils.deadlines import DeadlineModel

    return DeadlineModel.from_args(args).no_progress_s
