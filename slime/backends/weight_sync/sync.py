"""Fenced weight sync, trainer -> rollout engines (phase 6 of docs/fenced-step.md).

Order on EVERY rank, every sync (fences are world-wide, over the gloo fence group):

  plan    build the bucket plan (pure, from the local model) and fence its fingerprint
  pause   the coordinator (world rank 0) pauses and flushes every engine and opens a weight-update session
          on each; fence. One session per sync, whoever sends: an engine holds one session at a time (SGLang
          refuses a second begin and finalizes the whole model at the end), while under PP several senders
          feed the same engine.
  push    exporters stream the weight source, check it against the plan; senders hand each full bucket to
          the transport (transport.py); fence. Colocated engines take the stages' buckets concurrently.
          Separate engines under PP: one stage after another, in one global order (stage 0 first) and
          fenced after each, because an engine joins one weight-update group and receives one broadcast
          at a time: two stages creating their groups (or broadcasting) at once, each holding some
          engines while waiting for the others, is a cyclic wait. Each stage's group is created in its
          turn at the first sync, recorded in the ledger, with a deadline (half the fence window, so the
          named error of the stalled stage's sender arrives before any window expires).
  proof   (on by default) the senders' digests of what they pushed are gathered on the coordinator, which compares
          them with every engine's own; exporters of a subset push check what it left out (proof.py); fence
  resume  the coordinator closes the sessions (every sender is past the push fence), checks every engine's
          weight_version, continues generation; fence. A sync that fails at a fence closes them too.

Where the HF tensors come from (`weight_source`, by default export_hf_weights over the model
chunks) and how buckets travel (the transport) are separate, replaceable pieces.

Who does what (megatron parallel_state coordinates):
  exporters  cp_rank 0 and dp_rank 0 of each PP stage, every TP rank: they iterate the export
             together because it all-gathers each TP-split parameter over the TP group. With expert
             parallelism every rank is an exporter: the routed experts are all-gathered over EP.
  senders    the tp_rank 0 exporter of each PP stage: the only ranks that talk HTTP to engines.
  per node   `--colocate` across nodes: engines take tensors only from their own node, so on EVERY node
             the first TP group of each PP stage it holds exports that stage, and its sender feeds the
             engines whose URL is at its node's address. A node holding none of a stage (PP spanning
             nodes) gets it over that stage's weight-update group from one of the stage's senders, the
             stages then pushed one after another as for separate engines (node_routes.py). The
             coordinator still pauses, checks and resumes all.
  others     DP/CP replicas skip the export entirely. Invariant that makes this safe: the export's
             only collectives are on the TP group, and a TP group lies inside one (dp, cp, pp)
             coordinate, so a replica that skips is never a member of a collective an exporter runs.
             Who exports and sends is a function of the rank and the flags alone, the same on every rank.

Errors never strand a peer inside a collective: an exporter that fails (plan mismatch, HTTP error)
keeps iterating the export to its end without sending, and every local failure is reported in the
next fence's fields. That fence then raises on all ranks together (CollectiveDivergenceError naming
the failing ranks); the failing rank raises its own error, chained to it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from slime.backends.sglang_utils.http_client import ClientTimeouts, SGLangHTTPClient
from slime.backends.weight_sync.factory import build_transport, choose_transport
from slime.backends.weight_sync.node_routes import NodeFeeds, NodeGrid, node_feeds
from slime.backends.weight_sync.plan import (
    NamedTensors,
    WeightBucket,
    WeightSource,
    WeightSyncPlan,
    WeightSyncPlanError,
    build_weight_sync_plan,
    export_model_weights,
    iter_planned_buckets,
)
from slime.backends.weight_sync.proof import CarriedTensors, WeightProof
from slime.backends.weight_sync.transport import ENGINE_KINDS, EngineSet, NodeSplitTransport, TensorTransport, \
    engine_call
from slime.config.run_config import run_delta
from slime.distributed.errors import CollectiveDivergenceError, DistributedStepError
from slime.distributed.fault_inject import apply_weight_push_fault
from slime.distributed.fingerprint import stable_hash
from slime.models.hf_weights import carried_tensors
from slime.models.registry import TEXT_PREFIX_ATTRIBUTE
from slime.utils.deadlines import ENGINE_HTTP_CONTROL_S, SESSION_CLOSE_AFTER_FAILURE_S, run_deadlines

logger = logging.getLogger(__name__)


class WeightVersionError(RuntimeError):
    """An engine reports a weight_version other than the one just pushed."""


# ----------------------------------------------------------------------------- roles
@dataclass(frozen=True)
class SyncRole:
    """This rank's part in a sync, from megatron's parallel_state."""

    world_rank: int
    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    first_replica: bool  # cp_rank == 0 and dp_rank == 0 (per node: the stage's first TP group on the node)
    expert_parallel: bool = False  # EP > 1: routed experts are spread over DP replicas

    @property
    def exporter(self) -> bool:
        """Iterates the export with its TP group; with EP every rank does (the experts' all-gather spans EP,
        which crosses DP replicas), so no member of a collective is left out."""
        return self.first_replica or self.expert_parallel

    @property
    def sender(self) -> bool:
        return self.first_replica and self.tp_rank == 0

    @property
    def coordinator(self) -> bool:
        # World rank 0 is the stage-0 sender: one place pauses and resumes engines, even under PP.
        return self.world_rank == 0

    @classmethod
    def current(cls, grid: NodeGrid | None = None) -> "SyncRole":
        """grid: the ranks over nodes when every node feeds its own engines, else None."""
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        rank = dist.get_rank()
        if grid is None:
            first = mpu.get_context_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0
        else:
            first = grid.heads_export(rank)
        return cls(
            world_rank=rank,
            pp_rank=mpu.get_pipeline_model_parallel_rank(),
            pp_size=mpu.get_pipeline_model_parallel_world_size(),
            tp_rank=mpu.get_tensor_model_parallel_rank(),
            tp_size=mpu.get_tensor_model_parallel_world_size(),
            first_replica=first,
            expert_parallel=mpu.get_expert_model_parallel_world_size() > 1,
        )


@dataclass
class _PushResult:
    error: Exception | None = None
    bytes_sent: int = 0
    buckets_sent: int = 0
    gather_seconds: float = 0.0
    send_seconds: float = 0.0


def _error_field(error: Exception | None) -> str:
    return "" if error is None else f"{type(error).__name__}: {error}"[:200]


def carried_by_engines(args: Any, hf_config: Any) -> CarriedTensors | None:
    """What the engines load from --hf-checkpoint and the trainer does not build, so never pushes: a vision + text
    checkpoint's vision tower when the run trains its text model alone."""
    hf_dir = getattr(args, "hf_checkpoint", None)
    if not hf_dir or getattr(hf_config, TEXT_PREFIX_ATTRIBUTE, None) is None:
        return None
    return CarriedTensors(lambda: carried_tensors(hf_dir, hf_config),
                          "the trainer does not build it (a vision + text checkpoint trains its text model alone "
                          "without --multimodal-keys), so the engines must serve the checkpoint's")


