"""Process groups shared with processes outside the training world (the rollout engines).

SGLang's distributed weight update (`/init_weights_update_group`) forms a group of the trainer's
sender (rank 0) and every engine TP rank (rank_offset + tp_rank) through a TCP rendezvous at
`master_address:master_port`, keyed by `group_name`. The group lives beside the training world:
it is never the default group and never one of megatron's, so creating or destroying it does not
touch the communicators of the step.

The same function serves both sides: the trainer hosts the store (rank 0), an engine joins it.

The sender's broadcasts are bounded in Python (`broadcast_all`): it polls each collective's completion against
its deadline and, past it, aborts the communicator and raises CollectiveStallError. On NCCL `work.wait()` does
not block the CPU (it orders the current CUDA stream after the collective), so without the poll a stalled peer
would surface only when NCCL's watchdog ends the whole process; the sender sets that watchdog's limit above its
own deadline (`watchdog_timeout_s`) so that the named error comes first.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch.distributed as dist

from slime.utils.ports import listening_socket

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True, kw_only=True)
class ExternalGroupSpec:
    """Where and how the weight-update group meets (the fields of SGLang's InitWeightsUpdateGroupReqInput)."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float
    """Deadline of the rendezvous and of every collective on the group."""
    watchdog_timeout_s: float | None = None
    """NCCL only: the communicator's own limit on one collective, past which its watchdog ends the process (None:
    timeout_s). A member that polls its collectives against timeout_s sets it higher."""


class CollectiveStallError(TimeoutError):
    """Collectives on an external group did not complete by their deadline; the communicator was aborted."""


_POLL_FIRST_S = 1e-4
_POLL_MAX_S = 5e-3


def await_completion(works: Sequence, deadline: float, *, clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once every work completed, or raise CollectiveStallError past `deadline` (on `clock`). A work that
    ended with an error raises it (is_completed() is true for a failed work too; its wait() raises)."""
    for done, work in enumerate(works):
        delay = _POLL_FIRST_S  # short polls again for each work: a bucket's collectives end one after another
        while not work.is_completed():
            if clock() >= deadline:
                raise CollectiveStallError(f"{len(works) - done} of {len(works)} collective(s) not completed "
                                           "by the deadline")
            sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)
        work.wait()


@dataclass(frozen=True)
class ExternalGroup:
    group: dist.ProcessGroup
    store: dist.Store
    """Kept alive with the group: rank 0 serves the rendezvous from it."""
    rank: int
    spec: ExternalGroupSpec

    def broadcast(self, tensor, root: int = 0) -> None:
        """Broadcast in place from `root` (a receiving engine's side). On gloo the CPU waits, up to the group's
        timeout; on NCCL the current stream is ordered after it and the CPU goes on."""
        self.group.broadcast(tensor, root).wait()

    def broadcast_all(self, tensors: Sequence, *, deadline: float, root: int = 0) -> None:
        """Broadcast each tensor in place from `root`, in order; return once all completed. Past `deadline`
        (time.monotonic()): abort the communicator (the group is unusable after) and raise CollectiveStallError."""
        works = [self.group.broadcast(tensor, root) for tensor in tensors]
        try:
            await_completion(works, deadline)
        except CollectiveStallError:
            self.abort()
            raise

    def abort(self) -> None:
        """End the communicator now: NCCL aborts it (its pending collectives end); gloo's end at its timeout."""
        self.group.abort()

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            shutdown()


def hosted_store(host: str, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCP store served on `host`, on a port the kernel picks as it binds (`.port`): no other process can
    take the port between choosing and binding it. The store owns the listening socket."""
    sock = listening_socket(host)
    port = sock.getsockname()[1]
    return dist.TCPStore(host.strip("[]"), port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def open_external_group(spec: ExternalGroupSpec, rank: int, store: dist.TCPStore | None = None) -> ExternalGroup:
    """Join (rank > 0) or host (rank 0) the group; returns once all `world_size` ranks arrived.
    `store`: rank 0's `hosted_store` (else rank 0 binds spec.master_port itself).

    Raises on the deadline (torch's DistStoreError / RuntimeError), never blocks past it.
    """
    if spec.backend not in BACKENDS:
        raise ValueError(f"weight-update group backend {spec.backend!r}; expected one of {BACKENDS}")
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank} outside a weight-update group of {spec.world_size}")
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(spec.master_address, spec.master_port, spec.world_size, is_master=rank == 0,
                              timeout=timeout, wait_for_workers=False)
    # torch's own groups key their rendezvous as "<group_name>/": the same prefix meets SGLang's side.
    prefixed = dist.PrefixStore(f"{spec.group_name}/", store)
    if spec.backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=spec.watchdog_timeout_s or spec.timeout_s)
        group = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
    return ExternalGroup(group, store, rank, spec)


def address_towards(host: str) -> str:
    """This machine's address as seen from `host` (loopback for a local peer). Sends no packet."""
    if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP connect only picks the route
        return probe.getsockname()[0]
