"""The rollout batch: the dict of per-sample lists, in rollout order, that the rollout manager hands to every
trainer rank and that the ranks complete in place. `RolloutBatch` lists every key, its type and who adds it:

  manager   the rollout manager's conversion (slime/rollout/train_data.py, or --custom-convert-samples-to-train-
            data-path), before the batch leaves for the ranks; every rank receives the same batch
  actor     the actor's ranks: log-probs in the log-prob phase, then the advantages (slime/algorithms/advantages.py)
  critic    the critic's ranks (--advantage-estimator ppo): the values, and its own returns
  hooks     --custom-advantage-function-path writes the advantages and returns instead of the actor;
            --rollout-data-postprocess-path may rewrite any key (slime/backends/megatron_utils/hook_fence.py)

The key sets the code checks come from here: the keys a conversion must return (`REQUIRED_KEYS`) and those whose
values differ between DP replicas (`PER_DP_RANK_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, TypedDict, get_type_hints

MANAGER, ACTOR, CRITIC, HOOKS = "manager", "actor", "critic", "hooks"


@dataclass(frozen=True)
class Key:
    """Who adds a batch key, and how its values spread over the ranks."""

    added_by: tuple[str, ...]
    required: bool = False
    """Every batch the manager hands over holds it (a custom conversion must return it)."""
    per_dp_rank: bool = False
    """With DP > 1 each DP rank fills it for its own samples only ([] for the others', unless the estimator uses
    the whole rollout): the values differ between DP replicas by design, never within one DP rank."""


class RolloutBatch(TypedDict, total=False):
    """The rollout batch (upstream's `slime.utils.types.RolloutBatch`); per-token values are one per response
    token."""

    tokens: Annotated[list[list[int]], Key((MANAGER,), required=True)]
    """prompt + response token ids"""
    response_lengths: Annotated[list[int], Key((MANAGER,), required=True)]
    rewards: Annotated[list[float], Key((MANAGER,), required=True)]
    """post-processed: group-normalised for the estimators whose record says so"""
    raw_reward: Annotated[list[float], Key((MANAGER,), required=True)]
    """the graders' scalar reward"""
    truncated: Annotated[list[int], Key((MANAGER,), required=True)]
    """1 when the engine stopped on the length limit"""
    sample_indices: Annotated[list[int], Key((MANAGER,), required=True)]
    """Sample.index (global id)"""
    loss_masks: Annotated[list[list[int]], Key((MANAGER,), required=True)]
    """per response token (all 0 for removed samples)"""
    rollout_log_probs: Annotated[list[list[float]], Key((MANAGER,))]
    """the engines' log-probs of the response tokens (only when every sample has them)"""
    rollout_routed_experts: Annotated[list[str], Key((MANAGER,))]
    """the engines' routes (base64 int32 [tokens, MoE layers, top-k]; routing replay)"""
    multimodal_train_inputs: Annotated[list[dict | None], Key((MANAGER,))]
    """upstream's key and form, when any sample has images: per sample the processor's {"pixel_values": float
    [patches, C x T x P x P], "image_grid_thw": int64 [images, 3]}, or None for a text sample; a prompt's samples
    share the tensors (read-only). Image tokens are those equal to the config's image_token_id, grid_t x grid_h x
    grid_w / merge_size^2 of them per image (docs/multimodal.md)"""
    log_probs: Annotated[list[list[float]], Key((ACTOR,), per_dp_rank=True)]
    """the trainer's old-policy log-probs"""
    ref_log_probs: Annotated[list[list[float]], Key((ACTOR,), per_dp_rank=True)]
    """the reference model's (KL loss, KL reward shaping)"""
    teacher_log_probs: Annotated[list[list[float]], Key((MANAGER, ACTOR), per_dp_rank=True)]
    """a distillation teacher's: its engine's (--opd-type sglang, every sample) or the trainer's copy (megatron)"""
    values: Annotated[list[list[float]], Key((CRITIC,))]
    """the critic's value of every response token (shared over DP)"""
    advantages: Annotated[list[list[float]], Key((ACTOR, HOOKS), per_dp_rank=True)]
    returns: Annotated[list[list[float]], Key((ACTOR, CRITIC, HOOKS), per_dp_rank=True)]
    opd_reverse_kl: Annotated[list[list[float]], Key((ACTOR,), per_dp_rank=True)]
    """--use-opd: student - teacher log-prob per token (written with the advantages)"""


BATCH_KEYS: dict[str, Key] = {name: hint.__metadata__[0]
                              for name, hint in get_type_hints(RolloutBatch, include_extras=True).items()}
REQUIRED_KEYS: tuple[str, ...] = tuple(name for name, key in BATCH_KEYS.items() if key.required)
PER_DP_RANK_KEYS: tuple[str, ...] = tuple(name for name, key in BATCH_KEYS.items() if key.per_dp_rank)
