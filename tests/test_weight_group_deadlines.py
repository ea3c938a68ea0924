"""Weight-update group waits end at the sender's deadline with a named error, on NCCL as on gloo.

On NCCL, `work.wait()` does not block the CPU, so the sender polls each broadcast's completion against its
deadline and, past it, aborts the communicator (slime/distributed/external_group.py). NCCL cannot run here: a
stand-in work object behaves as NCCL's does for a stalled peer (wait() returns at once, is_completed() stays
false), next to gloo's own path. Joins and replies are awaited against one deadline, and the error names every
late engine, full pushes and delta pushes alike (slime/backends/weight_sync/transport.py).
"""
from __future__ import annotations

import datetime
import threading
import time
import types

import pytest
import torch

from slime.backends.weight_sync import transport as transport_module
from slime.backends.weight_sync.delta import DeltaTransport
from slime.backends.weight_sync.transport import DistributedTransport, EngineSet, WeightGroupStallError, WeightPushError
from slime.backends.sglang_utils import weight_delta
from slime.backends.sglang_utils.http_client import ClientTimeouts
from slime.distributed import external_group
from slime.distributed.external_group import CollectiveStallError, ExternalGroup, ExternalGroupSpec, await_completion
from slime.utils.ports import find_free_port

pytestmark = pytest.mark.timeout(60)


class NcclLikeWork:
    """A collective as NCCL reports it to the CPU: wait() returns at once; is_completed() once the GPU finished
    (never, for a stalled peer; `done_at` seconds after it was issued, for a slow one)."""

    def __init__(self, done_at: float | None = None, error: Exception | None = None) -> None:
        self.issued = time.monotonic()
        self.done_at = done_at
        self.error = error
        self.waited = False

    def is_completed(self) -> bool:
        return self.done_at is not None and time.monotonic() - self.issued >= self.done_at

    def wait(self, timeout=None) -> bool:
        self.waited = True
        if self.error is not None and self.is_completed():
            raise self.error
        return True


class StandInGroup:
    """A ProcessGroup whose broadcasts return `work()`; records aborts."""

    def __init__(self, work) -> None:
        self.work = work
        self.broadcasts: list[torch.Tensor] = []
        self.aborted = False

    def broadcast(self, tensor, root):
        self.broadcasts.append(tensor)
        return self.work()

    def abort(self) -> None:
        self.aborted = True

    def shutdown(self) -> None:
        pass


def _group(work, timeout_s=1.0) -> ExternalGroup:
    spec = ExternalGroupSpec(master_address="127.0.0.1", master_port=1, world_size=3, group_name="g",
                             backend="nccl", timeout_s=timeout_s)
    return ExternalGroup(StandInGroup(work), store=None, rank=0, spec=spec)


# ----------------------------------------------------------------------------- the poll
def test_a_broadcast_that_never_completes_ends_at_the_deadline_with_the_communicator_aborted():
    group = _group(NcclLikeWork)
    start = time.monotonic()
    with pytest.raises(CollectiveStallError, match="2 of 2 collective"):
        group.broadcast_all([torch.ones(3), torch.ones(2)], deadline=start + 0.3)
    assert 0.3 <= time.monotonic() - start < 5
    assert group.group.aborted and len(group.group.broadcasts) == 2  # both issued before the wait


def test_a_broadcast_that_completes_late_but_in_time_returns():
    group = _group(lambda: NcclLikeWork(done_at=0.2))
    group.broadcast_all([torch.ones(3)], deadline=time.monotonic() + 5)
    assert not group.group.aborted


def test_a_failed_collective_raises_its_own_error():
    works = [NcclLikeWork(done_at=0.0), NcclLikeWork(done_at=0.0, error=RuntimeError("peer closed"))]
    with pytest.raises(RuntimeError, match="peer closed"):
        await_completion(works, time.monotonic() + 5)
    assert all(work.waited for work in works)


def test_gloo_broadcast_to_a_peer_that_never_receives_ends_at_the_deadline():
    """The real gloo path: the engine's rank joined the group but does not take part in the broadcast."""
    store = external_group.hosted_store("127.0.0.1", 2, datetime.timedelta(seconds=10))
    spec = ExternalGroupSpec(master_address="127.0.0.1", master_port=store.port, world_size=2,
                             group_name="stall", backend="gloo", timeout_s=3.0)
    joined = {}
    peer = threading.Thread(target=lambda: joined.update(peer=external_group.open_external_group(spec, 1)))
    peer.start()
    sender = external_group.open_external_group(spec, 0, store=store)
    peer.join(timeout=10)
    start = time.monotonic()
    with pytest.raises(CollectiveStallError):  # 64 MiB: more than the sockets buffer without a receiver
        sender.broadcast_all([torch.zeros(16 * 1024**2)], deadline=start + 0.5)
    assert time.monotonic() - start < 2.5  # the sender's deadline, not gloo's own 3 s
    joined["peer"].broadcast(torch.zeros(16 * 1024**2), 0)  # the peer takes it now: nothing is left pending


# ----------------------------------------------------------------------------- the transport
class SlowEngine:
    """An engine's HTTP side: `/update_weights_from_distributed` and `/init_weights_update_group` answer when
    `release` is set (an engine waiting inside the group), or at once with `error`."""

    def __init__(self, release: threading.Event, error: str | None = None, late: bool = True) -> None:
        self.release = release
        self.error = error
        self.late = late
        self.routes: list[str] = []

    def request(self, method, url, json=None, timeout=None):
        self.routes.append("/" + url.split("//", 1)[1].partition("/")[2])
        if self.late:
            self.release.wait(timeout=30)
        if self.error:
            return types.SimpleNamespace(status_code=400, json=lambda: {"message": self.error}, text=self.error)
        return types.SimpleNamespace(status_code=200, json=lambda: {"success": True}, text="")

    def close(self) -> None:
        pass


