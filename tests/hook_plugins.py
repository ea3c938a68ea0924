"""Plug-ins for every upstream function hook, used by the hook tests.

Each one appends a JSON line {"hook": name, ...} to the file named by `args.hook_log` (set through
--custom-config-path in the end-to-end runs, so it reaches every Ray actor), then has an effect the
tests can check: a metadata mark, a removed sample, a zeroed mask token, a metric, a skipped log.
They run in the rollout manager and on the training ranks, so they import nothing from tests/.
"""
from __future__ import annotations

import argparse
import json
import os

import torch


def record(args, hook: str, **fields) -> None:
    path = getattr(args, "hook_log", None)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"hook": hook, "pid": os.getpid(), **fields}) + "\n")


def read_records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------ rollout side

def rollout(args, rollout_id, data_source, evaluation=False):
    """--rollout-function-path: the default rollout, marked."""
    from slime.rollout.sglang_rollout import generate_rollout

    record(args, "rollout_function", rollout_id=rollout_id, evaluation=evaluation)
    output = generate_rollout(args, rollout_id, data_source, evaluation=evaluation)
    output.metrics = {**(output.metrics or {}), ("eval/hook_marker" if evaluation else "rollout/hook_marker"): 1.0}
    return output


async def generate(args, sample, sampling_params, evaluation=False):
    """--custom-generate-function-path: the default generate, marked (upstream passes `evaluation`)."""
    from slime.rollout.sglang_rollout import generate as default_generate

    sample = await default_generate(args, sample, sampling_params)
    sample.metadata["generate_hook"] = "eval" if evaluation else "train"
    record(args, "generate", index=sample.index, evaluation=evaluation)
    return sample


def sample_hook(args, sample, *, rollout_id, evaluation):
    """--rollout-sample-hook-path: marks the finished sample before its reward."""
    assert sample.reward is None, "sample hooks run before the reward"
    sample.metadata["sample_hook_rollout"] = rollout_id
    record(args, "sample_hook", index=sample.index, rollout_id=rollout_id, evaluation=evaluation)


async def index_parity_rm(args, sample):
    """--custom-rm-path: odd sample indices score 1, even 0 (every group has reward spread)."""
    return float(sample.index % 2)


async def group_parity_rm(args, sample):
    """Odd groups get rewards 0/1 (kept by check_reward_nonzero_std), even groups all 0 (dropped)."""
    return float(sample.index % 2) if sample.group_index % 2 else 0.0


async def first_group_flat_rm(args, sample):
    """Group 0 scores all 0 (check_reward_nonzero_std drops it); every other group 0/1 by index parity."""
    return 0.0 if sample.group_index == 0 else float(sample.index % 2)


async def slow_sample_hook(args, sample, *, rollout_id, evaluation):
    """Holds each finished sample 0.5 s before its reward while the next group generates, so the abort at
    the end of the rollout finds that group half-generated."""
    import asyncio

    await asyncio.sleep(0.5)


def reject_all(args, group):
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput

    return DynamicFilterOutput(keep=False, reason="test")


async def generate_two_segments(args, sample, sampling_params):
    """A generate function that returns two training samples for one prompt (agentic fan-out)."""
    import copy

    first = await generate(args, sample, sampling_params)
    return [first, copy.deepcopy(first)]


def sample_filter(args, groups):
    """--rollout-sample-filter-path: removes the last sample of every group from the loss."""
    for group in groups:
        group[-1].remove_sample = True
    record(args, "sample_filter", groups=len(groups))


def all_samples_process(args, all_groups, data_source):
    record(args, "all_samples_process", groups=len(all_groups), has_data_source=data_source is not None)


def convert_samples(args, samples):
    """--custom-convert-samples-to-train-data-path: the default conversion, marked."""
    from slime.rollout.train_data import samples_to_train_data

    data = samples_to_train_data(args, samples)
    record(args, "convert_samples", samples=len(samples))
    return data


