"""The weight-sync options of the run config: how `--update-weight-mode delta` encodes and checks its deltas
(``DeltaOptions``), derived from the flags once by ``build_run_config`` (run_config.py) and taken as they are by
slime/backends/weight_sync/."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeltaOptions:
    """`--update-weight-mode delta`: how deltas are encoded and checked (sglang_utils/weight_delta.py)."""

    encoding: str
    """--update-weight-delta-encoding."""
    checksum: str
    """--update-weight-delta-checksum."""


def build_delta_options(args: Any) -> DeltaOptions | None:
    """The delta options of checked flags; None: full pushes (--update-weight-mode full)."""
    if args.update_weight_mode != "delta":
        return None
    return DeltaOptions(args.update_weight_delta_encoding, args.update_weight_delta_checksum)
