"""The DSA indexer's training loss (megatron-core's `dsa_indexer_loss_coeff`, flag --dsa-indexer-loss-coeff).

The indexer's choice is not differentiable, so megatron-core trains the indexer towards the main attention with a
KL term (DeepSeek-V3.2's recipe): for each query t, the target p(t, .) is the main attention's probabilities summed
over the heads and renormalised, the prediction the softmax of the indexer's scores, and

    loss = coeff * mean over the local queries of  sum_s p(t, s) * (log(p(t, s) + 1e-10) - log(q(t, s) + 1e-10))

over the causal keys (--dsa-indexer-use-sparse-loss: the keys the indexer kept). The target is detached: the loss
moves the indexer only. The heads are split over TP, so their sum is one all_reduce over TP per layer. The loss
is attached to the attention's output (megatron-core's DSAIndexerLossAutoScaler) so the main backward carries
its gradient, scaled by `set_step_scale`; its value is kept for the step's metrics (`take_logged`). As the
router's aux loss (moe.aux_loss_scale), each micro-batch's loss weighs 1 / (micro-batches x DP) in the step: the
logged `indexer_loss` is the mean over micro-batches and DP ranks of the loss summed over layers and CP ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _Logged:
    """The step's indexer loss (already scaled as its gradient is), summed over layers and micro-batches."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.scale = 1.0

    def add(self, loss: torch.Tensor) -> None:
        value = loss.detach().double() * self.scale
        self.total = value if self.total is None else self.total + value


_LOGGED = _Logged()


def set_step_scale(logged: float, gradient: float) -> None:
    """The weight of each micro-batch's indexer loss in the step's metric and in its backward (which megatron's
    gradient reduction may still average)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    _LOGGED.scale = logged
    DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(gradient))


def take_logged() -> float:
    """The step's summed indexer loss on this rank (0.0 when none ran), and a fresh tally."""
    total, _LOGGED.total = _LOGGED.total, None
    return 0.0 if total is None else float(total)


def indexer_kl(scores: list[torch.Tensor], queries: list[torch.Tensor], keys: list[torch.Tensor],
               masks: list[torch.Tensor], softmax_scale: float, tp_group) -> torch.Tensor:
    """Mean over all queries of KL(attention target || indexer softmax), one sequence per list entry.

    scores [tq, L] (the indexer's, differentiable), queries [tq, h, d], keys [L, h, d] (this rank's heads), masks
    [tq, L] boolean (the keys counted: causal, or the chosen ones for the sparse loss)."""
    targets = []
    for q, k, mask in zip(queries, keys, masks):
        logits = torch.einsum("thd,shd->hts", q.detach().float(), k.detach().float()) * softmax_scale
        targets.append(logits.masked_fill(~mask, float("-inf")).softmax(-1).sum(0))
    if tp_group is not None and dist.get_world_size(tp_group) > 1:  # the heads of the other TP ranks
        flat = torch.cat([t.flatten() for t in targets])
        dist.all_reduce(flat, group=tp_group)
        targets = list(flat.split([t.numel() for t in targets]))
        targets = [flat_t.view(m.shape) for flat_t, m in zip(targets, masks)]
    per_query = []
    for score, target, mask in zip(scores, targets, masks):
        target = target / target.sum(-1, keepdim=True)
        predicted = F.softmax(score.float().masked_fill(~mask, float("-inf")), dim=-1)
        per_query.append((target * ((target + 1e-10).log() - (predicted + 1e-10).log())).sum(-1))
    return torch.cat(per_query).mean()


def attach(output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`output` unchanged; its backward also runs the loss's, scaled by set_step_scale; the value is logged."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    _LOGGED.add(loss)
    return DSAIndexerLossAutoScaler.apply(output, loss)
