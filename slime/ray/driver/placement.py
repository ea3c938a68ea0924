"""Ray start-up and placement: which bundle, node and GPU every trainer rank and engine gets.

One placement group holds every bundle of the job (one GPU and one CPU each on GPU machines, one
logical CPU elsewhere). Ray may spread it over several nodes; each bundle is then probed for its
node and GPU (a task on it; CPU bundles of a one-node cluster are on the driver's node) and the
bundles are ordered by (node address, node, GPU id), as upstream slime does, so that consecutive
trainer ranks share a node and an engine's GPUs are neighbours on one node.

    trainer rank r      -> ordered bundle r
    engine e (G GPUs)   -> ordered bundles offset + e*G .. offset + (e+1)*G - 1
                           offset = 0 with --colocate (engines share the trainer's bundles),
                           else the trainer's bundle count; an engine whose bundles lie on several
                           nodes runs one SGLang process per node (--nnodes, --node-rank), each node
                           holding the same number of its GPUs, node rank 0 on the first node
    critic rank c       -> the actor's rank c's bundle when the critic has the actor's counts
                           (--advantage-estimator ppo), else ordered bundle after + c, after the
                           trainer's and the engines' bundles

GPU ids: actors on GPU bundles run with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, as upstream's
do. Ray then leaves every GPU of the node visible and each process picks its devices by the bundle's
GPU id: a trainer rank sets its device to it, an SGLang engine gets it as --base-gpu-id (its TP ranks
take the engine's next bundles' GPUs). Letting Ray narrow CUDA_VISIBLE_DEVICES per actor would show
a multi-GPU engine only the GPU of the bundle its actor holds, and would hide peer GPUs from NCCL
(no P2P between the trainer and the engines for the distributed weight push).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.patches.ray import keep_cluster_on_loopback
from slime.config.layout import critic_has_own_bundles, critic_world_size
from slime.config.run_config import run_config_of
from slime.config.run_state import advance
from slime.ray.common.engine_slot import EngineSlot
from slime.ray.common.node import LOOPBACK, PlacementError, is_wildcard, node_address
from slime.ray.driver.cluster import cluster_address, require_reachable, worker_env
from slime.utils.deadlines import PLACEMENT_S

logger = logging.getLogger(__name__)

# A trainer rank and an engine share a bundle under --colocate; upstream's shares of it.
TRAINER_SHARE = 0.4
ENGINE_SHARE = 0.2


def init_ray(args) -> None:
    """Join the cluster of `ray start` / `ray job submit`, or start a private one sized for the job.

    No runtime_env is given here: under `ray job submit` the job's own runtime env applies, and the
    env the ranks need travels with each actor instead (`worker_env`).
    """
    if ray.is_initialized():
        return
    address = cluster_address()
    if address is None:
        # Without GPUs every bundle is one logical CPU: raise the count to fit the job.
        needed = total_bundles(args) + 2
        # On loopback: no traffic of a private single-machine cluster goes to the machine's network address.
        keep_cluster_on_loopback()
        start_private_cluster(num_cpus=max(os.cpu_count() or 1, needed))
        return
    require_reachable(address)
    logger.info("joining the Ray cluster at %s", address)
    ray.init(address=address, log_to_driver=True)


# Ray gives a new node's raylet a fixed 30 s to register with the GCS; on a loaded machine (a CI host
# whose cores other jobs share) that start can miss it once and succeed when tried again.
_RAY_START_TIMEOUT = "The current node timed out during startup"
PRIVATE_CLUSTER_STARTS = 2
# Ray starts idle workers for the first driver; no actor of a run takes one (they stay ray::IDLE to its end), so
# they only cost their start (~1 CPU-s each).
PRIVATE_CLUSTER_CONFIG = {"prestart_worker_first_driver": False}


def start_private_cluster(num_cpus: int) -> None:
    """A private single-node cluster on loopback; a start that timed out is tried once more."""
    for attempt in range(1, PRIVATE_CLUSTER_STARTS + 1):
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
                     _node_ip_address=LOOPBACK, _system_config=PRIVATE_CLUSTER_CONFIG)
            return
        except Exception as exc:  # Ray raises a bare Exception for this timeout
            if _RAY_START_TIMEOUT not in str(exc) or attempt == PRIVATE_CLUSTER_STARTS:
                raise
            logger.warning("the private Ray cluster did not start (%s); starting it again", exc)
            ray.shutdown()


# ----------------------------------------------------------------------------- the layout (pure)
@dataclass(frozen=True, kw_only=True)
class BundleInfo:
    """What a probe found on one bundle of the placement group."""

    index: int
    """The bundle's index in the placement group."""
    node_id: str
    node_ip: str
    gpu_id: str | None = None
    """Ray's id of the bundle's GPU (None on CPU bundles)."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    actor_bundles: tuple[BundleInfo, ...]
    """Trainer rank r runs on actor_bundles[r]."""
    engines: tuple[EngineSlot, ...]
    critic_bundles: tuple[BundleInfo, ...] = ()
    """Critic rank c runs on critic_bundles[c]; empty: on the actor's (the critic shares its bundles)."""

    def role_bundles(self, role: str) -> tuple[BundleInfo, ...]:
        return self.critic_bundles if role == "critic" and self.critic_bundles else self.actor_bundles