def rollout_log(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """--custom-rollout-log-function-path: takes over the logging of odd rollouts."""
    record(args, "rollout_log", rollout_id=rollout_id, samples=len(samples), rollout_time=rollout_time,
           extra_keys=sorted(rollout_extra_metrics or {}))
    return rollout_id % 2 == 1


def eval_log(rollout_id, args, data, extra_metrics):
    """--custom-eval-rollout-log-function-path: takes over every eval logging."""
    record(args, "eval_log", rollout_id=rollout_id, datasets=sorted(data), metric_keys=sorted(extra_metrics or {}))
    return True


# ------------------------------------------------------------------------------ training ranks

def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else -1


def megatron_init(args):
    from megatron.core import parallel_state

    # the pg-loss reducer gets no args: tell it (this rank's process) where to record
    os.environ["SLIME_TEST_HOOK_LOG"] = getattr(args, "hook_log", None) or ""
    record(args, "megatron_init", rank=_rank(), model_parallel=parallel_state.model_parallel_is_initialized())


def model_provider(pre_process, post_process, vp_stage=None):
    """--custom-model-provider-path: the project's builder, reached through model_provider_context()."""
    from slime.backends.megatron_utils.model import build_gpt_model, model_provider_context

    args, hf_config = model_provider_context()
    record(args, "model_provider", pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    return build_gpt_model(args, hf_config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def before_log_prob(args, model, store_prefix):
    record(args, "before_log_prob", store_prefix=store_prefix, chunks=len(model))


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    record(args, "before_train_step", rollout_id=rollout_id, step_id=step_id,
           lr=optimizer.param_groups[0]["lr"], scheduler_steps=opt_param_scheduler.num_steps)


def advantages(args, rollout_data):
    """--custom-advantage-function-path: the default advantages, doubled."""
    from slime.utils.ppo_utils import compute_advantages_and_returns

    compute_advantages_and_returns(args, rollout_data)
    rollout_data["advantages"] = [[2.0 * a for a in row] for row in rollout_data["advantages"]]
    record(args, "advantages", samples=len(rollout_data["advantages"]), has_log_probs="log_probs" in rollout_data)


def data_postprocess(args, rollout_id, rollout_data):
    """--rollout-data-postprocess-path: masks the first response token of every sample."""
    for mask in rollout_data["loss_masks"]:
        if mask:
            mask[0] = 0
    record(args, "data_postprocess", rollout_id=rollout_id, keys=sorted(rollout_data),
           loss_tokens=sum(sum(m) for m in rollout_data["loss_masks"]))


def tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths):
    """--custom-tis-function-path: no reweighting, the last response token of each sample dropped."""
    masks = [m.clone() for m in loss_masks]
    for m in masks:
        if m.numel():
            m[-1] = 0
    ratio = torch.cat([(t - r).exp() for t, r in zip(train_log_probs, rollout_log_probs)]) if masks else pg_loss
    record(args, "tis", samples=len(masks), sizes=[int(m.numel()) for m in masks], response_lengths=response_lengths)
    return pg_loss, masks, {"plugin_tis_ratio": ratio}


PG_REDUCER_CONSTANT = 1000.0


def pg_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """--custom-pg-loss-reducer-function-path: Dr. GRPO's sum over a constant (records each value)."""
    mask = torch.cat(loss_masks) if loss_masks else torch.zeros(0)

    def reduce(pg_loss):
        value = (pg_loss * mask).sum() / PG_REDUCER_CONSTANT
        record(argparse.Namespace(hook_log=os.environ.get("SLIME_TEST_HOOK_LOG")), "pg_reducer",
               value=float(value.detach()))
        return value

    return reduce


def custom_loss(args, batch, logits, sum_of_sample_mean):
    """--custom-loss-function-path: negative log-likelihood, with one plug-in metric."""
    current = torch.cat(batch["current_log_probs"]) if batch["current_log_probs"] else logits.new_zeros(0)
    loss = sum_of_sample_mean(-current)
    record(args, "custom_loss", samples=len(batch["loss_masks"]),
           sizes=[int(m.numel()) for m in batch["loss_masks"]], response_lengths=batch["response_lengths"])
    return loss, {"plugin_nll": loss.detach()}


# ------------------------------------------------------------------------------ data source and buffer

def buffer_filter(args, rollout_id, buffer, num_samples):
    """--buffer-filter-path: the oldest groups first, recording what the buffer held."""
    record(args, "buffer_filter", rollout_id=rollout_id, num_samples=num_samples,
           groups=[[{"index": s.index, "response_length": s.response_length, "status": s.status.value}
                    for s in group] for group in buffer])
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken


def _data_source_base():
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    return RolloutDataSourceWithBuffer


class RecordingDataSource(_data_source_base()):
    """--data-source-path: the default buffered data source, recording every draw."""

    def get_samples(self, num_prompts):
        groups = super().get_samples(num_prompts)
        record(self.args, "data_source_get", num=num_prompts, rollout_id=self.rollout_id,
               first_indices=[g[0].index for g in groups])
        return groups

    def add_samples(self, samples):
        record(self.args, "data_source_add", groups=len(samples))
        super().add_samples(samples)


def hanging_rollout_log(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """--custom-rollout-log-function-path that never returns: the rollout manager's step window ends it."""
    import threading

    record(args, "hanging_rollout_log", rollout_id=rollout_id)
    threading.Event().wait()


async def response_parity_rm(args, sample):
    """A reward of every generated token: the parity of their sum (a run whose generations change scores
    differently)."""
    response = sample.tokens[len(sample.tokens) - sample.response_length:]
    return float(sum(response) % 2)


def rank_local_postprocess(args, rollout_id, rollout_data):
    """--rollout-data-postprocess-path that reads rank-local state: rank 1 masks one more token in rollout 0."""
    if rollout_id == 0 and _rank() == 1:
        rollout_data["loss_masks"][0][0] = 0


_ADVANTAGE_CALLS = [0]


def rank_local_advantages(args, rollout_data):
    """--custom-advantage-function-path: the default advantages; on rank 1 its second call (rollout 1)
    scales one sample's; on every rank of DP rank 1 its third call (rollout 2) does (DP ranks differ, the
    ranks of one DP rank agree)."""
    from megatron.core import parallel_state

    from slime.utils.ppo_utils import compute_advantages_and_returns

    compute_advantages_and_returns(args, rollout_data)
    _ADVANTAGE_CALLS[0] += 1
    if (_ADVANTAGE_CALLS[0] == 2 and _rank() == 1) or (
            _ADVANTAGE_CALLS[0] == 3 and parallel_state.get_data_parallel_rank() == 1):
        rollout_data["advantages"][0] = [2.0 * a for a in rollout_data["advantages"][0]]
