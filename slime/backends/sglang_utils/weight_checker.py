"""SGLang's `POST /weights_checker` with `{"action": "checksum"}`: what each engine GPU holds, tensor by tensor.

The body is SGLang's CheckWeightsReqInput; the answer (SGLang 0.5.15 to 0.5.23) is
`{"success", "message", "ranks": [ChecksumInfo, ...], "per_engine_checksum"}`, one ChecksumInfo per GPU:
`{"checksums": {name: checksum}, "per_gpu_checksum", "parallelism_info"}` (a dict in 0.5.15, a list of one
dict per runner role since 0.5.21). What a checksum is differs by server: SGLang hashes each parameter and
buffer of its own model (its names: fused qkv / gate_up, TP shards) with its own hash; the embedded engine
serves tensor_digest.py's digests under the names the trainer pushes (`<dtype>:<hex>`), which the trainer can
recompute. Both ends read this module.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

ROUTE = "/weights_checker"
CHECKSUM_ACTION = "checksum"
# CheckWeightsReqInput's fields (0.5.23; 0.5.15 has the first two)
REQUEST_FIELDS = frozenset({"action", "allow_quant_error", "skip_tensor_list", "selector"})


def checksum_request() -> dict[str, Any]:
    return {"action": CHECKSUM_ACTION}


def overall_checksum(checksums: Mapping[str, str]) -> str:
    """One checksum over a GPU's (name, checksum) pairs in name order (SGLang's per_gpu_checksum)."""
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(name.encode())
        digest.update(checksums[name].encode())
    return digest.hexdigest()


def checksum_response(checksums: Mapping[str, str]) -> dict[str, Any]:
    """The answer of a one-GPU engine (TP, DP, PP 1) in SGLang 0.5.23's shape."""
    per_gpu = overall_checksum(checksums)
    placement = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                 "pp_size": 1, "rank": 0, "size": 1}
    return {"success": True, "message": "Success.",
            "ranks": [{"checksums": dict(checksums), "per_gpu_checksum": per_gpu, "parallelism_info": [placement]}],
            "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest()}


@dataclass(frozen=True)
class EngineChecksums:
    """One engine's answer: per GPU (its (tp, dp, pp) ranks), name -> checksum."""

    per_gpu: Mapping[tuple[int, int, int], Mapping[str, str]]

    @property
    def single(self) -> Mapping[str, str]:
        """The checksums of a one-GPU engine."""
        if len(self.per_gpu) != 1:
            raise ValueError(f"expected one GPU's checksums, the engine reported {len(self.per_gpu)}")
        return next(iter(self.per_gpu.values()))


def parse_checksum_response(body: Any) -> EngineChecksums:
    if not isinstance(body, dict) or not body.get("success") or not isinstance(body.get("ranks"), list):
        raise ValueError(f"not a /weights_checker checksum answer: {str(body)[:200]}")
    per_gpu = {}
    for entry in body["ranks"]:
        info = entry["parallelism_info"]
        info = info[0] if isinstance(info, list) else info  # a list of roles since 0.5.21
        per_gpu[(int(info["tp_rank"]), int(info["dp_rank"]), int(info["pp_rank"]))] = dict(entry["checksums"])
    return EngineChecksums(per_gpu)