@pytest.fixture
def release():
    event = threading.Event()
    yield event
    event.set()  # the engines' calls end; their threads go


def _transport(engines: list[SlowEngine], work, timeout_s: float = 0.5, stage: int = 1):
    urls = tuple(f"http://127.0.0.1:{find_free_port()}" for _ in engines)  # nothing listens: /health fails
    engine_set = EngineSet(urls, ClientTimeouts())
    for client, engine in zip(engine_set.clients, engines):
        client._session = engine
    transport = DistributedTransport(engine_set, 1, backend="nccl", timeout_s=timeout_s,
                                     group_name="slime_weight_update_pp1", stage=stage)
    object.__setattr__(transport, "_group", _group(work))
    return transport, urls


def test_a_stalled_bucket_is_named_by_stage_and_engines(release):
    engines = [SlowEngine(release), SlowEngine(release)]
    transport, urls = _transport(engines, NcclLikeWork)
    group = transport._group
    with pytest.raises(WeightGroupStallError) as err:
        transport.send(3, [("w", torch.ones(4)), ("b", torch.ones(2))], version="2", flush_cache=True)
    message = str(err.value)
    assert message.startswith("PP stage 1: the broadcast of bucket 3 on weight-update group")
    assert f"engine(s) not answering: {list(urls)}" in message and "CollectiveStallError" in message
    assert group.group.aborted and not transport.connected  # formed again by the next push
    release.set()  # the engines answer again: closing asks each to leave the aborted group
    transport.close()
    left = ["/update_weights_from_distributed", "/destroy_weights_update_group"]
    assert [engine.routes for engine in engines] == [left, left]


@pytest.fixture
def no_health_wait(monkeypatch):
    """The /health probes that name the silent engines answer at once: a port found free here can be bound by
    another test's server meanwhile, and a probe to it would add its own bound to the deadline timed below."""
    monkeypatch.setattr(transport_module, "_answers_health", lambda url: False)


def test_late_replies_share_the_bucket_deadline_and_are_all_named(release, no_health_wait):
    """The broadcasts completed; two engines never answer: one deadline for both, not one each."""
    transport, urls = _transport([SlowEngine(release), SlowEngine(release), SlowEngine(release, late=False)],
                                 lambda: NcclLikeWork(done_at=0.0), timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(WeightGroupStallError, match="2 of 3 engine call") as err:
        transport.send(0, [("w", torch.ones(4))], version=None, flush_cache=False)
    assert time.monotonic() - start < 1.9  # one deadline of 1 s (each engine its own would be 2 s)
    assert f"engine(s) whose call did not end: {list(urls[:2])}" in str(err.value)


def test_the_delta_path_goes_through_the_same_stall_handling(release):
    transport, urls = _transport([SlowEngine(release), SlowEngine(release)], NcclLikeWork)
    delta = DeltaTransport(transport, encoding="xor", checksum="adler32")
    delta.baseline["w"] = torch.zeros(8)
    with pytest.raises(WeightGroupStallError, match="PP stage 1: the broadcast of bucket 5"):
        delta.send(5, [("w", torch.arange(8.0))], version="3", flush_cache=True)
    assert len(transport.engines.clients) == 2 and delta.baseline["w"].sum() == 0  # the baseline did not move


def test_engine_errors_are_read_from_every_engine_and_named_together(release):
    full, urls = _transport([SlowEngine(release, "bad dtype", late=False), SlowEngine(release, "no group", late=False)],
                            lambda: NcclLikeWork(done_at=0.0))
    with pytest.raises(WeightPushError) as err:
        full.send(2, [("w", torch.ones(4))], version=None, flush_cache=False)
    assert all(url in str(err.value) for url in urls) and "bad dtype" in str(err.value)
    delta_inner, urls = _transport([SlowEngine(release, weight_delta.MISMATCH + ": w", late=False),
                                    SlowEngine(release, "no group", late=False)], lambda: NcclLikeWork(done_at=0.0))
    delta = DeltaTransport(delta_inner, encoding="xor", checksum="adler32")
    delta.baseline["w"] = torch.zeros(8)
    with pytest.raises(WeightPushError, match=f"delta bucket 4: {urls[1]}: EngineHTTPError") as err:
        delta.send(4, [("w", torch.arange(8.0))], version=None, flush_cache=False)
    assert urls[0] not in str(err.value)  # a refused delta is no error: that engine would take the bucket in full


def test_joins_share_one_deadline_and_every_late_engine_is_named(release, monkeypatch, no_health_wait):
    """Three engines that never finish joining: the creation ends after one deadline, naming all three."""
    transport, urls = _transport([SlowEngine(release) for _ in range(3)], NcclLikeWork, timeout_s=0.6)
    object.__setattr__(transport, "_group", None)
    monkeypatch.setattr(external_group, "open_external_group", lambda spec, rank, store=None: _group(NcclLikeWork))
    start = time.monotonic()
    with pytest.raises(WeightGroupStallError) as err:
        transport.connect()
    assert time.monotonic() - start < 1.5  # one deadline of 0.6 s (one each would be 1.8 s)
    assert err.value.args[0].startswith("PP stage 1: the creation")
    assert f"engine(s) whose call did not end: {list(urls)}" in str(err.value)
