"""Rank bodies for the slime.distributed multi-process tests (importable by spawned children).

The pseudo-step mirrors the fenced actor_train phases with a few real collectives on the TP, CP
and DP x CP groups of an 8-rank TP2 x CP4 layout, so ordering and fault handling are exercised
without a model.
"""
from __future__ import annotations

import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from slime.distributed import (
    DistributedStepError,
    Ledger,
    ProcessGroupLifecycle,
    Watchdog,
    instrument_collectives,
    plan_fingerprint,
)
from slime.distributed.fault_inject import should_skip_collective
from slime.config import defaults_namespace
from slime.config.run_config import run_groups


def make_args(*, fence_timeout: float, recreate: bool = False, group_timeout_min: float = 1.0,
              expert_parallel: int = 1) -> SimpleNamespace:
    """TP2 x CP4, or with expert_parallel > 1 TP2 x EP (CP1, expert-TP 1): the MoE layout."""
    return defaults_namespace(
        tensor_model_parallel_size=2,
        context_parallel_size=4 if expert_parallel == 1 else 1,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=1 if expert_parallel > 1 else None,
        pipeline_model_parallel_size=1,
        fence_timeout=fence_timeout,
        distributed_timeout_minutes=group_timeout_min,
        recreate_process_groups_on_wake=recreate,
    )


def setup(rank: int, world: int, ledger_dir: str, args, *, deadline_s: float, grace_s: float = 1.0):
    ledger = Ledger(rank, world, ledger_dir)
    instrument_collectives(ledger)
    lifecycle = ProcessGroupLifecycle(run_groups(args, world), ledger=ledger)
    watchdog = Watchdog(deadline_s, ledger_dir, rank, world, ledger=ledger, grace_s=grace_s)
    with watchdog.phase("create", deadline_s=max(deadline_s, 120.0)):  # 8 ranks creating groups on 2 busy cores
        lifecycle.create(rollout_id=0)
    return ledger, lifecycle, watchdog


def pseudo_step(rank: int, lifecycle: ProcessGroupLifecycle, watchdog: Watchdog, rollout_id: int) -> float:
    """plan fence -> forward/backward collectives -> metrics fence + reduce. The hang classes themselves are
    injected into the product's own step (tests/test_step_faults.py); this stand-in keeps the EP token
    all-to-all, which a real skip on gloo turns into a crash rather than a hang."""
    ledger = lifecycle.ledger
    with ledger.phase("actor_train"):
        with watchdog.phase("plan"):
            fp = plan_fingerprint(("plan", rollout_id), rollout_id=rollout_id, step_id=0,
                                  micro_batch_tokens=[64, 48], loss_token_total=100, metric_keys=["loss"])
            lifecycle.fence("plan", fp.as_fields())
        with watchdog.phase("forward_backward"):
            x = torch.full((4,), float(rank))
            dist.all_reduce(x, group=mpu.get_tensor_model_parallel_group())
            if mpu.get_expert_model_parallel_world_size() > 1:
                _token_all_to_all(rank, should_skip_collective(rank, rollout_id))
            else:
                dist.all_reduce(x, group=mpu.get_context_parallel_group())
            dist.all_reduce(x, group=mpu.get_data_parallel_group(with_context_parallel=True))
        with watchdog.phase("metrics"):
            keys = ["loss", "grad_norm"]
            lifecycle.fence("metrics", {"metric_keys": keys})
            metrics = torch.ones(len(keys))
            dist.all_reduce(metrics, group=mpu.get_data_parallel_group(with_context_parallel=True))
    return float(x.sum())


def _token_all_to_all(rank: int, skip: bool) -> None:
    """An MoE dispatch: every EP rank sends a different number of token rows to each peer."""
    group = mpu.get_expert_model_parallel_group()
    members, me = dist.get_world_size(group), mpu.get_expert_model_parallel_rank()
    sent = [1 + (me + peer) % 3 for peer in range(members)]
    received = [1 + (peer + me) % 3 for peer in range(members)]
    if not skip:
        out = torch.empty(sum(received), 8)
        dist.all_to_all_single(out, torch.ones(sum(sent), 8), received, sent, group=group)


def clean_steps(rank: int, world: int, ledger_dir: str, steps: int) -> dict:
    ledger, lifecycle, watchdog = setup(rank, world, ledger_dir, make_args(fence_timeout=30), deadline_s=60)
    signatures, totals = [], []
    for rollout_id in range(steps):
        mark = ledger.mark()
        totals.append(pseudo_step(rank, lifecycle, watchdog, rollout_id))
        signatures.append(ledger.signature(since=mark))
    ledger.close()
    return {"signatures": signatures, "totals": totals, "fence_seq": lifecycle.fence.seq}