# ----------------------------------------------------------------------------- the sync
class WeightSync:
    """Per-rank executor of the fenced weight sync; `sync` runs on every rank of the world."""

    def __init__(self, args: Any, hf_config: Any, engine_urls: Sequence[str], *, engine_kind: str | None = None,
                 timeouts: ClientTimeouts | None = None, transport: str | None = None,
                 weight_source: WeightSource = export_model_weights, select: Callable[[str], bool] | None = None,
                 node_host: str | None = None, node_hosts: Sequence[str] = ()) -> None:
        """`select` (megatron name -> bool): what a push after the first sends (LoRA: only the adapted layers,
        the rest is the frozen base the engines already hold); the first push, and the first after a retarget,
        send every weight. `node_host`, `node_hosts`: this rank's node address and every node's, by node index (the
        run state's: read where the run is colocated across nodes)."""
        from slime.backends.sglang_utils.launcher import pick_rollout_backend

        self.hf_config = hf_config
        self.engine_urls = tuple(engine_urls)
        self.engine_kind = engine_kind or pick_rollout_backend(args)
        if self.engine_kind not in ENGINE_KINDS:
            raise ValueError(f"engine kind {self.engine_kind!r}; expected one of {ENGINE_KINDS}")
        self.transport_kind = transport or choose_transport(args)
        self.weight_source = weight_source
        self.delta = run_delta(args)
        # Ranks per engine in a weight-update group: SGLang's TP ranks; the embedded engine is one process
        # whatever its GPU count (its TP is not sharded).
        self.engine_tp_size = 1 if self.engine_kind == "embedded" else args.rollout_num_gpus_per_engine
        self.bucket_bytes = args.update_weight_buffer_size
        self.timeout_s = run_deadlines(args).no_progress_s  # the rank window, --fence-timeout
        # A weight-update group's creation and each broadcast: half a window, so that the stalled stage's
        # sender names it (WeightGroupStallError) before its peers' windows expire at the fences.
        self.group_deadline_s = self.timeout_s / 2
        # An engine call never outlives the watchdog deadline of the phase it runs in.
        self.timeouts = timeouts or ClientTimeouts(control=min(ENGINE_HTTP_CONTROL_S, self.timeout_s), generate=self.timeout_s,
                                                   weight_update=self.timeout_s, memory=self.timeout_s)
        self._engines: EngineSet | None = None
        self._transport = None
        self.grid = NodeGrid.from_args(args)
        # this rank's node address (its Ray actor's) and every node's, by node index (the placement's): the run
        # state's, read only where the run is colocated across nodes
        self.node_host = node_host if self.grid is not None else None
        self.node_hosts = tuple(node_hosts) if self.grid is not None else ()
        self._rank: int | None = None
        self._feeds: NodeFeeds | None = None
        self._split_engines: list[EngineSet] = []  # its node's, and the other nodes' it feeds
        self.select = select
        self._full_push_due = True
        self.proof = WeightProof(self.engine_kind, enabled=args.weight_sync_proof, subset=select,
                                 carried=carried_by_engines(args, hf_config))
        self._fed_engines: EngineSet | None = None
        self._plans: dict[tuple, WeightSyncPlan] = {}

    def _plan(self, model_chunks: Sequence[torch.nn.Module], role: SyncRole, select) -> WeightSyncPlan:
        """The bucket plan, built once per model and push kind: pure in the model's parameter shapes, which a run
        never changes (a rebuilt model is other module objects), so every later push reuses it instead of mapping
        each parameter to its HF tensors again."""
        key = (tuple(map(id, model_chunks)), role.tp_size, role.pp_rank, select is None)
        if key not in self._plans:
            self._plans[key] = build_weight_sync_plan(model_chunks, self.hf_config, tp_size=role.tp_size,
                                                      bucket_bytes=self.bucket_bytes, pp_rank=role.pp_rank,
                                                      select=select)
        return self._plans[key]

    @property
    def engines(self) -> EngineSet:
        if self._engines is None:  # only ranks that talk HTTP open connections
            self._engines = EngineSet(self.engine_urls, self.timeouts)
        return self._engines

    @property
    def feeds(self) -> NodeFeeds:
        """Colocated across nodes: the engines this node sender feeds (node_routes.py)."""
        if self._feeds is None:
            self._feeds = node_feeds(self.grid, self._rank, self.engine_urls, self.node_host, self.node_hosts)
        return self._feeds

    @property
    def fed_engines(self) -> EngineSet:
        """The engines this rank's sender feeds (the proof learns the dtypes they hold): all, or per node `feeds`."""
        if self.grid is None:
            return self.engines
        if self._fed_engines is None:
            self._fed_engines = EngineSet(self.feeds.local + self.feeds.remote, self.timeouts)
        return self._fed_engines

    def transport(self, device: torch.device, pp_rank: int):
        if self._transport is None:
            self._transport = (self._node_split_transport(device, pp_rank) if self.grid is not None else
                               self._build(self.transport_kind, self.engines, device, pp_rank))
        return self._transport

    def _build(self, kind: str, engines: EngineSet, device: torch.device, pp_rank: int):
        return build_transport(kind, engines, engine_kind=self.engine_kind, engine_tp_size=self.engine_tp_size,
                               timeout_s=self.group_deadline_s, device=device, pp_rank=pp_rank, delta=self.delta)

    def _node_split_transport(self, device: torch.device, pp_rank: int) -> NodeSplitTransport:
        """This node's engines by tensor; the other nodes' it feeds over its stage's weight-update group."""
        local = EngineSet(self.feeds.local, self.timeouts)
        self._split_engines.append(local)
        remote = None
        if self.feeds.remote:
            remote_engines = EngineSet(self.feeds.remote, self.timeouts)
            self._split_engines.append(remote_engines)
            remote = self._build("distributed", remote_engines, device, pp_rank)
        return NodeSplitTransport(TensorTransport(local, self.engine_kind, self.engine_tp_size), remote)

    def sync(self, model_chunks: Sequence[torch.nn.Module], rollout_id: int, *, fence: Callable[..., None],
             watchdog: Any = None, read_param: Callable[[torch.Tensor], torch.Tensor] | None = None
             ) -> dict[str, float]:
        """Push this rank's share of the weights to every engine; returns trainer-side metrics.

        `read_param` gives a parameter's current value (a sleeping trainer serves it from its host copy)."""
        start = time.perf_counter()
        version = str(rollout_id + 1)
        role = SyncRole.current(self.grid)
        self._rank = role.world_rank
        phase = _phase_factory(watchdog)
        ledger = getattr(fence, "ledger", None)

        select = None if self._full_push_due else self.select
        self.proof.start_sync()
        with phase("weight_sync/plan"):
            plan = self._plan(model_chunks, role, select)
            fence("weight_sync/plan", self._plan_fields(plan, role, rollout_id))
        try:
            with phase("weight_sync/pause"):
                error = _attempt(lambda: self._pause_and_open_sessions(ledger)) if role.coordinator else None
                _fence_outcome(fence, "weight_sync/paused", rollout_id, error)
            # Every bucket and TP gather is progress: ranks that only wait at the closing fence wait as
            # long as the exporters keep making it (slime/utils/deadlines.py).
            with phase("weight_sync/push"):
                if self.stages_in_order(role):
                    result = self._push_stages_in_order(model_chunks, plan, role, version, phase, ledger,
                                                        read_param, select, fence, rollout_id)
                else:
                    result = (self._push(model_chunks, plan, role, version, phase, ledger, read_param, select)
                              if role.exporter else _PushResult())
                _fence_outcome(fence, "weight_sync/pushed", rollout_id, result.error)
            if self.proof.enabled:  # every engine serves what was pushed (proof.py); a flag: alike on every rank
                with phase("weight_sync/proof"):
                    error = self.proof.run(model_chunks=model_chunks, full_push=select is None,
                                           exporter=role.exporter, coordinator=role.coordinator, read_param=read_param,
                                           engines=self.engines if role.coordinator else None,
                                           group=getattr(fence, "group", None), version=version, ledger=ledger)
                    _fence_outcome(fence, "weight_sync/proved", rollout_id, error)
        except BaseException:
            if role.coordinator:  # the engines stay paused (their weights are not the trainer's), the sessions end
                self._close_sessions_after_failure()
            raise
        with phase("weight_sync/resume"):
            error = _attempt(lambda: self._close_sessions_and_resume(version, ledger)) if role.coordinator else None
            _fence_outcome(fence, "weight_sync/done", rollout_id, error)
        self._full_push_due = False
        return {**self._metrics(result, version, time.perf_counter() - start), **self.proof.take_metrics()}

    # -- phases --------------------------------------------------------------------------
    def _plan_fields(self, plan: WeightSyncPlan, role: SyncRole, rollout_id: int) -> dict[str, Any]:
        fields = {
            "rollout_id": rollout_id,
            "bucket_bytes": self.bucket_bytes,
            "tp_size": role.tp_size,
            "pp_size": role.pp_size,
            "engines": stable_hash(list(self.engine_urls)),
        }
        # The world fence compares every rank with every other; under PP the stages' plans differ
        # by design, so only the shared part is fenced (each stage still checks its plan against
        # its own export, bucket by bucket).
        if role.pp_size == 1:
            fields.update(plan.fingerprint_fields())
        return fields

    def _pause_and_open_sessions(self, ledger) -> None:
        self._each_engine(lambda client: (client.pause_generation(), client.flush_cache(self.timeouts.control)))
        with engine_call(ledger, "weight_sync/begin_session", len(self.engine_urls), "engines"):
            self.engines.begin_session()

    def _close_sessions(self, ledger) -> None:
        with engine_call(ledger, "weight_sync/end_session", len(self.engine_urls), "engines"):
            self.engines.end_session()

    def _close_sessions_after_failure(self) -> None:
        """Best effort, briefly: a stalled engine may be why the sync failed."""
        if self._engines is not None and self._engines.in_session:
            unclosed = self._engines.end_session(wait_s=SESSION_CLOSE_AFTER_FAILURE_S)
            if unclosed:
                logger.warning("weight sync failed; the weight-update sessions of %s did not close within %gs "
                               "(the next sync closes them first)", unclosed, SESSION_CLOSE_AFTER_FAILURE_S)

    def _push(self, model_chunks, plan: WeightSyncPlan, role: SyncRole, version: str, phase, ledger,
              read_param, select) -> _PushResult:
        """Iterate the export to its end (TP collectives) whatever happens; send while nothing failed."""
        result = _PushResult()
        exported = iter(self._export(model_chunks, read_param, select))
        planned = iter_planned_buckets(plan, exported)
        for index in range(len(plan.buckets) + 1):  # +1: the plan checks the export has ended
            with phase(f"bucket{index}"):
                gather_start = time.perf_counter()
                item = _next_bucket(planned, exported, result)
                result.gather_seconds += time.perf_counter() - gather_start
                if item is None:
                    break
                if role.sender and result.error is None:  # in the engines' dtypes, digested as the export gave it
                    bucket, tensors = item
                    result.error = _attempt(lambda: self._send_proven(bucket, tensors, role, version, plan, ledger,
                                                                      result))
                if ledger is not None:
                    ledger.note_progress()  # a bucket exported (and sent): progress on every exporter
        return result

    def stages_in_order(self, role: SyncRole) -> bool:
        """PP stages push one after another where engines receive over weight-update groups: separate engines,
        or colocated across nodes with stages that some node does not hold. A function of the flags alone."""
        groups = self.transport_kind == "distributed" or (self.grid is not None and self.grid.stages_span_nodes)
        return groups and role.pp_size > 1

    def _push_stages_in_order(self, model_chunks, plan: WeightSyncPlan, role: SyncRole, version: str, phase,
                              ledger, read_param, select, fence, rollout_id: int) -> _PushResult:
        """Stage 0's push, fenced, then stage 1's, ...; each stage's group formed in its turn (first sync)."""
        result = _PushResult()
        for stage in range(role.pp_size):
            mine = role.pp_rank == stage
            with phase(f"pp{stage}"):
                if mine and role.sender:
                    device = next(iter(model_chunks[0].parameters())).device
                    error = _attempt(lambda: self._connect(device, stage, ledger))
                    result.error = result.error or error
                if mine and role.exporter and result.error is None:
                    result = self._push(model_chunks, plan, role, version, phase, ledger, read_param, select)
                elif mine and role.exporter:
                    for _ in self._export(model_chunks, read_param, select):  # the TP peers run its gathers
                        pass
                _fence_outcome(fence, f"weight_sync/pushed_pp{stage}", rollout_id, result.error if mine else None)
        return result

    def _connect(self, device: torch.device, stage: int, ledger) -> None:
        transport = self.transport(device, stage)
        if transport.connected:
            return
        with engine_call(ledger, f"weight_sync/connect_pp{stage}", len(transport.group_engines), "engines"):
            transport.connect()

    def _export(self, model_chunks, read_param, select):
        """The weight source's tensors; `select` only where set (a custom source need not take it)."""
        if select is None:
            return self.weight_source(model_chunks, self.hf_config, read_param)
        return self.weight_source(model_chunks, self.hf_config, read_param, select=select)

    def _send_proven(self, bucket: WeightBucket, tensors: NamedTensors, role: SyncRole, version: str,
                     plan: WeightSyncPlan, ledger, result: _PushResult) -> None:
        """The bucket in the engines' dtypes, sent while the proof digests it; the next export waits for both."""
        with self.proof.sending(self.fed_engines, tensors) as cast:
            self._send_bucket(bucket, apply_weight_push_fault(cast, role.world_rank, int(version) - 1), version, plan,
                              ledger, result)

    def _send_bucket(self, bucket: WeightBucket, tensors: NamedTensors, version: str, plan: WeightSyncPlan,
                     ledger, result: _PushResult) -> None:
        start = time.perf_counter()
        last = bucket.index == len(plan.buckets) - 1
        try:
            with engine_call(ledger, f"weight_sync/send_bucket{bucket.index}", bucket.nbytes, "bytes"):
                # The version moves (and the cache flushes) with the last bucket only: an engine whose push
                # broke off midway keeps reporting the old version, so the version check catches it.
                device = tensors[0][1].device if tensors else torch.device("cpu")
                sent = self.transport(device, plan.pp_rank).send(bucket.index, tensors,
                                                                 version=version if last else None, flush_cache=last)
        finally:
            result.send_seconds += time.perf_counter() - start
        result.bytes_sent += sent if isinstance(sent, int) else bucket.nbytes  # a delta transport counts its own
        result.buckets_sent += 1

    def _close_sessions_and_resume(self, version: str, ledger) -> None:
        self._close_sessions(ledger)
        versions = self._each_engine(lambda client: client.weight_version())
        wrong = {url: v for url, v in zip(self.engine_urls, versions) if v != version}
        if wrong:
            # Engines stay paused: their weights are not the trainer's.
            raise WeightVersionError(f"engines report weight_version {wrong}, expected {version!r}")
        self._each_engine(lambda client: client.continue_generation())

    def _each_engine(self, call: Callable[[SGLangHTTPClient], Any]) -> list[Any]:
        return self.engines.each(call)

    def _metrics(self, result: _PushResult, version: str, seconds: float) -> dict[str, float]:
        push_seconds = result.gather_seconds + result.send_seconds
        return {
            "weight_sync/seconds": seconds,
            "weight_sync/bytes": float(result.bytes_sent),
            "weight_sync/buckets": float(result.buckets_sent),
            "weight_sync/version": float(version),
            "weight_sync/gather_seconds": result.gather_seconds,
            "weight_sync/send_seconds": result.send_seconds,
            # gigabits per second over export + send, on the sending rank (0 elsewhere)
            "weight_sync/gbps": result.bytes_sent * 8 / 1e9 / push_seconds if result.bytes_sent else 0.0,
        }

    def close(self) -> None:
        self.proof.close()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._engines is not None:
            self._engines.close()
            self._engines = None
        if self._fed_engines is not None:
            self._fed_engines.close()
            self._fed_engines = None
        for engines in self._split_engines:
            engines.close()
        self._split_engines.clear()
        self._feeds = None  # retarget: the engines may have moved

    def retarget(self, engine_urls: Sequence[str]) -> None:
        """Aim the next syncs at these engines (some were restarted elsewhere): connections are rebuilt."""
        self.close()
        self.engine_urls = tuple(engine_urls)
        self._full_push_due = True
        self.proof.reset()


