"""PPO-family math: KL estimators, clipped policy loss, entropy, returns and advantages.

Function names and semantics follow upstream slime so plugins and configs carry over.
Tensors are per-token and 1-D unless stated; functions are pure except the vocab-parallel
helpers, which all-reduce over the tensor-parallel group they are given.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


# ------------------------------------------------------------------------- KL / loss


def compute_approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, kl_loss_type: str) -> torch.Tensor:
    """Per-token KL(pi || pi_base) estimate (Schulman's k1, k2, k3).

    k1: log r; k2: (log r)^2 / 2; k3 / low_var_kl: r' - 1 - log r' with r' = pi_base/pi,
    an unbiased, non-negative estimator; low_var_kl is additionally clamped to [-10, 10].
    """
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_loss_type == "k1":
        return log_ratio
    if kl_loss_type == "k2":
        return log_ratio.pow(2) / 2.0
    if kl_loss_type in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
        return kl.clamp(-10.0, 10.0) if kl_loss_type == "low_var_kl" else kl
    raise ValueError(f"unknown kl_loss_type {kl_loss_type!r} (k1, k2, k3, low_var_kl)")


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token; ``ppo_kl`` = old_log_probs - log_probs.

    Returns (pg_losses, clipfrac) where clipfrac is 1.0 where the clipped branch won.
    ``eps_clip_c`` (dual clip, > 1) bounds the loss of negative-advantage tokens.
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_high) * advantages
    pg_losses = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"eps_clip_c must be > 1, got {eps_clip_c}")
        dual = torch.minimum(pg_losses, -eps_clip_c * advantages)
        pg_losses = torch.where(advantages < 0, dual, pg_losses)
    return pg_losses, clipfrac


def compute_cispo_loss(
    ppo_kl: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): -sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * log pi per token.

    The clipped importance weight carries no gradient, so every token keeps its log-prob's
    gradient (scaled by the weight) instead of being cut off as PPO's clip does; ``ppo_kl``
    = old_log_probs - log_probs. Returns (pg_losses, clipfrac: 1.0 where the weight was clipped).
    """
    ratio = torch.exp(-ppo_kl.detach())
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return -weight * advantages * log_probs, (weight != ratio).float()


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's clipped value loss per token (upstream's --value-clip).

    max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2): a value may not gain by moving more than
    ``value_clip`` from the one the rollout's advantages were computed with. Returns (losses, clipfrac:
    1.0 where |V - V_old| > c).
    """
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    losses = torch.maximum((values - returns).pow(2), (clipped - returns).pow(2))
    return losses, ((values - old_values).abs() > value_clip).float()


def compute_tis_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    clip_high: float = 2.0,
    clip_low: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling (--use-tis): pi_train_old / pi_rollout, clamped.

    Corrects the mismatch between the rollout engine's and the trainer's probabilities.
    Returns (weights, clipfrac); weights carry no gradient.
    """
    ratio = torch.exp(old_log_probs.float() - rollout_log_probs.float()).detach()
    weights = ratio.clamp(min=clip_low, max=clip_high)
    return weights, (weights != ratio).float()


# --------------------------------------------------------------- vocab-parallel ops


def compute_log_probs(logits: torch.Tensor, tokens: torch.Tensor, process_group: Any = None) -> torch.Tensor:
    """log pi(token) from logits whose last dim may be a vocab shard of ``process_group``.

    With a group of size > 1 this is megatron's vocab-parallel cross entropy (which
    all-reduces over the tensor-parallel group); it edits its input in place, so it gets
    a copy and ``logits`` stays usable for the entropy.
    """
    if process_group is None or dist.get_world_size(process_group) == 1:
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits.float().clone(), tokens)


def compute_entropy_from_logits(logits: torch.Tensor, process_group: Any = None) -> torch.Tensor:
    """Entropy of softmax(logits) per position; the vocab may be sharded over ``process_group``.

    H = log Z - sum_i p_i z_i. The sharded sums use megatron's reduce-from-TP mapping
    (all-reduce forward, identity backward): every TP rank computes the same loss, the
    convention megatron's vocab-parallel cross entropy uses too.
    """
    logits = logits.float()
    sharded = process_group is not None and dist.get_world_size(process_group) > 1
    shift = logits.detach().max(dim=-1, keepdim=True).values
    if sharded:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=process_group)
    shifted = logits - shift
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    sum_exp_z = (exp * shifted).sum(dim=-1)
    if sharded:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp, group=process_group)
        sum_exp_z = reduce_from_tensor_model_parallel_region(sum_exp_z, group=process_group)
    return torch.log(sum_exp) - sum_exp_z / sum_exp


