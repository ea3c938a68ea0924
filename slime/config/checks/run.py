"""Checks and derived values of the run as a whole: positive sizes, process-group deadlines, modes
(debug, colocate, offload), the ledger and tracking.
"""

from __future__ import annotations

import argparse
import uuid

from slime.algorithms import estimator
from slime.config.constants import DEFAULT_ROLLOUT_FUNCTION_PATH
from slime.config.defaults import complete_unset
from slime.config.errors import derive, fail, flag_name
from slime.utils.deadlines import DeadlineModel, default_group_timeout_minutes


def check_positive(args: argparse.Namespace) -> None:
    for dest in ("rollout_batch_size", "n_samples_per_prompt", "actor_num_nodes", "actor_num_gpus_per_node",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "rollout_num_gpus_per_engine", "micro_batch_size", "log_interval"):
        if getattr(args, dest) <= 0:
            fail(f"{flag_name(dest)} must be positive, got {getattr(args, dest)}")
    if args.fence_timeout <= 0:
        fail(f"--fence-timeout must be positive seconds, got {args.fence_timeout}")
    if args.rollout_temperature <= 0:
        fail("--rollout-temperature must be > 0 (0 is greedy decoding, not a valid RL policy)")
    if args.max_tokens_per_gpu is not None and args.max_tokens_per_gpu <= 0:
        fail(f"--max-tokens-per-gpu must be positive, got {args.max_tokens_per_gpu}")


def check_deadlines(args: argparse.Namespace) -> None:
    """Process-group timeouts strictly above every watchdog window (slime/utils/deadlines.py)."""
    if args.distributed_timeout_minutes is not None and args.distributed_timeout_minutes <= 0:
        fail(f"--distributed-timeout-minutes must be positive, got {args.distributed_timeout_minutes}")
    deadlines = DeadlineModel.from_args(args)  # run_config, built last, derives the run's model by the same rule
    problem = deadlines.group_timeout_error()
    if problem:
        fail(problem)
    if args.distributed_timeout_minutes is None:
        args.distributed_timeout_minutes = default_group_timeout_minutes(deadlines.no_progress_s)


