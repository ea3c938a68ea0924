"""One RL training step on megatron-core, as small phases the fenced actor can put fences between.

Phase order (identical on every rank, every step; each collective's group is named):
  loss_token_total   all_reduce(SUM) of the plan's loss tokens over DP x CP; checked
                     against the plan; a zero total skips the step on every rank together
  forward_backward   megatron's get_forward_backward_func over exactly plan.micro_batches
                     (TP/CP/SP collectives inside the model, PP p2p inside the schedule)
  grad_reduce        finalize_model_grads: DP x CP gradient all-reduce (+ SP norm / embedding)
  metrics            ONE all_reduce(SUM) over the world of the sorted metric vector
  optimizer          optimizer.step() (grad-norm all-reduce over model-parallel ranks);
                     skipped on all ranks when the REDUCED loss is not finite

Gradient normalisation (why the step is layout-invariant): loss.py weights each token so
that the step loss is the plain sum of all micro-batch losses over DP x CP ranks. Megatron
would average on top of that; ``megatron_loss_scale`` undoes exactly what it applies:
- config.calculate_per_token_loss=False: the schedule multiplies a 2-tuple loss by cp/M
  and DDP scales gradients by 1/(dp*cp) -> we return loss * M * dp;
- config.calculate_per_token_loss=True: the schedule and DDP leave sums alone and we call
  finalize_model_grads without num_tokens -> we return the loss as is.
Either way the gradient is d(step loss)/d(theta), whatever TP, CP, DP or micro-batch split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from functools import partial
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from slime.backends.megatron_utils.data import (
    MicroBatchPlan,
    PackedMicroBatch,
    pack_micro_batch,
    unpack_response_values,
)
from slime.backends.megatron_utils.loss import metric_keys, micro_batch_loss, target_log_probs
from slime.backends.megatron_utils.moe import aux_loss_scale
from slime.config.run_config import run_loss
from slime.models import indexer_loss
from slime.backends.megatron_utils.routing_replay import RouteReplayer
from slime.models.cp_attention import packed_seq_params
from slime.models.vision_arch import VisionArch, vision_arch_of

PhaseHook = Callable[[str], ContextManager]
ProgressHook = Callable[[], None]  # called as each micro-batch starts: the previous one completed (deadlines)


class LossTokenTotalMismatch(RuntimeError):
    """The loss tokens the DP x CP ranks hold do not add up to the plan's step total."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    metrics: dict[str, float]
    """Step-level means (already reduced), keys sorted."""
    skipped: bool
    num_micro_batches: int
    loss_token_total: int


# ------------------------------------------------------------------------- plans