def fault_run(rank: int, world: int, ledger_dir: str, fence_timeout: float, deadline_s: float,
              expert_parallel: int = 1) -> dict:
    """Clean rollout 0, then sleep/wake and rollout 1 (faults target rollout 1). Returns the error seen."""
    try:
        args = make_args(fence_timeout=fence_timeout, expert_parallel=expert_parallel)
        _, lifecycle, watchdog = setup(rank, world, ledger_dir, args, deadline_s=deadline_s)
        pseudo_step(rank, lifecycle, watchdog, 0)
        lifecycle.sleep(0)
        with watchdog.phase("wake"):
            lifecycle.wake(1)
        pseudo_step(rank, lifecycle, watchdog, 1)
        return {"error": None}
    except DistributedStepError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "mro": [c.__name__ for c in type(exc).__mro__],
                "trace": traceback.format_exc()[-2000:]}


def sleep_wake_cycles(rank: int, world: int, ledger_dir: str, cycles: int, recreate: bool) -> dict:
    ledger, lifecycle, watchdog = setup(rank, world, ledger_dir, make_args(fence_timeout=30, recreate=recreate), deadline_s=60)
    warmups, created = [], []
    for cycle in range(cycles):
        lifecycle.sleep(cycle)
        with watchdog.phase("wake"):
            report = lifecycle.wake(cycle + 1)
        warmups.append(report.warmup.seconds)
        created.append(report.recreated)
        x = torch.ones(2)
        dist.all_reduce(x, group=mpu.get_data_parallel_group(with_context_parallel=True))
        assert x.tolist() == [4.0, 4.0], x
    ledger.close()
    return {"warmups": warmups, "recreated": created, "live_groups": len(dist.distributed_c10d._world.pg_map)}


def clean_then_keep_cycles(rank: int, world: int, ledger_dir: str, steps: int, cycles: int) -> dict:
    """Clean fenced steps (signatures per step), then keep-communicator sleep/wake cycles."""
    ledger, lifecycle, watchdog = setup(rank, world, ledger_dir, make_args(fence_timeout=30), deadline_s=60)
    create_signature = ledger.signature()
    signatures, totals = [], []
    for rollout_id in range(steps):
        mark = ledger.mark()
        totals.append(pseudo_step(rank, lifecycle, watchdog, rollout_id))
        signatures.append(ledger.signature(since=mark))
    groups_before = len(dist.distributed_c10d._world.pg_map)
    tp_before = mpu.get_tensor_model_parallel_group()
    for cycle in range(cycles):
        lifecycle.sleep(cycle)
        with watchdog.phase("wake"):
            report = lifecycle.wake(cycle + 1)
        assert not report.recreated
    ledger.close()
    return {
        "create_signature": create_signature,
        "signatures": signatures,
        "totals": totals,
        "fence_seq": lifecycle.fence.seq,
        "same_groups": groups_before == len(dist.distributed_c10d._world.pg_map)
        and tp_before is mpu.get_tensor_model_parallel_group(),
    }


def recreate_cycles(rank: int, world: int, ledger_dir: str, cycles: int) -> dict:
    """Destroy + re-create + warm-up cycles; a DP x CP all_reduce after each wake checks the new groups."""
    ledger, lifecycle, watchdog = setup(rank, world, ledger_dir, make_args(fence_timeout=30, recreate=True), deadline_s=60)
    live_after_create = len(dist.distributed_c10d._world.pg_map)
    warmups, recreated, regrouped = [], [], []
    for cycle in range(cycles):
        tp_before = mpu.get_tensor_model_parallel_group()
        lifecycle.sleep(cycle)
        assert not mpu.model_parallel_is_initialized()
        with watchdog.phase("wake"):
            report = lifecycle.wake(cycle + 1)
        warmups.append(report.warmup.seconds)
        recreated.append(report.recreated and mpu.get_tensor_model_parallel_group() is not tp_before)
        regrouped.append(sorted(name for name, _, _ in report.regrouped))
        x = torch.ones(2)
        dist.all_reduce(x, group=mpu.get_data_parallel_group(with_context_parallel=True))
        assert x.tolist() == [4.0, 4.0], x
    ledger.close()
    return {
        "warmups": warmups,
        "recreated": recreated,
        "regrouped": regrouped,
        "groups_stable": live_after_create == len(dist.distributed_c10d._world.pg_map),  # nothing leaks
        "fence_seq": lifecycle.fence.seq,
    }