# ----------------------------------------------------------------------------- helpers
def _phase_factory(watchdog: Any) -> Callable[..., Any]:
    def phase(name: str, deadline_s: float | None = None):
        if watchdog is None:
            return contextlib.nullcontext()
        return watchdog.phase(name, deadline_s)

    return phase


def _attempt(action: Callable[[], Any]) -> Exception | None:
    """Run a rank-local action; return its error instead of raising, so the next fence reports it.
    Watchdog/fence errors are not deferred: they already concern every rank."""
    try:
        action()
    except DistributedStepError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported at the next fence, re-raised there
        return exc
    return None


def _next_bucket(planned: Iterator, exported: Iterator, result: _PushResult):
    """The next planned bucket, or None at the end; a plan mismatch is recorded and the export drained
    (the TP peers meet the same mismatch at the same tensor and drain the same gathers)."""
    try:
        return next(planned, None)
    except WeightSyncPlanError as exc:
        result.error = result.error or exc
        for _ in exported:
            pass
        return None


def _fence_outcome(fence: Callable[..., None], phase: str, rollout_id: int, error: Exception | None) -> None:
    """Fence, carrying this rank's local failure (if any); raise on every rank when any rank failed."""
    fields = {"rollout_id": rollout_id, "error": _error_field(error)}
    try:
        fence(phase, fields)
    except CollectiveDivergenceError as divergence:
        if error is not None:
            raise error from divergence
        raise
    if error is not None:  # every rank failed alike (or a world of one)
        raise error