# micro-batch loss: (model output, packed batch, plan) -> (this rank's loss, detached metric sums)
MicroBatchLoss = Callable[[torch.Tensor, PackedMicroBatch, MicroBatchPlan], tuple[torch.Tensor, dict[str, torch.Tensor]]]
# per-position scores of a forward-only pass: (model output, packed batch) -> [T_local]
PositionScores = Callable[[torch.Tensor, PackedMicroBatch], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class StepObjective:
    """What a training step minimises: the actor's policy loss or the critic's value loss (value_loss.py).

    The step's collectives do not depend on it; only the loss and the metric keys do.
    """

    keys: tuple[str, ...]
    """The metric keys fixed by the flags (equal on every rank)."""
    micro_batch_loss: MicroBatchLoss
    plugin_metrics: bool = False
    """A plug-in may add metric keys: the ranks agree on them before reducing."""
    mtp_depths: int = 0
    """MTP layers the loss trains: the packed batches carry their shifted tokens (data.pack_micro_batch)."""


def policy_objective(args: Any) -> StepObjective:
    """The actor's objective: the policy loss of the run config (loss.py); the loss plug-ins receive ``args``."""
    cfg = run_loss(args)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    return StepObjective(keys=metric_keys(cfg), plugin_metrics=cfg.has_plugin_metrics,
                         micro_batch_loss=lambda output, batch, plan: micro_batch_loss(output, batch, plan, cfg,
                                                                                       tp_group, plugin_args=args),
                         mtp_depths=cfg.mtp_depths)


def policy_log_probs(args: Any) -> PositionScores:
    """The actor's forward-only score: log pi(target token) (all-reduces over TP)."""
    cfg = run_loss(args)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    return lambda output, batch: target_log_probs(output, batch, cfg, tp_group)


def pack_plan(data: Mapping[str, Any], plan: MicroBatchPlan, args: Any, mtp_depths: int = 0,
              vision: VisionArch | None = None) -> list[PackedMicroBatch]:
    """Pack every micro-batch of ``plan`` for this CP rank, on the compute device (no collective); ``vision``: the
    model's vision side (vision_arch_of), whose inputs each micro-batch then carries."""
    cp_rank = parallel_state.get_context_parallel_rank()
    packed = [
        pack_micro_batch(data, mb, cp_size=plan.cp_size, cp_rank=cp_rank, tp_size=args.tensor_model_parallel_size,
                         sequence_parallel=args.sequence_parallel, mtp_depths=mtp_depths, vision=vision)
        for mb in plan.micro_batches
    ]
    return [_to_device(p, _comm_device()) for p in packed] if torch.cuda.is_available() else packed


def _comm_device() -> torch.device:
    """Where collective tensors live: the current GPU under NCCL, CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _to_device(packed: PackedMicroBatch, device: torch.device) -> PackedMicroBatch:
    moved = {f.name: getattr(packed, f.name).to(device, non_blocking=True)
             for f in dataclasses.fields(packed)
             if isinstance(getattr(packed, f.name), torch.Tensor)}
    return dataclasses.replace(packed, **moved)


# ------------------------------------------------------------------------ phases


def _phase(hook: PhaseHook | None, name: str) -> ContextManager:
    return hook(f"actor_train/{name}") if hook is not None else contextlib.nullcontext()


def reduce_loss_token_total(plan: MicroBatchPlan) -> int:
    """All DP x CP ranks' loss tokens (group: DP x CP), checked against the plan.

    Every CP rank of a DP rank holds the same plan, so the sum counts each DP rank cp
    times; dividing by cp undoes that inflation.
    """
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    local = torch.tensor([float(sum(plan.loss_token_counts))], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(local, group=group)
    total = int(round(local.item() / plan.cp_size))
    if total != plan.step_loss_token_total:
        raise LossTokenTotalMismatch(
            f"step {plan.step_index}: DP x CP ranks hold {total} loss tokens, the plan says "
            f"{plan.step_loss_token_total} (dp_rank {plan.dp_rank} contributes {sum(plan.loss_token_counts)})"
        )
    return total


def megatron_loss_scale(config: Any, num_micro_batches: int) -> float:
    """Factor that cancels megatron's loss/gradient averaging (module docstring)."""
    if config.calculate_per_token_loss:
        return 1.0
    return float(num_micro_batches * parallel_state.get_data_parallel_world_size())


def zero_grads(model_chunks: Sequence[Any], optimizer: Any) -> None:
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def run_forward_backward(model_chunks: Sequence[Any], packed: list[PackedMicroBatch], plan: MicroBatchPlan,
                         objective: StepObjective, progress: ProgressHook | None = None,
                         routes: RouteReplayer | None = None) -> dict[str, torch.Tensor]:
    """Forward+backward over the planned micro-batches; returns this rank's metric sums."""
    config = get_model_config(model_chunks[0])
    scale = megatron_loss_scale(config, plan.num_micro_batches)
    sums = {key: torch.zeros((), dtype=torch.float64, device=_comm_device()) for key in objective.keys}

    def loss_func(batch: PackedMicroBatch, output: torch.Tensor):
        loss, metrics = objective.micro_batch_loss(output, batch, plan)
        for key, value in metrics.items():  # plug-ins (custom loss / TIS) may add keys
            if key not in sums:
                sums[key] = torch.zeros((), dtype=torch.float64, device=_comm_device())
            sums[key] += value.double()  # stays on device: no sync per micro-batch
        if config.calculate_per_token_loss:
            return loss * scale, batch.loss_mask.sum().int(), metrics
        return loss * scale, metrics

    dp = parallel_state.get_data_parallel_world_size()
    trains_indexer = bool(getattr(config, "dsa_indexer_loss_coeff", None))
    if trains_indexer:
        _indexer_loss_scale(config, plan.num_micro_batches, dp)
    with aux_loss_scale(config, plan.num_micro_batches, dp):
        _run_schedule(model_chunks, packed, loss_func, forward_only=False, progress=progress, routes=routes)
    if trains_indexer:  # reduced with the other metrics (one all_reduce, reduce_step_metrics)
        sums["indexer_loss"] = torch.tensor(indexer_loss.take_logged(), dtype=torch.float64, device=_comm_device())
    return sums


def _indexer_loss_scale(config: Any, num_micro_batches: int, dp: int) -> None:
    """Each micro-batch's DSA indexer loss weighs 1 / (micro-batches x DP), as the router's aux loss: megatron's
    gradient reduction averages over DP x CP unless the loss is per token."""
    weight = 1.0 / (num_micro_batches * dp)
    cp = parallel_state.get_context_parallel_world_size()
    gradient = weight if config.calculate_per_token_loss else weight * dp * cp
    if config.grad_scale_func is not None:  # the fp16 loss scale the main backward starts from
        gradient *= float(config.grad_scale_func(torch.ones(1, device=_comm_device())))
    indexer_loss.set_step_scale(weight, gradient)


def reduce_step_metrics(sums: Mapping[str, torch.Tensor], keys: Sequence[str]) -> dict[str, float]:
    """ONE all_reduce(SUM) over the world of the metrics in sorted-key order.

    Each TP rank holds identical values and non-last PP stages hold zeros, so the world
    sum divided by tp is the sum over DP x CP ranks of the last stage: the step mean.
    """
    keys = sorted(keys)
    vector = torch.stack([sums[k].double().to(_comm_device()) for k in keys])
    dist.all_reduce(vector)
    vector = vector.cpu() / parallel_state.get_tensor_model_parallel_world_size()
    return {k: float(v) for k, v in zip(keys, vector.tolist())}


class MetricKeyMismatch(RuntimeError):
    """Ranks' loss plug-ins reported different metric keys (the metric reduce would not line up)."""


def agree_on_metric_keys(keys: Sequence[str]) -> None:
    """ONE all_gather_object over the world of the metric keys, when a plug-in chose them.

    Runs only with a custom loss / TIS function (a flag, equal on every rank), before the reduce
    whose vector layout the keys decide; a difference raises on every rank together.
    """
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(keys))
    if any(g != gathered[0] for g in gathered):
        table = "; ".join(f"rank {r}: {g}" for r, g in enumerate(gathered))
        raise MetricKeyMismatch(f"loss plug-in metric keys differ across ranks ({table}); return the same keys "
                                "on every micro-batch, padding ones included")