def check_healing(args: argparse.Namespace) -> None:
    """--max-restarts goes back to a checkpoint of the run's own: without saves there is none."""
    if args.max_restarts < 0:
        fail(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.restart_window_rollouts is not None and args.restart_window_rollouts < 0:
        fail(f"--restart-window-rollouts must be >= 0, got {args.restart_window_rollouts}")
    if args.max_restarts and not (args.save and args.save_interval):
        fail(f"--max-restarts {args.max_restarts} restarts from the run's last checkpoint: add --save DIR and "
             "--save-interval N (or drop --max-restarts)")
    if args.max_restarts and args.no_save_optim:
        fail(f"--max-restarts {args.max_restarts} with --no-save-optim: a restart would go back to a checkpoint "
             "without the optimizer state and go on with a fresh optimizer, not as the run would have; drop "
             "--no-save-optim (or --max-restarts)")


def check_weight_sync_proof(args: argparse.Namespace) -> None:
    if args.check_weight_update_equal and not args.weight_sync_proof:
        fail("--check-weight-update-equal asks for the weight-sync proof that --no-weight-sync-proof turns off; "
             "drop one of them")


def resolve_modes(args: argparse.Namespace) -> None:
    if args.debug_train_only and args.debug_rollout_only:
        fail("--debug-train-only and --debug-rollout-only cannot both be set")
    if args.load_debug_rollout_data is not None:
        args.debug_train_only = True
    if args.debug_train_only and args.load_debug_rollout_data is None \
            and args.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION_PATH:
        fail("--debug-train-only starts no engines, so rollouts must come from --load-debug-rollout-data PATH "
             "(or a custom --rollout-function-path that needs no engines)")
    if args.offload:
        args.offload_train = args.offload_rollout = True
    if args.colocate:
        if args.rollout_num_gpus is None:
            args.rollout_num_gpus = args.actor_num_gpus_per_node * args.actor_num_nodes
        args.offload_train = True if args.offload_train is None else args.offload_train
        args.offload_rollout = True if args.offload_rollout is None else args.offload_rollout
    if args.debug_rollout_only:  # no trainer to hand memory to (upstream turns colocation off)
        args.offload_train = args.offload_rollout = False
    args.offload_train = bool(args.offload_train)
    args.offload_rollout = bool(args.offload_rollout)
    if args.rollout_num_gpus is not None and args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
        fail(f"--rollout-num-gpus {args.rollout_num_gpus} is not divisible by --rollout-num-gpus-per-engine "
             f"{args.rollout_num_gpus_per_engine}")
    if args.colocate and args.actor_num_nodes > 1 and not args.debug_rollout_only:
        check_colocate_across_nodes(args)
    args.skip_engines = args.debug_train_only
    args.use_critic = estimator(args.advantage_estimator).needs_critic
    args.critic_overrides = {}  # the critic's own flags: checks/roles.py fills them for a critic it checks
    args.run_id = uuid.uuid4().hex[:16]  # in every checkpoint's manifest: a restart goes back only to this run's
    if args.finetune and args.load is None:
        fail("--finetune loads the weights of --load DIR; pass --load")
    if args.dump_details is not None:  # upstream: both debug dumps under one directory
        derive(args, "save_debug_rollout_data", f"{args.dump_details}/rollout_data/{{rollout_id}}.pt",
               f"--dump-details {args.dump_details}")
        derive(args, "save_debug_train_data", f"{args.dump_details}/train_data/{{rollout_id}}.pt",
               f"--dump-details {args.dump_details}")


def check_colocate_across_nodes(args: argparse.Namespace) -> None:
    """Colocated engines take their weights from trainer ranks of their own node (CUDA IPC or shared
    memory), so every engine lies within one node and every TP group too (a node's TP group exports the PP
    stage it holds; a stage a node does not hold reaches its engines over a weight-update group:
    backends/weight_sync/node_routes.py)."""
    per_node, per_engine = args.actor_num_gpus_per_node, args.rollout_num_gpus_per_engine
    where = f"--colocate over --actor-num-nodes {args.actor_num_nodes} x --actor-num-gpus-per-node {per_node}"
    if per_engine > per_node and per_engine % per_node == 0:
        fail(f"{where}: an engine of --rollout-num-gpus-per-engine {per_engine} GPUs spans {per_engine // per_node} "
             "nodes. Colocated engines take their weights by CUDA IPC from trainer ranks of their own node; an engine "
             "over several nodes would need each node's part fed by that node's ranks and the parts gathered into one "
             "request to its node rank 0, which the colocated weight push does not do. Drop --colocate and give the "
             "engines GPUs of their own (--rollout-num-gpus), where an engine spans nodes with SGLang's multi-node "
             f"launch and takes its weights over NCCL (docs/cluster.md), or use a divisor of {per_node}")
    if per_node % per_engine:
        fail(f"{where}: an engine of --rollout-num-gpus-per-engine {per_engine} GPUs does not fit within one "
             f"node's {per_node} (colocated engines are fed by their own node's trainer ranks); use a divisor of "
             f"{per_node}")
    total = per_node * args.actor_num_nodes
    if args.rollout_num_gpus != total:
        fail(f"{where}: --rollout-num-gpus {args.rollout_num_gpus} must be the trainer's {total} GPUs (every "
             "node's engines are fed by that node's ranks); leave it unset")
    tp = args.tensor_model_parallel_size
    if per_node % tp:
        fail(f"{where}: --tensor-model-parallel-size {tp} must divide the node's {per_node} GPUs, so that every "
             "TP group (the ranks that export a PP stage together) lies within one node; drop --colocate to "
             "push to separate engines")


def check_ledger(args: argparse.Namespace) -> None:
    if args.ledger_record_sequence and not args.ledger_dir:
        fail("--ledger-record-sequence needs --ledger-dir DIR (where the sequence files are kept)")


def resolve_tracking(args: argparse.Namespace) -> None:
    complete_unset(args)  # the TensorBoard directory (slime/config/defaults.py)
