"""Ray start-up and placement groups for the trainer ranks and the rollout engines.

On GPU machines each bundle is one GPU (plus a CPU); on machines without GPUs each bundle is
one logical CPU, so `--actor-num-gpus-per-node 8` means 8 CPU ranks. With `--colocate` the
engines share the trainer's bundles, as upstream does with GPUs.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where the trainer ranks and the engines run."""

    group: PlacementGroup
    use_gpu: bool
    actor_bundles: tuple[int, ...]
    rollout_bundles: tuple[int, ...]

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle)


def actor_world_size(args) -> int:
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def engine_bundles(args) -> int:
    """Bundles the engines need of their own (none when they share the trainer's or do not run)."""
    if args.colocate or args.debug_train_only:
        return 0
    return args.rollout_num_gpus or 0


def use_gpus(args) -> bool:
    import torch

    return getattr(args, "train_backend_device", "auto") != "cpu" and torch.cuda.is_available()


def init_ray(args) -> None:
    """Start (or join) Ray. Without GPUs, logical CPUs are raised to fit one bundle per rank."""
    if ray.is_initialized():
        return
    if "RAY_ADDRESS" in os.environ:
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    needed = actor_world_size(args) + engine_bundles(args) + 2
    num_cpus = max(os.cpu_count() or 1, needed)
    # address="local": a fresh cluster of our own, never the "current" cluster of another run on this host.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": _forwarded_env()})


def _forwarded_env() -> dict[str, str]:
    """Env vars the ranks must see (fault injection, offline hub, thread counts)."""
    keys = ("SLIME_FAULT_INJECT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "OMP_NUM_THREADS",
            "TORCH_DISTRIBUTED_DEBUG", "NCCL_DEBUG", "PYTHONPATH")
    env = {k: os.environ[k] for k in keys if k in os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def create_placement(args, timeout_s: float = 300.0) -> Placement:
    """One placement group: trainer bundles first, then engine bundles unless colocated."""
    gpu = use_gpus(args)
    world = actor_world_size(args)
    rollout = engine_bundles(args)
    bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in range(world + rollout)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        raise TimeoutError(
            f"Ray could not place {world + rollout} bundles of {bundle} within {timeout_s:.0f}s; "
            f"cluster resources: {ray.cluster_resources()}")
    actor = tuple(range(world))
    engines = actor if args.colocate else tuple(range(world, world + rollout))
    logger.info("placement: %d trainer bundles, %d engine bundles, gpu=%s", world, len(engines), gpu)
    return Placement(group=group, use_gpu=gpu, actor_bundles=actor, rollout_bundles=engines)
