"""Each sample's sampling seed, a pure function of --seed, the rollout id and the sample's index.

It travels as SGLang's `sampling_seed` sampling parameter, so what a sample generates does not depend
on which engine the router sends it to, on what else that engine batches with it, or on whether the
run was resumed: the embedded engine draws every token of a seeded request from (seed, position)
alone (slime/backends/embedded_engine/sampling.py). SGLang engines honour it under SGLang's
--enable-deterministic-inference (pass --sglang-enable-deterministic-inference).
"""
from __future__ import annotations

import hashlib
from typing import Any

from slime.rollout.plugin_args import flag

SEED_RANGE = 2**31 - 1  # a positive int32: SGLang declares sampling_seed an integer


def sample_seed(seed: int, rollout_id: int | None, sample_index: int, evaluation: bool) -> int:
    text = f"{int(seed)}:{-1 if rollout_id is None else int(rollout_id)}:{int(sample_index)}:{int(evaluation)}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") % SEED_RANGE


def seeded_params(args, params: dict[str, Any], rollout_id: int | None, sample_index: int | None,
                  evaluation: bool) -> dict[str, Any]:
    """params with this sample's sampling_seed (unchanged when the sample has no index or a seed is set)."""
    if sample_index is None or params.get("sampling_seed") is not None:
        return params
    return {**params, "sampling_seed": sample_seed(flag(args, "seed"), rollout_id, sample_index, evaluation)}
