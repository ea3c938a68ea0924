"""Which transport a run's weight sync uses and how it is built: the one place that knows every kind
(transport.py's tensor and distributed pushes, delta.py's deltas over the distributed one)."""
from __future__ import annotations

from typing import Any

import torch

from slime.backends.weight_sync.delta import DeltaTransport
from slime.backends.weight_sync.transport import WEIGHT_UPDATE_GROUP, DistributedTransport, EngineSet, TensorTransport
from slime.config.weight_sync import DeltaOptions

TRANSPORTS = ("tensor", "distributed")


def choose_transport(args: Any) -> str:
    """'tensor' for colocated engines, 'distributed' for engines elsewhere (upstream's choice)."""
    if args.update_weight_transport != "nccl":
        raise ValueError(f"--update-weight-transport {args.update_weight_transport!r} is not implemented; use nccl")
    return "tensor" if args.colocate else "distributed"


def build_transport(kind: str, engines: EngineSet, *, engine_kind: str, engine_tp_size: int, timeout_s: float,
                    device: torch.device | None = None, pp_rank: int = 0, delta: DeltaOptions | None = None):
    if kind == "tensor":
        if delta is not None:
            raise ValueError("--update-weight-mode delta is for separate engines; colocated engines take tensors")
        return TensorTransport(engines, engine_kind, engine_tp_size)
    if kind == "distributed":
        on_gpu = device is not None and device.type == "cuda"
        transport = DistributedTransport(engines, engine_tp_size, backend="nccl" if on_gpu else "gloo",
                                         timeout_s=timeout_s, group_name=f"{WEIGHT_UPDATE_GROUP}_pp{pp_rank}",
                                         stage=pp_rank)
        if delta is None:
            return transport
        if engine_kind != "embedded":
            raise ValueError("--update-weight-mode delta needs engines that apply deltas (the embedded engine); "
                             "SGLang engines take full pushes: drop --update-weight-mode delta")
        return DeltaTransport(transport, encoding=delta.encoding, checksum=delta.checksum)
    raise ValueError(f"unknown weight transport {kind!r}; expected one of {TRANSPORTS}")