def _node_order(ip: str) -> tuple:
    try:
        parsed = ipaddress.ip_address(ip.strip("[]"))
        return (0, parsed.version, int(parsed))
    except ValueError:  # a hostname
        return (1, 0, ip)


def _gpu_order(gpu_id: str | None) -> tuple:
    if gpu_id is None:
        return (0, 0, "")
    return (0, int(gpu_id), "") if str(gpu_id).isdigit() else (1, 0, str(gpu_id))


def order_bundles(infos: Sequence[BundleInfo]) -> list[BundleInfo]:
    """Bundles by node (address, then id: several nodes may share an address) and GPU id."""
    return sorted(infos, key=lambda b: (_node_order(b.node_ip), b.node_id, _gpu_order(b.gpu_id), b.index))


def plan_layout(infos: Sequence[BundleInfo], *, trainer_ranks: int, num_engines: int, gpus_per_engine: int,
                colocate: bool, critic_ranks: int = 0) -> Layout:
    """Assign ordered bundles to trainer ranks, engines and a critic on bundles of its own (`critic_ranks`, after
    the others'); an engine over several nodes holds the same number of GPUs on each."""
    ordered = order_bundles(infos)
    offset = 0 if colocate else trainer_ranks
    shared = max(trainer_ranks, offset + num_engines * gpus_per_engine)
    needed = shared + critic_ranks
    if len(ordered) < needed:
        critic = f", {critic_ranks} critic ranks" if critic_ranks else ""
        raise PlacementError(f"{len(ordered)} bundles for {trainer_ranks} trainer ranks{critic} and {num_engines} "
                             f"engines of {gpus_per_engine} (colocate={colocate}): need {needed}")
    engines = [_engine_slot(rank, ordered[offset + rank * gpus_per_engine: offset + (rank + 1) * gpus_per_engine])
               for rank in range(num_engines)]
    return Layout(actor_bundles=tuple(ordered[:trainer_ranks]), engines=tuple(engines),
                  critic_bundles=tuple(ordered[shared:needed]))


def _engine_slot(rank: int, own: Sequence[BundleInfo]) -> EngineSlot:
    """One engine's slot from its ordered bundles: one part per node, in node order."""
    by_node: dict[str, list[BundleInfo]] = {}
    for bundle in own:
        by_node.setdefault(bundle.node_id, []).append(bundle)
    sizes = {node: len(part) for node, part in by_node.items()}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{len(part)} on {part[0].node_ip} ({node[:8]})" for node, part in by_node.items())
        raise PlacementError(
            f"engine {rank} would hold {listed} GPUs (bundles {[b.index for b in own]}): SGLang splits an engine's "
            "tensor-parallel ranks evenly over its nodes, so an engine larger than a node needs the same number of "
            "GPUs on each; make --rollout-num-gpus-per-engine a multiple of the GPUs a node gives engines, and let "
            "the trainer's GPUs fill whole nodes (or colocate)")
    parts = [EngineSlot(rank=rank, bundles=tuple(b.index for b in part), node_id=part[0].node_id,
                        node_ip=part[0].node_ip, gpu_ids=tuple(b.gpu_id for b in part if b.gpu_id is not None),
                        node_rank=node_rank) for node_rank, part in enumerate(by_node.values())]
    return dataclasses.replace(parts[0], followers=tuple(parts[1:]))


def check_disjoint(layout: Layout) -> None:
    """Trainer ranks and engines on bundles of their own (train_async.py: both run at once)."""
    trainer = {b.index for b in layout.actor_bundles}
    shared = {index: engine.rank for engine in layout.engines for part in engine.parts for index in part.bundles
              if index in trainer}
    if shared:
        listed = ", ".join(f"bundle {index} (engine {rank})" for index, rank in sorted(shared.items()))
        raise PlacementError(f"trainer ranks and engines share {listed}: training and generation run at once here, "
                             "so each needs bundles of its own; drop --colocate and give the engines their own GPUs "
                             "with --rollout-num-gpus")


