"""Where one engine runs: the bundles, node and GPUs the driver's placement gave it (slime/ray/driver/placement.py),
which its Ray actor starts on and the rollout manager waits for."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EngineSlot:
    """The bundles of one engine on one node; its Ray actor runs on the first. An engine over several nodes is the
    slot of its node rank 0 (the process that serves HTTP), its other nodes' slots in `followers`."""

    rank: int
    bundles: tuple[int, ...]
    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...] = ()
    node_rank: int = 0
    """This slot's SGLang --node-rank within its engine."""
    followers: tuple["EngineSlot", ...] = ()
    """The slots of node ranks 1.. (empty: the engine lies within one node)."""

    @property
    def parts(self) -> tuple["EngineSlot", ...]:
        """Every node's slot, node rank 0 first."""
        return (self, *self.followers)

    @property
    def nnodes(self) -> int:
        return 1 + len(self.followers)
