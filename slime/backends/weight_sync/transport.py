"""How weight buckets travel from a trainer sender to the engines: the wire half of the weight sync.

Chosen once at start (factory.py), as upstream slime does:
  tensor       colocated engines (`--colocate`): `/update_weights_from_tensor`. On SGLang, a CUDA-IPC
               flattened bucket with ONE serialization per consumer (engine x engine TP rank): torch
               refcounts each serialized CUDA handle once, so a blob shared by several consumers frees
               the bucket early or leaks it. On the embedded engine, the same flattened bucket
               (sglang_utils/flattened_bucket.py, read there by a restricted unpickler) when the bucket
               is on a GPU the engine sees (its /server_info lists its GPUs' UUIDs): device to device,
               no host copy. Otherwise (CPU, or a GPU the engine cannot see) one shared-memory file per
               bucket that every engine on the host maps (no pickle, no base64).
  distributed  engines that do not share the trainer's GPUs or node (`--update-weight-transport nccl`
               without `--colocate`): `/init_weights_update_group` once, then per bucket
               `/update_weights_from_distributed` while the sender broadcasts each tensor over that group
               (NCCL on GPUs, gloo for the embedded engine on CPU: the same protocol). One group per PP
               stage. The group's creation (the rendezvous and every engine's join) has one deadline, and so
               has each bucket (its broadcasts, polled to completion, and every engine's reply); a stall ends
               as a WeightGroupStallError naming the stage and every engine that was late, with the
               communicator aborted (external_group.py).
  node_split   `--colocate` across nodes with PP stages spanning nodes: a node sender feeds its node's engines
               by tensor and, over its stage's weight-update group, the engines of nodes that hold none of
               its stage (node_routes.py says which).
Every sync's pushes sit inside one weight-update session (`/begin_weight_update` ... `/end_weight_update`) per
engine that has them (SGLang >= 0.5.21, the embedded engine), opened and closed by the sync's coordinator (EngineSet
sessions); an engine answering 404 needs none.

The weight *source* is not this module's business: it receives HF-named tensors bucket by bucket.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

import torch

from slime.backends.sglang_utils import flattened_bucket
from slime.backends.sglang_utils.http_client import ClientTimeouts, EngineHTTPError, SGLangHTTPClient
from slime.backends.sglang_utils.named_tensors import serialize_named_tensors
from slime.backends.sglang_utils.shared_payload import LOAD_FORMAT as SHM_LOAD_FORMAT
from slime.backends.sglang_utils.shared_payload import make_run_directory, run_directory, write_shared_bucket
from slime.utils.deadlines import NCCL_WATCHDOG_MARGIN_S, SERVER_HEALTH_PROBE_S
from slime.utils.security import current_key

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]
ENGINE_KINDS = ("embedded", "sglang")
WEIGHT_UPDATE_GROUP = "slime_weight_update"


class WeightGroupStallError(RuntimeError):
    """A PP stage's weight-update group was not formed, or a broadcast on it not received, within its deadline."""


class WeightPushError(RuntimeError):
    """Engines answered a bucket pushed over the weight-update group with an error (each named)."""


# ----------------------------------------------------------------------------- payloads
@dataclass(frozen=True)
class EnginePayload:
    """One bucket as /update_weights_from_tensor wants it: one entry per engine TP rank."""

    serialized_per_tp_rank: tuple[str, ...]
    load_format: str


def encode_safetensors_payload(named_tensors: NamedTensors) -> EnginePayload:
    """The embedded engine's portable format (base64 safetensors in JSON): slow, works across hosts."""
    return EnginePayload((serialize_named_tensors(named_tensors),), "slime_safetensors")