def optimizer_step(optimizer: Any, lr_scheduler: Any, reduced_loss: float) -> tuple[float, bool]:
    """(grad_norm, stepped). Decisions use reduced values only, so all ranks agree."""
    if not math.isfinite(reduced_loss):
        optimizer.zero_grad()
        return float("nan"), False
    ok, grad_norm, _ = optimizer.step()
    if ok:
        lr_scheduler.step(increment=1)
    return (float(grad_norm) if grad_norm is not None else float("nan")), bool(ok)


# ------------------------------------------------------------------------- API


def train_one_step(model_chunks: Sequence[Any], optimizer: Any, lr_scheduler: Any, data: Mapping[str, Any],
                   plan: MicroBatchPlan, args: Any, *, collective_hook: PhaseHook | None = None,
                   progress: ProgressHook | None = None, objective: StepObjective | None = None) -> StepResult:
    """Run one planned training step; ``collective_hook(phase)`` wraps each phase (fences, ledger).

    ``objective``: the actor's policy loss unless given (the critic passes its value loss).
    """
    objective = policy_objective(args) if objective is None else objective
    keys = objective.keys
    packed = pack_plan(data, plan, args, objective.mtp_depths, vision_arch_of(model_chunks[0]))
    with _phase(collective_hook, "loss_token_total"):
        total = reduce_loss_token_total(plan)
    if total == 0:
        return StepResult(0.0, 0.0, {k: 0.0 for k in keys}, True, plan.num_micro_batches, 0)
    _install_grad_scale(model_chunks, optimizer)
    zero_grads(model_chunks, optimizer)
    with _phase(collective_hook, "forward_backward"):
        replayer = RouteReplayer(args, model_chunks, data, training=True)
        try:
            sums = run_forward_backward(model_chunks, packed, plan, objective, progress, replayer)
        finally:
            replayer.done()
    with _phase(collective_hook, "grad_reduce"):
        finalize_model_grads(list(model_chunks), None)
    with _phase(collective_hook, "metrics"):
        if objective.plugin_metrics:
            agree_on_metric_keys(sorted(sums))
        metrics = reduce_step_metrics(sums, sorted(sums))
    with _phase(collective_hook, "optimizer"):
        grad_norm, stepped = optimizer_step(optimizer, lr_scheduler, metrics["loss"])
    return StepResult(metrics["loss"], grad_norm, metrics, not stepped, plan.num_micro_batches, total)


