"""Every flag of ``train.py``, declared by group (help text is ours; names, dests and defaults follow upstream
slime / Megatron-LM). ``ARGUMENT_GROUPS`` is the order of the groups in ``--help``."""

from __future__ import annotations

import argparse
from typing import Callable

from slime.config.flags.algorithm import add_algorithm_arguments, add_opd_arguments, add_reward_arguments
from slime.config.flags.checkpoint import add_checkpoint_arguments
from slime.config.flags.cluster import add_cluster_arguments
from slime.config.flags.data import add_data_arguments, add_eval_arguments
from slime.config.flags.fencing import add_fencing_arguments, add_security_arguments
from slime.config.flags.model import (
    add_megatron_model_arguments,
    add_model_family_arguments,
    add_moe_arguments,
    add_upstream_megatron_arguments,
)
from slime.config.flags.observability import add_debug_arguments, add_tracking_arguments
from slime.config.flags.parallel import add_megatron_parallel_arguments
from slime.config.flags.rollout import (
    add_rollout_arguments,
    add_rollout_buffer_arguments,
    add_rollout_fault_arguments,
    add_router_arguments,
    add_sglang_arguments,
)
from slime.config.flags.training import add_custom_megatron_arguments, add_megatron_training_arguments
from slime.config.flags.upstream_compat import add_upstream_compat_arguments

ARGUMENT_GROUPS: tuple[Callable[[argparse.ArgumentParser], None], ...] = (
    add_cluster_arguments,
    add_rollout_arguments,
    add_data_arguments,
    add_eval_arguments,
    add_algorithm_arguments,
    add_opd_arguments,
    add_reward_arguments,
    add_rollout_buffer_arguments,
    add_megatron_model_arguments,
    add_moe_arguments,
    add_model_family_arguments,
    add_upstream_megatron_arguments,
    add_megatron_parallel_arguments,
    add_megatron_training_arguments,
    add_checkpoint_arguments,
    add_sglang_arguments,
    add_router_arguments,
    add_rollout_fault_arguments,
    add_tracking_arguments,
    add_debug_arguments,
    add_custom_megatron_arguments,
    add_fencing_arguments,
    add_security_arguments,
    add_upstream_compat_arguments,
)
