"""The process-group options of the run config (``GroupSettings``): what the trainer ranks' groups are made of
and how they live, derived from the flags once by ``build_run_config`` (run_config.py) and taken as they are by
slime/distributed/groups.py, which creates the groups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.config.layout import ParallelLayout
from slime.utils.deadlines import DeadlineModel


@dataclass(frozen=True, kw_only=True)
class GroupSettings:
    """The parallel layout of the groups and the lifecycle options."""

    parallel: ParallelLayout
    """Sizes of the TP/PP/CP/EP/ETP groups (slime/config/layout.py), over the role's world."""
    fence_timeout_s: float
    """No-progress window of each fence, and deadline of each warm-up op."""
    group_timeout_s: float
    """Timeout megatron's groups and the fence group are created with (--distributed-timeout-minutes,
    derived above every rank window when unset: slime/utils/deadlines.py), so the watchdog, which
    names phase and ranks, fires first."""
    recreate_process_groups_on_wake: bool = False
    """Destroy model-parallel groups at sleep and re-create them at wake (upstream colocate behaviour)."""
    single_rank_group_max_ctas: int = 1
    """NCCL channels of a communicator whose group holds one rank (0: NCCL's default); see
    slime/distributed/communicator_config.py."""


def build_group_settings(args: Any, layout: ParallelLayout, deadlines: DeadlineModel) -> GroupSettings:
    """The group options of checked flags, over the role's layout, with the run's deadline model."""
    return GroupSettings(parallel=layout, fence_timeout_s=deadlines.no_progress_s,
                         group_timeout_s=deadlines.group_timeout,
                         recreate_process_groups_on_wake=bool(args.recreate_process_groups_on_wake),
                         single_rank_group_max_ctas=int(args.single_rank_group_max_ctas))