def compute_log_probs(model_chunks: Sequence[Any], data: Mapping[str, Any],
                      plans: MicroBatchPlan | Sequence[MicroBatchPlan], args: Any,
                      *, collective_hook: PhaseHook | None = None,
                      progress: ProgressHook | None = None, scores: PositionScores | None = None) -> list[list[float]]:
    """Forward-only log-probs of every response token of the plans' samples.

    Returns one list per rollout sample (same indexing as ``data``); samples outside this
    DP rank's plans get []. Identical on every rank of the DP group (CP all-gather, PP
    broadcast). Use for the old policy (actor) and the reference model; ``scores`` replaces the
    log-probs by another per-position score (the critic's values).
    """
    plans = [plans] if isinstance(plans, MicroBatchPlan) else list(plans)
    scores = policy_log_probs(args) if scores is None else scores
    out: list[list[float]] = [[] for _ in data["tokens"]]
    replayer = RouteReplayer(args, model_chunks, data, training=False)
    for plan in plans:
        packed = pack_plan(data, plan, args, vision=vision_arch_of(model_chunks[0]))
        with _phase(collective_hook, "log_probs_forward"), eval_mode(model_chunks):
            try:
                local = _forward_scores(model_chunks, packed, scores, progress, replayer)
            finally:
                replayer.done()
        with _phase(collective_hook, "log_probs_gather"):
            values = _gather_log_probs(local, packed)
        for sample, lps in values.items():
            out[sample] = lps
    return out


@contextlib.contextmanager
def eval_mode(model_chunks: Sequence[Any]):
    """No dropout while scoring: the old-policy and reference log-probs are the policy's own, as the
    engines' are (upstream's forward-only pass does the same); training mode comes back after."""
    modes = [chunk.training for chunk in model_chunks]
    for chunk in model_chunks:
        chunk.eval()
    try:
        yield
    finally:
        for chunk, training in zip(model_chunks, modes):
            chunk.train(training)


# ------------------------------------------------------------------- internals


