"""Rank bodies that run the product's own fenced step: slime's MegatronTrainActor on forked gloo ranks.

    outcomes = run_ranks_outcomes(step_ranks.train_rollouts, 4, args=(args, str(ledger_dir), data, 2))

Each rank builds the real actor (groups made and warmed under the watchdog, the megatron model
loaded from an HF checkpoint), then trains `rollouts` rollouts on the same rollout batch, sleeping
between them as a colocated run does, so a fault aimed at rollout 1 meets a woken step. What a rank
saw comes back as plain values: the named error, or the rollouts' metrics.
"""
from __future__ import annotations

import copy
import os
import traceback

from slime.distributed.errors import DistributedStepError


def step_args(hf_dir: str, *, world: int, extra: list[str] = (), fence_timeout: float = 120):
    """train.py's parser on a layout of `world` CPU ranks with no engines (the step alone)."""
    from slime.utils.arguments import parse_args

    return parse_args([
        "--hf-checkpoint", hf_dir, "--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(world),
        "--rollout-num-gpus-per-engine", "1", "--debug-train-only", "--num-rollout", "2",
        "--load-debug-rollout-data", os.path.join(hf_dir, "unused_{rollout_id}.pt"),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "48", "--calculate-per-token-loss",
        "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.01", "--entropy-coef", "0.001",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--lr", "1e-4", "--seed", "1234",
        "--fence-timeout", str(fence_timeout), *extra,
    ])


def train_rollouts(rank: int, world: int, args, ledger_dir: str, data: dict, rollouts: int) -> list[dict]:
    """init, then train -> sleep per rollout; each rollout's outcome: {"error": None, "metrics": ...} or the named
    error. Ranks that agree they differ (a fence's divergence error) go on together to the next rollout; a stall
    ends the rank's run."""
    from slime.backends.megatron_utils.actor import MegatronTrainActor
    from slime.distributed.errors import CollectiveDivergenceError

    outcomes = []
    actor = MegatronTrainActor(args, rank, world, ledger_dir)
    try:
        actor.init(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), engine_urls=[])
        for rollout_id in range(rollouts):
            try:
                metrics = actor.train(rollout_id, copy.deepcopy(data))
                actor.sleep()
                outcomes.append({"error": None, "metrics": metrics})
            except CollectiveDivergenceError as exc:
                outcomes.append(named_error(exc))
    except DistributedStepError as exc:  # a stall: named in the rollout it stopped
        outcomes.append(named_error(exc))
    actor.ledger.close()
    return outcomes


def named_error(exc: DistributedStepError) -> dict:
    return {"error": type(exc).__name__, "message": str(exc), "mro": [c.__name__ for c in type(exc).__mro__],
            "phase": getattr(exc, "phase", None),
            "ranks": list(getattr(exc, "ranks", None) or getattr(exc, "lagging_ranks", ()) or ()),
            "fields": list(getattr(exc, "fields", ()) or ()), "trace": traceback.format_exc()[-2000:]}