def encode_sglang_payload(named_tensors: NamedTensors, engine_tp_size: int) -> EnginePayload:
    """SGLang's `flattened_bucket`: the bucket flattened once, serialized once per engine TP rank.

    Call once per engine: every returned entry is its own serialization (its own CUDA-IPC reference)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()  # device-uuid aware CUDA IPC, as the engine expects
    bucket = FlattenedTensorBucket(named_tensors=named_tensors)
    payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    blobs = tuple(MultiprocessingSerializer.serialize(payload, output_str=True) for _ in range(engine_tp_size))
    return EnginePayload(blobs, "flattened_bucket")


# ----------------------------------------------------------------------------- engines
@contextlib.contextmanager
def engine_call(ledger, op: str, size: int, unit: str) -> Iterator[None]:
    """A call to the engines in this rank's ledger (channel "http_engines"), ended with its error if it raised."""
    entry = ledger.begin_named(op, "http_engines", (ledger.rank,), (size,), unit) if ledger else None
    error = None
    try:
        yield
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
        raise
    finally:
        if entry is not None:
            ledger.end(entry, error)


class EngineSet:
    """The engines one sender feeds: concurrent calls (one long-lived thread per engine) and sessions."""

    def __init__(self, urls: tuple[str, ...], timeouts: ClientTimeouts) -> None:
        self.urls = tuple(urls)
        self.clients = [SGLangHTTPClient(url, timeouts) for url in self.urls]
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)), thread_name_prefix="engine-call")
        self._in_session: list[SGLangHTTPClient] = []

    def submit_each(self, call: Callable[[SGLangHTTPClient], Any],
                    clients: list[SGLangHTTPClient] | None = None) -> list[Future]:
        return [self._pool.submit(call, client) for client in (self.clients if clients is None else clients)]

    def each(self, call: Callable[[SGLangHTTPClient], Any],
             clients: list[SGLangHTTPClient] | None = None) -> list[Any]:
        """One call per engine, concurrently; each bounded by the client's HTTP timeout."""
        return [future.result() for future in self.submit_each(call, clients)]

    def begin_session(self) -> None:
        """Open a weight-update session on every engine. An engine holds one session at a time (SGLang refuses a
        second begin, and its end finalizes the whole model), so one process owns it for a whole push: the sync's
        coordinator (sync.py). Every engine is asked; those that opened are remembered (end_session
        closes them) before the first error is raised."""
        calls = self.submit_each(_open_session)
        self._in_session = [client for client, call in zip(self.clients, calls)
                            if call.exception() is None and call.result()]
        for call in calls:
            call.result()

    def end_session(self, *, wait_s: float | None = None) -> list[str]:
        """Close the sessions begin_session opened. wait_s (after a failed push): wait at most that long, for an
        engine may be the failure's cause; the engines whose close did not end in time are returned (a session
        one leaves open is closed at the next begin_session)."""
        in_session, self._in_session = self._in_session, []
        calls = self.submit_each(lambda client: client.end_weight_update(), in_session)
        if wait_s is None:
            for call in calls:
                call.result()
            return []
        futures_wait(calls, timeout=wait_s)
        return [client.base_url for client, call in zip(in_session, calls) if not call.done() or call.exception()]

    @property
    def in_session(self) -> bool:
        return bool(self._in_session)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self.clients:
            client.close()


SESSION_ALREADY_OPEN = "already open"  # SGLang's (and the embedded engine's) answer to a second begin


def _open_session(client: SGLangHTTPClient) -> bool:
    """begin_weight_update; a session a push left open (its trainer died before the end) is closed first."""
    try:
        return client.begin_weight_update()
    except EngineHTTPError as exc:
        if exc.status != 400 or SESSION_ALREADY_OPEN not in str(exc):
            raise
    logger.warning("%s: a weight-update session left open by an earlier push; closing it first", client.base_url)
    client.end_weight_update()
    return client.begin_weight_update()


# ----------------------------------------------------------------------------- transports
def ipc_reach(sender_gpu: str | None, engine_gpus: list[frozenset[str]]) -> list[bool]:
    """Per engine: can it map a CUDA bucket of the sender's GPU (UUID; None: the bucket is on the host)?
    Only if that GPU is among those it sees (a process limited by CUDA_VISIBLE_DEVICES cannot)."""
    return [sender_gpu is not None and sender_gpu in gpus for gpus in engine_gpus]