def _forward_scores(model_chunks, packed: list[PackedMicroBatch], scores: PositionScores,
                    progress: ProgressHook | None = None, routes: RouteReplayer | None = None) -> list[torch.Tensor]:
    """Per micro-batch local scores [T_local] (empty list off the last PP stage)."""
    results: list[torch.Tensor] = []

    def loss_func(batch: PackedMicroBatch, output: torch.Tensor):
        results.append(scores(output, batch).detach())
        return output.new_zeros(()), {}

    with torch.no_grad():
        _run_schedule(model_chunks, packed, loss_func, forward_only=True, progress=progress, routes=routes)
    return results


def _gather_log_probs(local: list[torch.Tensor], packed: list[PackedMicroBatch]) -> dict[int, list[float]]:
    """One all_gather over CP of all micro-batches' local values, one PP broadcast; unpack."""
    values: dict[int, list[float]] | None = None
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        flat = torch.cat(local)
        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1:
            gathered = flat.new_empty(cp * flat.numel())
            dist.all_gather_into_tensor(gathered, flat.contiguous(),
                                        group=parallel_state.get_context_parallel_group())
            rows = gathered.view(cp, -1).cpu()
        else:
            rows = flat.view(1, -1).cpu()
        values, offset = {}, 0
        for batch in packed:
            width = batch.labels.numel()
            values.update(unpack_response_values(rows[:, offset: offset + width], batch))
            offset += width
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        holder = [values]
        dist.broadcast_object_list(holder, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        values = holder[0]
    return values


def _packed_seq_params(batch: PackedMicroBatch) -> PackedSeqParams:
    # the host copy of the lengths spares every layer a device read of cu_seqlens
    return packed_seq_params(batch.cu_seqlens, batch.padded_lengths)


def _forward_step(data_iterator, model, *, loss_func, progress: ProgressHook | None, routes: RouteReplayer | None,
                  masks_routing: bool):
    if progress is not None:
        progress()
    batch = next(data_iterator)
    if routes is not None:
        routes.before_forward(batch.sample_ids)
    # the MTP layers' shifted ids travel with the batch only where the loss trains them
    extra = {} if batch.mtp_tokens is None else {"mtp_input_ids": batch.mtp_tokens[:-1]}
    # MoE: the padding still flows through the experts (it keeps the shapes the layout needs), but the router
    # leaves it out of the expert-bias token counts and the aux losses, so they see the real tokens only
    if masks_routing:
        extra["padding_mask"] = batch.padding_mask
    if batch.position_rows is not None:  # a vision tower: the images and the multimodal RoPE positions
        extra["vision"] = batch.vision()
    output = model(batch.input_ids, batch.position_ids, None, packed_seq_params=_packed_seq_params(batch), **extra)
    if routes is not None:
        routes.after_forward(batch.sample_ids)
    return output, partial(loss_func, batch)


def _run_schedule(model_chunks, packed: list[PackedMicroBatch], loss_func, *, forward_only: bool,
                  progress: ProgressHook | None = None, routes: RouteReplayer | None = None) -> None:
    chunks = list(model_chunks)
    iterators = [iter(packed) for _ in chunks] if len(chunks) > 1 else iter(packed)
    masks_routing = bool(getattr(get_model_config(chunks[0]), "num_moe_experts", None))
    get_forward_backward_func()(
        forward_step_func=partial(_forward_step, loss_func=loss_func, progress=progress,
                                  routes=routes if routes is not None and routes.active else None,
                                  masks_routing=masks_routing),
        data_iterator=iterators,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(packed),
        seq_length=max(b.labels.numel() for b in packed),
        micro_batch_size=1,
        forward_only=forward_only,
    )


def _install_grad_scale(model_chunks: Sequence[Any], optimizer: Any) -> None:
    """Backward starts from loss * optimizer.scale_loss (the fp16 loss scale; 1 otherwise)."""
    config = get_model_config(model_chunks[0])
    if config.grad_scale_func is None:
        config.grad_scale_func = optimizer.scale_loss