def check_colocated_nodes(layout: Layout, gpus_per_node: int) -> tuple[str, ...]:
    """Colocated across nodes: node n holds trainer ranks n*G .. n*G+G-1 (the ranks that feed its engines) at
    an address of its own (each engine's weights come from the node at its URL's address). Returns the nodes'
    addresses by node index."""
    bundles = layout.actor_bundles
    blocks = [bundles[i:i + gpus_per_node] for i in range(0, len(bundles), gpus_per_node)]
    for n, block in enumerate(blocks):
        if len({b.node_id for b in block}) != 1 or any(b.node_id == blocks[n - 1][0].node_id for b in block if n):
            listed = [f"{r}:{b.node_ip}" for r, b in enumerate(bundles)]
            raise PlacementError(f"--colocate across nodes needs {gpus_per_node} trainer ranks on each node "
                                 f"(--actor-num-gpus-per-node), but Ray placed them as {listed}; give every node "
                                 f"exactly {gpus_per_node} GPUs (or CPUs) for the job")
    addresses = [block[0].node_ip for block in blocks]
    if len(set(addresses)) != len(addresses):
        raise PlacementError(f"--colocate across nodes routes each engine's weights by its node's address, but "
                             f"nodes share addresses {addresses}: set SLIME_HOST_IP on each node before `ray start`")
    return tuple(addresses)


def node_count(layout: Layout, driver_node_id: str) -> int:
    """How many nodes the job's processes (driver, ranks, engines) run on."""
    return len({b.node_id for b in (*layout.actor_bundles, *layout.critic_bundles)}
               | {part.node_id for e in layout.engines for part in e.parts} | {driver_node_id})


def check_engine_bind_host(bind_host: str | None, layout: Layout, driver_node_id: str) -> None:
    """A concrete --engine-bind-host is one node's address: refuse it when the job spans several nodes."""
    if not bind_host or is_wildcard(bind_host):
        return
    if (nodes := node_count(layout, driver_node_id)) > 1:
        raise PlacementError(f"--engine-bind-host {bind_host} is one address, but the job runs on {nodes} nodes: "
                             "leave it unset (each engine listens on its node's address) or use 0.0.0.0")


def trainer_ranks(args) -> int:
    return 0 if args.debug_rollout_only else actor_world_size(args)


def actor_world_size(args) -> int:
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def critic_ranks(args) -> int:
    """The critic's ranks on bundles of their own (0: no critic, or one on the actor's bundles)."""
    if args.debug_rollout_only or not args.use_critic or not critic_has_own_bundles(args):
        return 0
    return critic_world_size(args)


def num_engines(args) -> int:
    if args.debug_train_only:
        return 0
    if not args.rollout_num_gpus:
        raise PlacementError("no GPUs for the engines: set --rollout-num-gpus N, or --colocate to share the "
                             "trainer's (or --debug-train-only to run without engines)")
    return run_config_of(args).roles.engines


def total_bundles(args) -> int:
    engines = num_engines(args) * args.rollout_num_gpus_per_engine
    ranks = trainer_ranks(args)
    return (max(ranks, engines) if args.colocate else ranks + engines) + critic_ranks(args)


# ----------------------------------------------------------------------------- on the cluster
@dataclass(frozen=True)
class Placement:
    """The job's placement group and who runs on which of its bundles."""

    group: PlacementGroup
    use_gpu: bool
    layout: Layout

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle)

    def trainer_options(self, rank: int, role: str = "actor") -> dict[str, Any]:
        """Ray actor options of trainer rank `rank` of `role`: a share of its bundle, the job's env."""
        return self._options(self.layout.role_bundles(role)[rank].index, TRAINER_SHARE)

    def engine_options(self, engine: int, node_rank: int = 0) -> dict[str, Any]:
        """Ray actor options of engine `engine`'s process on its node `node_rank`: a share of that node's first
        bundle."""
        return self._options(self.layout.engines[engine].parts[node_rank].bundles[0], ENGINE_SHARE)

    def _options(self, bundle: int, share: float) -> dict[str, Any]:
        return {"num_cpus": share, "num_gpus": share if self.use_gpu else 0,
                "scheduling_strategy": self.strategy(bundle),
                "runtime_env": {"env_vars": worker_env(self.use_gpu)}}

    def describe(self) -> list[str]:
        lines = [f"trainer rank {r}: bundle {b.index} node {b.node_ip} ({b.node_id[:8]}) gpu {b.gpu_id}"
                 for r, b in enumerate(self.layout.actor_bundles)]
        lines += [f"engine {e.rank}{f' node rank {e.node_rank}' if p.nnodes > 1 else ''}: bundles {list(e.bundles)} "
                  f"node {e.node_ip} ({e.node_id[:8]}) gpus {list(e.gpu_ids)}"
                  for p in self.layout.engines for e in p.parts]
        lines += [f"critic rank {r}: bundle {b.index} node {b.node_ip} ({b.node_id[:8]}) gpu {b.gpu_id}"
                  for r, b in enumerate(self.layout.critic_bundles)]
        return lines

    def remove(self) -> None:
        remove_placement_group(self.group)


