"""Delta pushes to separate engines (`--update-weight-mode delta`): only what changed since the last push.

Wraps the distributed transport (the same broadcast group and HTTP calls). The sender keeps, on the
host, the tensors every engine accepted last (the baseline); a bucket whose tensors all have a baseline
goes as a delta (sglang_utils/weight_delta.py: changed positions and values, and per tensor the digest
of the result), anything else in full. An engine whose weights are not the baseline (restarted,
retargeted, a failed push) refuses the delta by its digests and loads nothing; the sender logs it and
pushes that bucket in full to every engine (a full push is idempotent for those that took the delta).
The baseline moves only after every engine accepted a bucket, so it never runs ahead of them. A delta bucket
goes through the distributed transport's exchange: one deadline for its broadcasts and replies, a stall named
(WeightGroupStallError), every reply read before an engine's error is raised.
"""
from __future__ import annotations

import logging

import torch

from slime.backends.weight_sync.transport import DistributedTransport, NamedTensors, WeightPushError
from slime.backends.sglang_utils import weight_delta
from slime.backends.sglang_utils.http_client import EngineHTTPError
from slime.utils.checksums import missing_package

logger = logging.getLogger(__name__)


class DeltaTransport:
    """`send` returns the bytes that went over the group (the delta's, or the full bucket's)."""

    name = "distributed-delta"

    def __init__(self, inner: DistributedTransport, *, encoding: str, checksum: str) -> None:
        if encoding not in weight_delta.ENCODINGS:
            raise ValueError(f"--update-weight-delta-encoding {encoding!r}; expected one of {weight_delta.ENCODINGS}")
        missing = missing_package(checksum)
        if missing:
            raise ValueError(f"--update-weight-delta-checksum {checksum} needs the {missing} package: "
                             f"pip install {missing}, or use adler32")
        self.inner = inner
        self.engines = inner.engines
        self.encoding = encoding
        self.checksum = checksum
        self.baseline: dict[str, torch.Tensor] = {}  # name -> what every engine holds (host copy)
        self.fallbacks = 0  # buckets pushed in full because an engine refused their delta

    # the weight-update group is the inner transport's: PP stages connect it in their turn (sync.py)
    @property
    def connected(self) -> bool:
        return self.inner.connected

    @property
    def group_engines(self) -> tuple[str, ...]:
        return self.inner.group_engines

    def connect(self) -> None:
        self.inner.connect()

    def send(self, index: int, tensors: NamedTensors, *, version: str | None, flush_cache: bool) -> int:
        if not tensors or any(name not in self.baseline for name, _ in tensors):
            return self._send_full(index, tensors, version, flush_cache)
        deltas = [weight_delta.encode(tensor, self.baseline[name], self.encoding, self.checksum)
                  for name, tensor in tensors]
        refusals = self._send_delta(index, tensors, deltas, version, flush_cache)
        if refusals:
            self.fallbacks += 1
            logger.warning("delta weight push, bucket %d: %d engine(s) refused it (%s); pushing the bucket in full",
                           index, len(refusals), "; ".join(refusals)[:300])
            return sum(d.nbytes for d in deltas) + self._send_full(index, tensors, version, flush_cache)
        self._keep(tensors)
        return sum(d.nbytes for d in deltas)

    def _send_full(self, index: int, tensors: NamedTensors, version: str | None, flush_cache: bool) -> int:
        self.inner.send(index, tensors, version=version, flush_cache=flush_cache)
        self._keep(tensors)
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def _send_delta(self, index: int, tensors: NamedTensors, deltas: list, version: str | None,
                    flush_cache: bool) -> list[str]:
        """One delta bucket to every engine; the refusals (digest mismatches) by engine."""
        spec = {"encoding": self.encoding, "checksum": self.checksum,
                "tensors": [weight_delta.wire_spec(name, tensor, d) for (name, tensor), d in zip(tensors, deltas)]}
        names = [name for name, _ in tensors]
        # the engines receive in this order (weight_delta: positions, then the values' bytes; gloo has no int16)
        wire = [t for d in deltas if d.positions.numel() for t in (d.positions, d.values.view(torch.uint8))]
        replies = self.inner.exchange(index, lambda client: client.update_weights_from_distributed(
            names=names, dtypes=[], shapes=[], group_name=self.inner.group_name, weight_version=version,
            flush_cache=flush_cache, delta=spec), wire)
        refusals, failures = [], []
        for client, reply in zip(self.engines.clients, replies):
            exc = reply.exception()
            if isinstance(exc, EngineHTTPError) and weight_delta.MISMATCH in str(exc):
                refusals.append(f"{client.base_url}: {str(exc)[-160:]}")
            elif exc is not None:
                failures.append(f"{client.base_url}: {type(exc).__name__}: {str(exc)[:200]}")
        if failures:
            raise WeightPushError(f"PP stage {self.inner.stage}, delta bucket {index}: " + "; ".join(failures))
        return refusals

    def _keep(self, tensors: NamedTensors) -> None:
        for name, tensor in tensors:
            kept = self.baseline.get(name)
            if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
                self.baseline[name] = tensor.detach().to("cpu", copy=True)
            else:
                kept.copy_(tensor.detach())

    def close(self) -> None:
        self.baseline.clear()  # a new connection may reach other engines: the next push is full
        self.inner.close()