class TensorTransport:
    """Colocated engines: `/update_weights_from_tensor`."""

    name = "tensor"

    def __init__(self, engines: EngineSet, engine_kind: str, engine_tp_size: int, *, allow_ipc: bool = True) -> None:
        """allow_ipc=False: embedded engines always get shared-memory files (a benchmark compares the two)."""
        if engine_kind not in ENGINE_KINDS:
            raise ValueError(f"engine kind {engine_kind!r}; expected one of {ENGINE_KINDS}")
        self.engines = engines
        self.engine_kind = engine_kind
        self.engine_tp_size = engine_tp_size
        self._token = uuid.uuid4().hex[:12]
        self._checked_local = False
        self._key = current_key()  # names the run's shared-memory directory, which the engines accept
        self.allow_ipc = allow_ipc
        self._engine_gpus: list[frozenset[str]] | None = None  # per engine: the GPU UUIDs it sees

    def _check_engines_on_this_host(self) -> None:
        """CUDA IPC and shared memory reach only engines of the sender's host."""
        from slime.distributed.external_group import address_towards

        for url in self.engines.urls:
            host = urlparse(url).hostname or "127.0.0.1"
            if address_towards(host) not in (host, "127.0.0.1"):
                raise ValueError(f"engine {url} is not on this host, so colocated tensors cannot reach it; "
                                 "engines on other nodes need the distributed transport (no --colocate)")
        self._checked_local = True

    def send(self, index: int, tensors: NamedTensors, *, version: str | None, flush_cache: bool) -> None:
        if not self._checked_local:
            self._check_engines_on_this_host()
        if self.engine_kind == "sglang":
            self.engines.each(lambda client: self._post(client, encode_sglang_payload(tensors, self.engine_tp_size),
                                                        version, flush_cache))
            return
        by_ipc = self._ipc_reach(tensors)
        ipc_clients = [client for client, ipc in zip(self.engines.clients, by_ipc) if ipc]
        shm_clients = [client for client, ipc in zip(self.engines.clients, by_ipc) if not ipc]
        futures, flat = [], None
        if ipc_clients:  # device to device: one serialization (one IPC reference) per engine
            flat, entries = flattened_bucket.flatten(tensors)
            payloads = {client.base_url: EnginePayload((flattened_bucket.serialize(flat, entries),),
                                                       flattened_bucket.LOAD_FORMAT) for client in ipc_clients}
            futures = self.engines.submit_each(
                lambda client: self._post(client, payloads[client.base_url], version, flush_cache), ipc_clients)
        try:
            if shm_clients:
                self._send_shared(index, tensors, shm_clients, version, flush_cache)
        finally:
            for future in futures:  # each bounded by the client's HTTP timeout
                future.result()
            del flat  # the engines copied out of it before answering

    def _ipc_reach(self, tensors: NamedTensors) -> list[bool]:
        device = tensors[0][1].device if tensors else torch.device("cpu")
        if device.type != "cuda" or not self.allow_ipc:
            return ipc_reach(None, [frozenset()] * len(self.engines.clients))
        if self._engine_gpus is None:
            infos = self.engines.each(lambda client: client.server_info())
            self._engine_gpus = [frozenset(info.get("cuda_device_uuids") or ()) for info in infos]
        return ipc_reach(flattened_bucket.device_uuid(device), self._engine_gpus)

    def _send_shared(self, index: int, tensors: NamedTensors, clients: list[SGLangHTTPClient], version: str | None,
                     flush_cache: bool) -> None:
        shared = write_shared_bucket(tensors, make_run_directory(self._key), f"weights-{self._token}-bucket{index}")
        try:  # one file per host, mapped by every engine
            payload = EnginePayload((shared.descriptor,), SHM_LOAD_FORMAT)
            self.engines.each(lambda client: self._post(client, payload, version, flush_cache), clients)
        finally:
            shared.remove()

    @staticmethod
    def _post(client: SGLangHTTPClient, payload: EnginePayload, version: str | None, flush_cache: bool) -> None:
        client.update_weights_from_serialized(list(payload.serialized_per_tp_rank), weight_version=version,
                                              flush_cache=flush_cache, load_format=payload.load_format)

    def close(self) -> None:
        if self._key is not None and self.engine_kind == "embedded":
            try:  # empty once every bucket was answered; another sender of the host may still use it
                run_directory(self._key).rmdir()
            except OSError:
                pass


