"""The weight sync's bucket plan: the HF tensors a PP stage exports, packed in order into buckets of at most
`--update-weight-buffer-size` bytes. Pure (full shapes, no collectives): the same plan on every rank of a stage,
fenced by its fingerprint before anything is sent, and checked against the export bucket by bucket."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from slime.distributed.fingerprint import stable_hash
from slime.models.hf_weights import export_hf_weights, hf_tensor_shapes, unwrap_model

DEFAULT_BUCKET_BYTES = 512 * 1024**2  # upstream's --update-weight-buffer-size default

NamedTensors = list[tuple[str, torch.Tensor]]
ParamReader = Callable[[torch.Tensor], torch.Tensor]
# (model chunks, hf_config, read_param) -> HF-named tensors in export order, with the same TP collectives
# on every exporter of a TP group.
WeightSource = Callable[[Sequence[torch.nn.Module], Any, "ParamReader | None"], Iterable[tuple[str, torch.Tensor]]]


def export_model_weights(model_chunks: Sequence[torch.nn.Module], hf_config: Any, read_param: ParamReader | None = None,
                         select: Callable[[str], bool] | None = None) -> Iterable[tuple[str, torch.Tensor]]:
    """The default weight source: HF tensors gathered over TP from the model chunks' parameters, each read
    through `read_param` (a sleeping trainer serves them from its host copy); `select` keeps a subset by megatron
    name (a source passed to WeightSync with a `select` must take it too). The engines do not run the
    multi-token-prediction layers: those stay out of the push."""
    return export_hf_weights(list(model_chunks), hf_config, read_param=read_param, mtp=False, select=select)


class WeightSyncPlanError(RuntimeError):
    """The exported tensors do not follow the bucket plan (name, order or size)."""


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class WeightBucket:
    """HF tensors sent to the engines in one request, in export order."""

    index: int
    hf_names: tuple[str, ...]
    nbytes: int
    tensor_nbytes: tuple[int, ...] = ()
    """Bytes of each tensor of hf_names (same order); sums to nbytes."""


@dataclass(frozen=True)
class WeightSyncPlan:
    """The buckets of one PP stage. Identical on every rank of the stage (built from full shapes)."""

    buckets: tuple[WeightBucket, ...]
    total_bytes: int
    pp_rank: int

    def names(self) -> tuple[str, ...]:
        return tuple(name for bucket in self.buckets for name in bucket.hf_names)

    def fingerprint_fields(self) -> dict[str, Any]:
        layout = [(b.hf_names, b.tensor_nbytes) for b in self.buckets]
        return {
            "weight_sync_pp_rank": self.pp_rank,
            "weight_sync_buckets": len(self.buckets),
            "weight_sync_total_bytes": self.total_bytes,
            "weight_sync_plan": stable_hash(layout),
        }


def pack_buckets(sizes: Iterable[tuple[str, int]], bucket_bytes: int) -> tuple[WeightBucket, ...]:
    """Greedy, order-keeping packing: a bucket closes before the tensor that would overflow it.
    A tensor larger than the budget gets a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[WeightBucket] = []
    names: list[str] = []
    sizes_in_bucket: list[int] = []

    def close() -> None:
        buckets.append(WeightBucket(len(buckets), tuple(names), sum(sizes_in_bucket), tuple(sizes_in_bucket)))
        names.clear()
        sizes_in_bucket.clear()

    for name, nbytes in sizes:
        if names and sum(sizes_in_bucket) + nbytes > bucket_bytes:
            close()
        names.append(name)
        sizes_in_bucket.append(nbytes)
    if names:
        close()
    return tuple(buckets)


def hf_tensor_sizes(model_chunks: Sequence[torch.nn.Module], hf_config: Any, *, tp_size: int,
                    select: Callable[[str], bool] | None = None) -> list[tuple[str, int]]:
    """(hf_name, bytes) in export_hf_weights' order, without collectives or copies.

    Exact: the mapping's to_hf runs on a meta tensor of the full (TP-gathered) shape, so fused
    parameters (qkv, gate/up), vocab padding and every EP rank's experts give the real export's shapes.
    """
    return [(name, t.numel() * t.element_size()) for chunk in model_chunks
            for name, t in hf_tensor_shapes(unwrap_model(chunk), hf_config, tp_size, all_experts=True,
                                            mtp=False, select=select)]


def build_weight_sync_plan(model_chunks: Sequence[torch.nn.Module], hf_config: Any, *, tp_size: int,
                           bucket_bytes: int, pp_rank: int = 0, select: Callable[[str], bool] | None = None
                           ) -> WeightSyncPlan:
    """The bucket plan of this PP stage. Pure: same inputs, same plan, on every rank of the stage."""
    buckets = pack_buckets(hf_tensor_sizes(model_chunks, hf_config, tp_size=tp_size, select=select), bucket_bytes)
    return WeightSyncPlan(buckets, sum(b.nbytes for b in buckets), pp_rank)


def iter_planned_buckets(plan: WeightSyncPlan, exported: Iterable[tuple[str, torch.Tensor]]
                         ) -> Iterator[tuple[WeightBucket, NamedTensors]]:
    """Group the exported stream into the plan's buckets; raise at the first deviation from the plan."""
    stream = iter(exported)
    for bucket in plan.buckets:
        tensors: NamedTensors = []
        for position, (name, nbytes) in enumerate(zip(bucket.hf_names, bucket.tensor_nbytes)):
            got = next(stream, None)
            where = f"bucket {bucket.index} position {position}"
            if got is None:
                raise WeightSyncPlanError(f"{where}: plan expects {name!r}, the export ended")
            got_bytes = got[1].numel() * got[1].element_size()
            if got[0] != name or got_bytes != nbytes:
                raise WeightSyncPlanError(
                    f"{where}: plan expects {name!r} ({nbytes} bytes), export gave {got[0]!r} ({got_bytes} bytes)")
            tensors.append(got)
        yield bucket, tensors
    extra = next(stream, None)
    if extra is not None:
        raise WeightSyncPlanError(f"export gave {extra[0]!r} after the plan's last tensor")