# ------------------------------------------------------------ returns / advantages


def get_grpo_returns(rewards: Sequence[float], kl: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """GRPO: every response token's return is its sample's (group-normalised) reward."""
    return [torch.ones_like(k, dtype=torch.float32) * float(r) for r, k in zip(rewards, kl)]


def get_reinforce_plus_plus_returns(
    rewards: Sequence[float],
    kl: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    kl_coef: float,
    gamma: float = 1.0,
) -> list[torch.Tensor]:
    """REINFORCE++: token reward -kl_coef*kl, plus the sample reward on the last loss
    token; returns are the discounted reverse cumulative sums."""
    returns = []
    for reward, k, mask in zip(rewards, kl, loss_masks):
        mask = mask.float()
        token_rewards = -kl_coef * k.float() * mask
        loss_positions = mask.nonzero()
        if len(loss_positions):
            token_rewards[loss_positions[-1, 0]] += float(reward)
        ret, running = torch.zeros_like(token_rewards), 0.0
        for t in range(len(token_rewards) - 1, -1, -1):
            running = token_rewards[t] + gamma * running
            ret[t] = running
        returns.append(ret)
    return returns


def get_reinforce_plus_plus_baseline_advantages(
    rewards: Sequence[float], kl: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor], kl_coef: float
) -> list[torch.Tensor]:
    """REINFORCE++-baseline: the (already baseline-subtracted) reward minus kl_coef*kl per token."""
    return [(float(r) - kl_coef * k.float()) * m.float() for r, k, m in zip(rewards, kl, loss_masks)]


