"""Process-group lifecycle, fences, plan fingerprints, ledger, watchdog and fault injection.

The rest of the code asks this package for groups and fences and never calls new_group or a bare barrier
(the checkpoint save waits for rank 0's directory work at the trainer's fences, `save/<step>`).
Names are imported from their modules on first use, so that a module used alone (the hang_report
command, the driver reading ledger files) does not import megatron.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "CollectiveDivergenceError": "errors",
    "DistributedStepError": "errors",
    "FenceTimeoutError": "errors",
    "HangError": "errors",
    "HubUnreachableError": "errors",
    "WarmupTimeoutError": "errors",
    "FAULT_KINDS": "fault_inject",
    "FaultSpec": "fault_inject",
    "fault_active": "fault_inject",
    "parse_fault_specs": "fault_inject",
    "Fence": "fence",
    "PlanFingerprint": "fingerprint",
    "plan_fingerprint": "fingerprint",
    "stable_hash": "fingerprint",
    "ParallelLayout": "groups",
    "ProcessGroupLifecycle": "groups",
    "WakeReport": "groups",
    "lagging_ranks": "hang_report",
    "render_hang_report": "hang_report",
    "instrument_collectives": "instrument",
    "uninstrument_collectives": "instrument",
    "Ledger": "ledger",
    "CommunicatorWarmup": "warmup",
    "WarmupReport": "warmup",
    "HANG_EXIT_CODE": "watchdog",
    "Watchdog": "watchdog",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
