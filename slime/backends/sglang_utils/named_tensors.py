"""The project's wire format for `/update_weights_from_tensor` on the embedded engine.

Named tensors travel as one safetensors blob (no pickle: the receiver never executes sender
data), base64-encoded so it fits SGLang's JSON field `serialized_named_tensors: list[str]`
(one entry per engine TP rank). The sender's order is kept in the blob's metadata because
safetensors itself sorts by name.
"""

from __future__ import annotations

import base64
import json

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

_ORDER_KEY = "slime_tensor_order"


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    names = [name for name, _ in named_tensors]
    if len(set(names)) != len(names):
        raise ValueError("serialize_named_tensors: duplicate tensor names")
    # safetensors needs contiguous CPU tensors that own their storage.
    payload = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in named_tensors}
    blob = safetensors_save(payload, metadata={_ORDER_KEY: json.dumps(names)})
    return base64.b64encode(blob).decode("ascii")


def deserialize_named_tensors(serialized: str | bytes) -> list[tuple[str, torch.Tensor]]:
    blob = base64.b64decode(serialized)
    tensors = safetensors_load(blob)
    order = _read_order(blob) or sorted(tensors)
    return [(name, tensors[name]) for name in order]


def _read_order(blob: bytes) -> list[str] | None:
    # safetensors layout: 8-byte little-endian header size, then the JSON header.
    header_size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + header_size])
    order = header.get("__metadata__", {}).get(_ORDER_KEY)
    return json.loads(order) if order else None