class DistributedTransport:
    """Engines elsewhere: a broadcast group of the sender (rank 0) and every engine TP rank."""

    name = "distributed"

    def __init__(self, engines: EngineSet, engine_tp_size: int, *, backend: str, timeout_s: float,
                 group_name: str = WEIGHT_UPDATE_GROUP, stage: int = 0) -> None:
        """timeout_s: the deadline of the group's creation, and of each bucket's broadcasts and replies."""
        self.engines = engines
        self.engine_tp_size = engine_tp_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.group_name = group_name
        self.stage = stage
        self._group = None
        self._abandoned = None  # a group aborted after a stall, which the engines may still hold

    @property
    def connected(self) -> bool:
        return self._group is not None

    @property
    def group_engines(self) -> tuple[str, ...]:
        """The engines that join the weight-update group."""
        return self.engines.urls

    def _stalled(self, what: str, calls: list[Future], cause: BaseException) -> WeightGroupStallError:
        """Name the engines: those whose call did not end, split by whether they still answer /health (an
        engine waiting inside the group for a stalled peer does; the stalled one does not). The probes run at
        once, each bounded, so many late engines cost one probe's time."""
        late = [url for url, call in zip(self.engines.urls, calls) if not call.done() or call.exception() is not None]
        with ThreadPoolExecutor(max_workers=max(1, len(late)), thread_name_prefix="health-probe") as probes:
            silent = [url for url, answers in zip(late, probes.map(_answers_health, late)) if not answers]
        return WeightGroupStallError(
            f"PP stage {self.stage}: {what} on weight-update group {self.group_name!r} did not complete within "
            f"{self.timeout_s:g}s; engine(s) not answering: {silent}, engine(s) whose call did not end: {late} "
            f"({type(cause).__name__}: {str(cause)[:160]})")

    def connect(self) -> None:
        """Form the group once: every engine joins over HTTP while the sender hosts the rendezvous."""
        from slime.distributed.external_group import (
            ExternalGroupSpec,
            address_towards,
            hosted_store,
            open_external_group,
        )

        if self._abandoned is not None:  # the engines drop their end of it before the group is formed again
            self._leave(self._abandoned)
            self._abandoned = None
        deadline = time.monotonic() + self.timeout_s  # one for the rendezvous and every join
        master = address_towards(urlparse(self.engines.urls[0]).hostname or "127.0.0.1")
        world_size = 1 + len(self.engines.urls) * self.engine_tp_size
        store = hosted_store(master, world_size, datetime.timedelta(seconds=self.timeout_s))  # bound, then told
        spec = ExternalGroupSpec(
            master_address=master, master_port=store.port, world_size=world_size,
            group_name=self.group_name, backend=self.backend, timeout_s=self.timeout_s,
            watchdog_timeout_s=self.timeout_s + NCCL_WATCHDOG_MARGIN_S,  # above every bucket's deadline
        )
        rank_offsets = {client.base_url: 1 + i * self.engine_tp_size for i, client in enumerate(self.engines.clients)}
        joins = self.engines.submit_each(lambda client: client.init_weights_update_group(
            master_address=spec.master_address, master_port=spec.master_port, rank_offset=rank_offsets[client.base_url],
            world_size=spec.world_size, group_name=spec.group_name, backend=spec.backend))
        try:
            group = open_external_group(spec, 0, store=store)  # bounded by spec.timeout_s
        except Exception as exc:
            raise self._stalled("the creation", joins, exc) from exc
        try:
            _await_replies(joins, deadline)
        except Exception as exc:
            group.close()
            raise self._stalled("the creation", joins, exc) from exc
        self._group = group

    def send(self, index: int, tensors: NamedTensors, *, version: str | None, flush_cache: bool) -> None:
        names = [name for name, _ in tensors]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        replies = self.exchange(index, lambda client: client.update_weights_from_distributed(
            names=names, dtypes=dtypes, shapes=shapes, group_name=self.group_name, weight_version=version,
            flush_cache=flush_cache), [tensor.detach().contiguous() for _, tensor in tensors])
        failed = [(url, reply.exception()) for url, reply in zip(self.engines.urls, replies) if reply.exception()]
        if failed:
            raise WeightPushError(f"PP stage {self.stage}, bucket {index}: " + "; ".join(
                f"{url}: {type(exc).__name__}: {str(exc)[:200]}" for url, exc in failed))

    def exchange(self, index: int, call: Callable[[SGLangHTTPClient], Any], tensors: list[torch.Tensor]
                 ) -> list[Future]:
        """One bucket: `call` on every engine (it receives), the tensors broadcast in that order, every reply
        awaited; all of it against one deadline. Returns the replies, every one ended (each may hold an error).
        A stall aborts the group (the next push forms it again) and raises WeightGroupStallError."""
        if self._group is None:
            self.connect()
        deadline = time.monotonic() + self.timeout_s
        replies = self.engines.submit_each(call)
        try:
            self._group.broadcast_all(tensors, deadline=deadline)
            _await_replies(replies, deadline, raise_errors=False)
        except Exception as exc:
            self._drop_group()
            raise self._stalled(f"the broadcast of bucket {index}", replies, exc) from exc
        return replies

    def _drop_group(self) -> None:
        """After a stall: abort the communicator; the next connect (or close) asks the engines to leave it."""
        group, self._group = self._group, None
        if group is not None:
            group.abort()
            self._abandoned = group

    def close(self) -> None:
        group = self._group or self._abandoned
        self._group = self._abandoned = None
        if group is not None:
            self._leave(group)

    def _leave(self, group) -> None:
        """Every engine leaves the group (each call bounded by the client's HTTP timeout), then the sender."""
        try:
            for client, leave in zip(self.engines.clients, self.engines.submit_each(
                    lambda client: client.destroy_weights_update_group(self.group_name))):
                try:
                    leave.result()
                except EngineHTTPError as exc:  # an engine that failed took its end of the group with it
                    logger.warning("weight-update group: %s did not leave it: %s", client.base_url, exc)
        finally:
            group.close()