def placement_record(ranks: Sequence[dict], engines: Sequence[Any]) -> dict[str, Any]:
    """The 'placement' metrics event: where every trainer rank and engine runs, by its own account."""
    engines = [dataclasses.asdict(e) for e in engines]
    nodes = {r["node_id"] for r in ranks} | {e["node_id"] for e in engines}
    return {"placement/nodes": len(nodes), "placement/ranks": list(ranks), "placement/engines": engines}


def probe_bundle() -> tuple[str, str, str | None]:
    """(node id, node address, GPU id) of the bundle this runs on; a Ray task on each bundle."""
    gpu_ids = ray.get_gpu_ids()
    return ray.get_runtime_context().get_node_id(), node_address(), (str(gpu_ids[0]) if gpu_ids else None)


def use_gpus(args) -> bool:
    import torch

    return args.train_backend_device != "cpu" and torch.cuda.is_available()


def create_placement(args, *, use_gpu: bool | None = None, timeout_s: float = PLACEMENT_S) -> Placement:
    """Reserve every bundle of the job in one placement group, probe them, assign them."""
    use_gpu = use_gpus(args) if use_gpu is None else use_gpu
    count = total_bundles(args)
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementError(f"Ray could not place {count} bundles of {bundle} within {timeout_s:.0f}s; cluster "
                             f"resources: {ray.cluster_resources()}, available: {ray.available_resources()}")
    infos = _bundle_infos(group, count, use_gpu, timeout_s)
    layout = plan_layout(infos, trainer_ranks=trainer_ranks(args), num_engines=num_engines(args),
                         gpus_per_engine=args.rollout_num_gpus_per_engine, colocate=args.colocate,
                         critic_ranks=critic_ranks(args))
    if args.colocate and args.actor_num_nodes > 1 and not args.debug_rollout_only:
        # read by every rank's weight sync: where the nodes that lack a PP stage are (slime/backends/weight_sync/node_routes.py)
        advance(args, colocated_node_hosts=tuple(check_colocated_nodes(layout, args.actor_num_gpus_per_node)))
    driver_node = ray.get_runtime_context().get_node_id()
    check_engine_bind_host(args.engine_bind_host, layout, driver_node)
    # Read by every server the run starts (engines, router, rendezvous): loopback on one node.
    advance(args, spans_nodes=node_count(layout, driver_node) > 1)
    placement = Placement(group=group, use_gpu=use_gpu, layout=layout)
    # every bundle with --verbose; else stdout's placement line sums it up
    where = ":\n  " + "\n  ".join(placement.describe()) if args.verbose else ""
    logger.info("placement of %d bundles over %d node(s)%s", count, len({b.node_id for b in infos}), where)
    return placement


def _bundle_infos(group: PlacementGroup, count: int, use_gpu: bool, timeout_s: float) -> list[BundleInfo]:
    """Where each bundle is. CPU bundles on a one-node cluster are on the driver's node, with no GPU id: known
    without a probe task (each would start a Ray worker process that no actor reuses)."""
    if not use_gpu and sum(node["Alive"] for node in ray.nodes()) == 1:
        node = ray.get_runtime_context().get_node_id()
        return [BundleInfo(index=i, node_id=node, node_ip=node_address(), gpu_id=None) for i in range(count)]
    return _probe(group, count, use_gpu, timeout_s)


def _probe(group: PlacementGroup, count: int, use_gpu: bool, timeout_s: float) -> list[BundleInfo]:
    # Tasks with the actors' env (the address a node's workers report may come from it: SLIME_HOST_IP).
    probe = ray.remote(probe_bundle)
    refs = [probe.options(num_cpus=0.01, num_gpus=0.01 if use_gpu else 0,
                          runtime_env={"env_vars": worker_env(use_gpu)},
                          scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
                          ).remote() for i in range(count)]
    try:
        found = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise PlacementError(f"the {count} bundles were reserved but not all ran a probe within {timeout_s:.0f}s "
                             "(a node that cannot start Ray workers?)") from None
    return [BundleInfo(index=i, node_id=node, node_ip=ip, gpu_id=gpu) for i, (node, ip, gpu) in enumerate(found)]
