"""Process-group lifecycle across colocate sleep/wake: create once, fence, warm up, (optionally) re-create.

Default (keep_communicators): sleep releases memory only and keeps every communicator alive, which
removes both the lazy-re-creation race of issue #1487 and its ~1.5 s per-cycle cost.
`--recreate-process-groups-on-wake` restores upstream's behaviour (destroy at sleep, re-create at wake)
but re-creates in one fixed order, then fences, warms every communicator eagerly with deadlines, and
fences again. The world group and the gloo fence group are never destroyed.

Caveat of re-creation: objects built before a sleep (megatron DDP buckets, the optimizer) hold the old
group objects; `wake()` returns old->new pairs by name so the owner can re-point them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state as mpu

from slime.config.layout import ParallelLayout
from slime.config.process_groups import GroupSettings
from slime.config.run_config import check_world
from slime.distributed.communicator_config import megatron_config_file, single_rank_group_kinds
from slime.distributed.fence import Fence
from slime.distributed.group_names import forget_group, register_group
from slime.distributed.ledger import FENCE_GROUP_NAME, Ledger
from slime.distributed.warmup import CommunicatorWarmup, WarmupReport, step_groups


def _single_rank_kinds(layout: ParallelLayout) -> tuple[str, ...]:
    """Group kinds to give one channel: NCCL groups of one rank (none on gloo, which has no channels)."""
    if dist.get_backend() != "nccl":
        return ()
    return single_rank_group_kinds(world_size=dist.get_world_size(), tensor=layout.tp, pipeline=layout.pp,
                                   context=layout.cp, expert=layout.ep)


def create_model_parallel_groups(settings: GroupSettings) -> None:
    """megatron's parallel_state groups, in its fixed creation order; the one place that creates them."""
    layout = settings.parallel
    with megatron_config_file(_single_rank_kinds(layout), settings.single_rank_group_max_ctas) as nccl_config:
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            distributed_timeout_minutes=settings.group_timeout_s / 60.0,  # fractions work: tests use seconds
            nccl_communicator_config_path=nccl_config,
        )
    for name, group in step_groups():
        if name != "world":
            register_group(name, group)


@dataclass(frozen=True)
class WakeReport:
    recreated: bool
    create_seconds: float
    warmup: WarmupReport | None
    regrouped: tuple[tuple[str, object, object], ...] = ()  # (name, old group, new group) after re-creation


class ProcessGroupLifecycle:
    """Owns megatron's parallel_state groups plus the persistent gloo fence group of this process."""

    def __init__(self, settings: GroupSettings, *, ledger: Ledger | None = None):
        """`settings`: the run config's (run_config.run_groups), laid out for this world."""
        assert dist.is_initialized(), "torch.distributed must be initialised (with a timeout) first"
        check_world(settings, dist.get_world_size())
        self.settings = settings
        self.ledger = ledger
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._fence: Fence | None = None
        self._asleep = False
        self.metrics: dict[str, float] = {}

    @property
    def fence(self) -> Fence:
        assert self._fence is not None, "call create() first"
        return self._fence

    # -- public phases -----------------------------------------------------------------------
    def create(self, rollout_id: int | None = None, *, timeout_s: float | None = None) -> WarmupReport:
        """First creation: fence group (once, never destroyed), model-parallel groups, fence, warm-up, fence.

        `timeout_s` overrides the fence deadline for this first warm-up only: the first set-up of
        every communicator at job start is slower than a re-warm-up (seen on NCCL: over 15 s).
        """
        if self._fence is None:
            self._fence = self._create_fence_group()
        self._create_model_parallel()
        return self._fenced_warmup("create", rollout_id, timeout_s or self.settings.fence_timeout_s)

    def sleep(self, rollout_id: int | None = None) -> None:
        """Fence, then (re-create mode only) destroy the model-parallel groups. Memory is the owner's
        business (slime/backends/megatron_utils/offload.py): communicators hold no model state."""
        self.fence("sleep", {"rollout_id": rollout_id})
        if self.settings.recreate_process_groups_on_wake:
            self._destroy_model_parallel()
        self._asleep = True

    def wake(self, rollout_id: int | None = None) -> WakeReport:
        """Re-create groups in the original order if they were destroyed, fence, warm up, fence."""
        recreate = self.settings.recreate_process_groups_on_wake and self._asleep
        old = self._destroyed_groups if recreate else []
        start = time.perf_counter()
        if recreate:
            self._create_model_parallel()
        create_seconds = time.perf_counter() - start
        warmup = self._fenced_warmup("wake", rollout_id, self.settings.fence_timeout_s)
        self._asleep = False
        regrouped = _pair_by_name(old, step_groups()) if recreate else ()
        self.metrics = {"perf/wake_create_groups_s": create_seconds, "perf/wake_warmup_s": warmup.seconds}
        return WakeReport(recreate, create_seconds, warmup, regrouped)

    # -- internals ---------------------------------------------------------------------------
    def _create_fence_group(self) -> Fence:
        # gloo's own limit on one wait: above the fence's no-progress window, which may outlast it
        timeout = timedelta(seconds=self.settings.group_timeout_s)
        group = dist.new_group(list(range(self.world_size)), backend="gloo", timeout=timeout)
        register_group(FENCE_GROUP_NAME, group)
        return Fence(group, rank=self.rank, world_size=self.world_size, timeout_s=self.settings.fence_timeout_s, ledger=self.ledger)

    def _create_model_parallel(self) -> None:
        create_model_parallel_groups(self.settings)

    def _fenced_warmup(self, phase: str, rollout_id: int | None, timeout_s: float) -> WarmupReport:
        groups = [n for n, _ in step_groups()]
        self.fence(f"{phase}/groups_created", {"rollout_id": rollout_id, "groups": groups}, timeout_s=timeout_s)
        warmup = CommunicatorWarmup(
            rank=self.rank,
            world_size=self.world_size,
            timeout_s=timeout_s,
            ledger=self.ledger,
            rollout_id=rollout_id,
        ).run()
        self.fence(f"{phase}/warmed_up", {"rollout_id": rollout_id, "warmup_ops": len(warmup.ops)}, timeout_s=timeout_s)
        return warmup

    def _destroy_model_parallel(self) -> None:
        """Destroy every model-parallel group (not the world group, not the fence group), in a fixed order."""
        self._destroyed_groups = step_groups()
        doomed = _all_parallel_state_groups()
        mpu.destroy_model_parallel()  # resets megatron's globals; destroys only its gloo groups itself
        live = dist.distributed_c10d._world.pg_map
        for group in doomed:
            forget_group(group)
            if group in live:
                dist.destroy_process_group(group)


def _all_parallel_state_groups() -> list[object]:
    """Distinct ProcessGroup objects referenced by parallel_state globals, in sorted-name order."""
    seen: dict[int, object] = {}
    for name in sorted(vars(mpu)):
        value = getattr(mpu, name)
        candidates = value if isinstance(value, (list, tuple)) else [value]
        for group in candidates:
            if isinstance(group, dist.ProcessGroup) and group is not dist.GroupMember.WORLD:
                seen.setdefault(id(group), group)
    return list(seen.values())


def _pair_by_name(old: list[tuple[str, object]], new: list[tuple[str, object]]) -> tuple[tuple[str, object, object], ...]:
    new_by_name = dict(new)
    return tuple((name, group, new_by_name[name]) for name, group in old if name in new_by_name)
