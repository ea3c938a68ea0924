"""Which weight versions a rollout's samples were generated with, and how far behind the engines they are.

Every /generate reply carries the engine's `weight_version` in meta_info (SGLang's field); each sample
keeps one entry per reply (`Sample.weight_versions`). A sample continued across a weight push
(--partial-rollout) holds several; its oldest one is its version here. Non-numeric versions (an
engine that never received a push reports "default") count as no version.
"""
from __future__ import annotations

from typing import Sequence

from slime.utils.types import Sample


def numeric_versions(sample: Sample) -> list[int]:
    return [int(v) for v in sample.weight_versions if str(v).isdigit()]


def sample_version(sample: Sample) -> int | None:
    """The oldest weight version that generated part of the sample (None: none reported)."""
    versions = numeric_versions(sample)
    return min(versions) if versions else None


def group_version(group: Sequence[Sample]) -> int | None:
    versions = [v for v in (sample_version(s) for s in group) if v is not None]
    return min(versions) if versions else None


def version_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """rollout/weight_version_{min,max}: the versions the rollout was generated with; multi_version_frac:
    samples whose tokens came from more than one version (continued across a push)."""
    versions = [v for v in (sample_version(s) for s in samples) if v is not None]
    if not versions:
        return {}
    multi = sum(1 for s in samples if len(set(numeric_versions(s))) > 1)
    return {"rollout/weight_version_min": float(min(versions)), "rollout/weight_version_max": float(max(versions)),
            "rollout/staleness/multi_version_frac": multi / len(samples)}
