"""The fused log-prob / entropy head: log pi(target) and the entropy of every position in two reads of
the logits, without an fp32 copy of them.

The unfused head (loss.py: `.float() / T`, log_softmax, gather; the entropy over chunks) makes several
fp32 [tokens, vocab] intermediates: with Qwen3's 152k vocabulary that is ~10 GB of reads and writes per
pass at 16k tokens, most of a 0.6B step's elementwise time, and the largest activations of the step.
Here each chunk of rows is reduced once for its max and once for sum(exp) and sum(exp * z) (compiled
with `--fused-kernels compile`); the backward recomputes the softmax from the saved bf16 logits and
the per-row statistics, writing the logits' gradient in one pass.

Vocab-parallel (TP > 1): each rank holds a vocab shard; the row max (MAX) and the row sums with the
target's logit (SUM) are all-reduced over the TP group, once per chunk, in the same order on every
rank (the chunking depends only on the shard's shape, equal on the TP ranks). As in megatron's
vocab-parallel cross entropy, every TP rank then holds the full value and the backward needs no
collective: each rank's gradient is its shard's.

Maths, with z = logits / T, m = max z, S = sum exp(z - m), A = sum exp(z - m) (z - m):
  log p(target) = z_target - m - log S,   entropy = log S - A / S
  d log p(target) / dz = onehot(target) - p,   d entropy / dz = -p (z - m - A / S)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slime.models.fused_kernels import compiled_or_eager

# Rows per chunk: the eager fallback materialises a few fp32 copies of one chunk; compiled, nothing is
# materialised and the chunk only bounds the per-row statistics' launch size.
CHUNK_ELEMENTS = 2**28


@compiled_or_eager
def _row_max(logits: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    return (logits.float() * inv_temperature).amax(dim=-1)


@compiled_or_eager
def _row_sums(logits: torch.Tensor, inv_temperature: float, row_max: torch.Tensor,
              local_target: torch.Tensor, in_shard: torch.Tensor) -> torch.Tensor:
    """[3, rows]: sum exp(z - m), sum exp(z - m) (z - m), and z_target - m where the target is in this shard."""
    shifted = logits.float() * inv_temperature - row_max.unsqueeze(-1)
    exp = shifted.exp()
    target = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    return torch.stack([exp.sum(-1), (exp * shifted).sum(-1), torch.where(in_shard, target, 0.0)])


@compiled_or_eager
def _logits_grad(logits: torch.Tensor, inv_temperature: float, row_max: torch.Tensor, log_sum: torch.Tensor,
                 mean_shifted: torch.Tensor, local_target: torch.Tensor, in_shard: torch.Tensor,
                 grad_log_prob: torch.Tensor, grad_entropy: torch.Tensor) -> torch.Tensor:
    shifted = logits.float() * inv_temperature - row_max.unsqueeze(-1)
    probs = (shifted - log_sum.unsqueeze(-1)).exp()
    columns = torch.arange(logits.size(-1), device=logits.device)
    onehot = ((columns == local_target.unsqueeze(-1)) & in_shard.unsqueeze(-1)).float()
    grad = grad_log_prob.unsqueeze(-1) * (onehot - probs) \
        - grad_entropy.unsqueeze(-1) * probs * (shifted - mean_shifted.unsqueeze(-1))
    return (grad * inv_temperature).to(logits.dtype)


def _chunk_rows(logits: torch.Tensor) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, logits.size(-1)))


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)  # the TP group, once per chunk, in chunk order


class _FusedLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, inv_temperature, tp_group, vocab_start):
        local_target = (labels - vocab_start).clamp(0, logits.size(-1) - 1)
        in_shard = (labels >= vocab_start) & (labels < vocab_start + logits.size(-1))
        rows = _chunk_rows(logits)
        maxes, sums = [], []
        for chunk, target, shard in zip(logits.split(rows), local_target.split(rows), in_shard.split(rows)):
            row_max = _row_max(chunk, inv_temperature)
            _all_reduce(row_max, dist.ReduceOp.MAX, tp_group)
            stats = _row_sums(chunk, inv_temperature, row_max, target, shard)
            _all_reduce(stats, dist.ReduceOp.SUM, tp_group)
            maxes.append(row_max)
            sums.append(stats)
        row_max, (sum_exp, sum_exp_shifted, target_shifted) = torch.cat(maxes), torch.cat(sums, dim=-1)
        log_sum = sum_exp.log()
        mean_shifted = sum_exp_shifted / sum_exp
        ctx.save_for_backward(logits, row_max, log_sum, mean_shifted, local_target, in_shard)
        ctx.inv_temperature = inv_temperature
        return target_shifted - log_sum, log_sum - mean_shifted

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, row_max, log_sum, mean_shifted, local_target, in_shard = ctx.saved_tensors
        rows = _chunk_rows(logits)
        pieces = zip(logits.split(rows), row_max.split(rows), log_sum.split(rows), mean_shifted.split(rows),
                     local_target.split(rows), in_shard.split(rows), grad_log_prob.float().split(rows),
                     grad_entropy.float().split(rows))
        grads = [_logits_grad(chunk, ctx.inv_temperature, *rest) for chunk, *rest in pieces]
        return (grads[0] if len(grads) == 1 else torch.cat(grads)), None, None, None, None


def log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                          tp_group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(label), entropy) per row of `logits` [rows, vocab shard of tp_group], both fp32 and
    differentiable; `labels` [rows] are global vocabulary ids."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [rows, vocab] and labels [rows]; got {tuple(logits.shape)}, "
                         f"{tuple(labels.shape)}")
    sharded = tp_group is not None and dist.get_world_size(tp_group) > 1
    vocab_start = dist.get_rank(tp_group) * logits.size(-1) if sharded else 0
    return _FusedLogProbEntropy.apply(logits, labels.long(), 1.0 / temperature, tp_group, vocab_start)