def get_advantages_and_returns(
    total_len: int,
    response_len: int,
    values: torch.Tensor,
    rewards: torch.Tensor,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over one response: A_t = sum_l (gamma*lambd)^l delta_{t+l},
    delta_t = r_t + gamma*V_{t+1} - V_t (V past the end is 0); returns = A + V."""
    assert values.numel() == rewards.numel() == response_len <= total_len
    advantages = torch.zeros(response_len, dtype=torch.float32)
    last = 0.0
    for t in range(response_len - 1, -1, -1):
        next_value = values[t + 1] if t + 1 < response_len else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lambd * last
        advantages[t] = last
    return advantages, advantages + values.float()


def get_ppo_token_rewards(rewards: Sequence[float], kl: Sequence[torch.Tensor], kl_coef: float) -> list[torch.Tensor]:
    """PPO's per-token rewards: -kl_coef * kl on every response token, the sample's reward on its last."""
    token_rewards = []
    for reward, k in zip(rewards, kl):
        r = -kl_coef * k.float()
        if len(r):
            r[-1] += float(reward)
        token_rewards.append(r)
    return token_rewards


def get_ppo_advantages_and_returns(
    rewards: Sequence[float],
    kl: Sequence[torch.Tensor],
    values: Sequence[Sequence[float]],
    kl_coef: float,
    gamma: float,
    lambd: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE (--gamma, --lambd) over each response with the critic's values of the rollout."""
    advantages, returns = [], []
    for token_rewards, value in zip(get_ppo_token_rewards(rewards, kl, kl_coef), values):
        value = torch.as_tensor(value, dtype=torch.float32)
        if value.numel() != token_rewards.numel():
            raise ValueError(f"the critic gave {value.numel()} values for a response of {token_rewards.numel()} "
                             "tokens; values are one per response token")
        adv, ret = get_advantages_and_returns(len(token_rewards), len(token_rewards), value, token_rewards,
                                              gamma, lambd)
        advantages.append(adv)
        returns.append(ret)
    return advantages, returns


def group_normalize_rewards(
    rewards: Sequence[float], group_size: int, *, std_normalization: bool = True, eps: float = 1e-6
) -> list[float]:
    """Subtract each group's mean (and divide by its std): GRPO's reward post-processing.

    Groups are consecutive runs of ``group_size`` samples (n_samples_per_prompt).
    """
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards are not a multiple of group size {group_size}")
    grouped = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if std_normalization:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.flatten().tolist()


def compute_advantages_and_returns(args: Any, data: dict[str, Any]) -> None:
    """Fill data['advantages'] and data['returns'] (per response token) in place.

    Rewards are expected post-processed (group-normalised for GRPO) by the rollout side.
    KL shaping (reinforce++ families) uses data['log_probs'] (data['rollout_log_probs'] with
    --use-rollout-logprobs) / data['ref_log_probs'] when both are present, with --kl-coef.
    """
    estimator = args.advantage_estimator
    masks = [torch.tensor(m, dtype=torch.float32) for m in data["loss_masks"]]
    kl = _shaping_kl(args, data, masks)
    kl_coef = args.kl_coef or 0.0
    # --use-opd: the distillation penalty joins the estimator's advantages before any whitening (upstream's order)
    if estimator in ("grpo", "gspo", "cispo"):
        returns = get_grpo_returns(data["rewards"], kl)
        advantages = opd_penalised(args, data, returns)
        advantages = _whiten(advantages, masks) if args.normalize_advantages else advantages
    elif estimator == "reinforce_plus_plus":
        returns = get_reinforce_plus_plus_returns(data["rewards"], kl, masks, kl_coef, args.gamma)
        advantages = _whiten(opd_penalised(args, data, returns), masks)
    elif estimator == "reinforce_plus_plus_baseline":
        returns = get_reinforce_plus_plus_baseline_advantages(data["rewards"], kl, masks, kl_coef)
        advantages = _whiten(opd_penalised(args, data, returns), masks)
    elif estimator == "ppo":
        if data.get("values") is None:
            raise ValueError("--advantage-estimator ppo needs the critic's values ('values') in the rollout data")
        if not kl_coef:  # no KL reward term: the per-token rewards' shape is the masks'. The log-probs' KL would
            kl = [torch.zeros_like(m) for m in masks]  # be empty for samples of other DP ranks (actor DP > 1)
        advantages, returns = get_ppo_advantages_and_returns(data["rewards"], kl, data["values"], kl_coef,
                                                             args.gamma, args.lambd)
        advantages = opd_penalised(args, data, advantages)
        advantages = _whiten(advantages, masks) if args.normalize_advantages else advantages
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    data["advantages"] = [a.tolist() for a in advantages]
    data["returns"] = [r.tolist() for r in returns]


def _shaping_kl(args: Any, data: dict[str, Any], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    # The old policy's log-probs: the engines' with --use-rollout-logprobs (as upstream), else the trainer's.
    policy = data.get("rollout_log_probs" if args.use_rollout_logprobs else "log_probs")
    if policy is None or data.get("ref_log_probs") is None:
        return [torch.zeros_like(m) for m in masks]
    kl_type = args.kl_loss_type or "k1"
    return [
        compute_approx_kl(torch.tensor(lp), torch.tensor(ref), kl_type)
        for lp, ref in zip(policy, data["ref_log_probs"])
    ]


def _whiten(values: list[torch.Tensor], masks: list[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """Normalise over all loss tokens of the rollout (data every rank shares: no collective)."""
    flat, flat_mask = torch.cat(values), torch.cat(masks)
    count = flat_mask.sum().clamp(min=1.0)
    mean = (flat * flat_mask).sum() / count
    var = ((flat - mean).pow(2) * flat_mask).sum() / count
    return [(v - mean) * torch.rsqrt(var + eps) * m for v, m in zip(values, masks)]


OPD_KL_KEY = "opd_reverse_kl"
"""Per-token reverse KL of each sample in the rollout data, and the train metric (its loss-token mean)."""


def opd_penalised(args: Any, data: dict[str, Any], advantages: list[torch.Tensor]) -> list[torch.Tensor]:
    """`advantages - opd_kl_coef * (student - teacher)` per sample; stores the reverse KL as data[OPD_KL_KEY].

    A sample without student log-probs here (an empty list: another DP rank computed them) keeps its
    advantages; this rank does not train on it.
    """
    if not args.use_opd:
        return advantages
    student = data.get("rollout_log_probs" if args.use_rollout_logprobs else "log_probs")
    teacher = data.get("teacher_log_probs")
    if teacher is None:
        source = ("--opd-teacher-load (the trainer's teacher)" if args.opd_type == "megatron" else
                  "the teacher engine: --custom-rm-path slime.rollout.on_policy_distillation.reward_func with "
                  "--rm-url at the teacher's /generate")
        raise ValueError(f"--use-opd --opd-type {args.opd_type}: the rollout data has no teacher_log_probs; they "
                         f"come from {source}")
    if student is None:
        raise ValueError("--use-opd needs the student's log-probs (the trainer's old-policy pass)")
    coef = float(args.opd_kl_coef)
    penalised, kls = [], []
    for index, (adv, own, theirs) in enumerate(zip(advantages, student, teacher, strict=True)):
        if len(own) == 0:
            penalised.append(adv)
            kls.append([])
            continue
        if len(own) != len(theirs):
            raise ValueError(f"sample {index}: {len(theirs)} teacher log-probs for {len(own)} response tokens")
        kl = torch.tensor(own, dtype=torch.float32) - torch.tensor(theirs, dtype=torch.float32)
        penalised.append(adv - coef * kl)
        kls.append(kl.tolist())
    data[OPD_KL_KEY] = kls
    return penalised