class NodeSplitTransport:
    """Colocated across nodes, a node sender's two halves: its node's engines by tensor, and the engines of its
    share of the nodes holding none of its PP stage over the stage's weight-update group (node_routes.py)."""

    name = "node_split"

    def __init__(self, local: TensorTransport, remote: DistributedTransport | None) -> None:
        self.local = local
        self.remote = remote

    @property
    def connected(self) -> bool:
        return self.remote is None or self.remote.connected

    @property
    def group_engines(self) -> tuple[str, ...]:
        """The engines that join this sender's weight-update group: the other nodes' (its own take tensors)."""
        return self.remote.group_engines if self.remote is not None else ()

    def connect(self) -> None:
        if self.remote is not None:
            self.remote.connect()

    def send(self, index: int, tensors: NamedTensors, *, version: str | None, flush_cache: bool) -> None:
        self.local.send(index, tensors, version=version, flush_cache=flush_cache)
        if self.remote is not None:
            self.remote.send(index, tensors, version=version, flush_cache=flush_cache)

    def close(self) -> None:
        try:
            self.local.close()
        finally:
            if self.remote is not None:
                self.remote.close()




def _await_replies(calls: list[Future], deadline: float, *, raise_errors: bool = True) -> None:
    """Wait for every call until `deadline` (time.monotonic()); TimeoutError naming how many did not end. With
    raise_errors, the first call that failed raises its error (after all ended)."""
    late = futures_wait(calls, timeout=max(0.0, deadline - time.monotonic())).not_done
    if late:
        raise TimeoutError(f"{len(late)} of {len(calls)} engine call(s) did not end by the deadline")
    for call in calls if raise_errors else ():
        call.result()


def _answers_health(url: str) -> bool:
    client = SGLangHTTPClient(url, ClientTimeouts(control=SERVER_HEALTH_PROBE_S))
    try:
        return client.health()
    finally:
        client.close()
