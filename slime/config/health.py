"""The failure-handling options of the run config: how the rollout manager watches its engines (``HealthConfig``,
slime/ray/engines/health.py) and how many named failures the driver heals by a restart (``HealingPolicy``,
slime/ray/driver/healing.py), derived from the flags once by ``build_run_config`` (run_config.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.utils.deadlines import DEFAULT_HEALTH_CHECK_TIMEOUT_S, DeadlineModel


@dataclass(frozen=True, kw_only=True)
class HealthConfig:
    """How the engines are watched while a rollout generates."""

    fault_tolerant: bool = False
    """--use-fault-tolerance: probe engines and restart failed ones."""
    interval_s: float = 10.0
    """--rollout-health-check-interval: seconds between two looks at every engine."""
    timeout_s: float = DEFAULT_HEALTH_CHECK_TIMEOUT_S
    """--rollout-health-check-timeout: /health_generate must answer within this."""
    first_wait_s: float = 300.0
    """--rollout-health-check-first-wait: delay before the first probe (model compilation)."""
    progress: DeadlineModel = DeadlineModel()
    """The engines' no-progress window (--rollout-no-progress-timeout), its looks and their reads."""


@dataclass(frozen=True)
class HealingPolicy:
    """How the driver answers a named failure (--max-restarts)."""

    max_restarts: int = 0
    """Restarts allowed in one run; 0: a named failure ends the run."""
    window_rollouts: int | None = None
    """How many rollouts of work a restart may lose (None: back to any checkpoint of the run)."""


def build_health_config(args: Any, deadlines: DeadlineModel) -> HealthConfig:
    """The engines' health options of checked flags, with the run's deadline model."""
    return HealthConfig(fault_tolerant=bool(args.use_fault_tolerance),
                        interval_s=float(args.rollout_health_check_interval),
                        timeout_s=float(args.rollout_health_check_timeout),
                        first_wait_s=float(args.rollout_health_check_first_wait),
                        progress=deadlines)


def build_healing_policy(args: Any) -> HealingPolicy:
    return HealingPolicy(max_restarts=args.max_restarts, window_rollouts=args.restart_window_rollouts)
