"""Process-group lifecycle, fences, plan fingerprints, ledger, watchdog and fault injection.

The rest of the code asks this package for groups and fences; it never calls new_group or bare barriers.
"""
from slime.distributed.errors import (
    CollectiveDivergenceError,
    DistributedStepError,
    FenceTimeoutError,
    HangError,
    WarmupTimeoutError,
)
from slime.distributed.fault_inject import FAULT_KINDS, FaultSpec, fault_active, parse_fault_specs
from slime.distributed.fence import Fence
from slime.distributed.fingerprint import PlanFingerprint, plan_fingerprint, stable_hash
from slime.distributed.groups import ParallelLayout, ProcessGroupLifecycle, WakeReport
from slime.distributed.hang_report import lagging_ranks, render_hang_report
from slime.distributed.instrument import instrument_collectives, uninstrument_collectives
from slime.distributed.ledger import Ledger
from slime.distributed.warmup import CommunicatorWarmup, WarmupReport
from slime.distributed.watchdog import HANG_EXIT_CODE, Watchdog

__all__ = [
    "CollectiveDivergenceError",
    "CommunicatorWarmup",
    "DistributedStepError",
    "FAULT_KINDS",
    "FaultSpec",
    "Fence",
    "FenceTimeoutError",
    "HANG_EXIT_CODE",
    "HangError",
    "Ledger",
    "ParallelLayout",
    "PlanFingerprint",
    "ProcessGroupLifecycle",
    "WakeReport",
    "WarmupReport",
    "WarmupTimeoutError",
    "Watchdog",
    "fault_active",
    "instrument_collectives",
    "lagging_ranks",
    "parse_fault_specs",
    "plan_fingerprint",
    "render_hang_report",
    "stable_hash",
    "uninstrument_collectives",
]
