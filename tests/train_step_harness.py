"""Shared by the train-step tests and benchmarks/bench_layouts.py: one rank of a layout run.

`layout_child(rank, world, layout, hf_dir, data, modes)` builds the tiny Qwen3 on megatron
with the layout's TP/CP/SP/DP, loads the same HF weights, computes old log-probs, then runs
one training step per loss mode (lr=0 so every mode sees the same weights) and returns
plain values to compare across layouts. The arguments the trainer-side tests build without a command
line: `layout_args` (a layout run's), `model_args` (a tiny model's), `loss_args` (the loss tests' plan).
"""

from __future__ import annotations

import copy
import math
import time
from argparse import Namespace
from contextlib import contextmanager


@contextmanager
def recorded_phase(rank: int, world: int, ledger_dir: str, phase: str = "actor_train"):
    """Every collective inside recorded in a ledger that keeps the whole sequence (the order proof's input)."""
    from slime.distributed.instrument import instrument_collectives, uninstrument_collectives
    from slime.distributed.ledger import Ledger

    ledger = Ledger(rank, world, ledger_dir, record_sequence=True)
    instrument_collectives(ledger)
    try:
        with ledger.phase(phase):
            yield ledger
    finally:
        uninstrument_collectives()
        ledger.close()


def make_rollout(num_samples: int = 6, seed: int = 0, vocab: int = 512, max_len: int = 30) -> dict:
    """Deterministic rollout data in the trainer's format (advantages included)."""
    import random

    rng = random.Random(seed)
    data = {k: [] for k in ("tokens", "response_lengths", "loss_masks", "advantages", "rewards", "sample_indices")}
    for i in range(num_samples):
        total = rng.randint(6, max_len)
        response = rng.randint(1, total - 2)
        data["tokens"].append([rng.randrange(1, vocab) for _ in range(total)])
        data["response_lengths"].append(response)
        mask = [1] * response
        if response > 2:
            mask[rng.randrange(response)] = 0
        data["loss_masks"].append(mask)
        reward = rng.choice([-1.0, 0.5, 1.0])
        data["rewards"].append(reward)
        data["advantages"].append([reward] * response)
        data["sample_indices"].append(i)
    return data


def build_loaded_model(args, hf_dir: str):
    """Model-parallel state, the megatron model with its optimizer and scheduler, the HF weights loaded."""
    import transformers

    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime_plugins.models.hf_weights import load_hf_weights

    init_model_parallel(args)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    model, optimizer, scheduler = build_model_and_optimizer(args, hf_config)
    load_hf_weights(model, hf_dir, hf_config)
    return model, optimizer, scheduler


def plans_for_this_rank(data: dict, args) -> list:
    """This rank's micro-batch plans for every step of the rollout (its DP rank and size from megatron)."""
    from megatron.core import parallel_state

    from slime.backends.megatron_utils.data import plans_from_rollout

    return plans_from_rollout(data, args, dp_size=parallel_state.get_data_parallel_world_size(),
                              dp_rank=parallel_state.get_data_parallel_rank())


def with_policy_log_probs(model, data: dict, args) -> tuple[dict, object, list]:
    """A copy of the rollout with old-policy, reference and engine log-probs set near the model's own (so the step
    has non-zero ratios and KL), its one plan, and the model's log-probs."""
    import copy

    from slime.backends.megatron_utils.train_step import compute_log_probs

    data = copy.deepcopy(data)
    (plan,) = plans_for_this_rank(data, args)
    log_probs = compute_log_probs(model, data, plan, args)
    rows = [row if row else [0.0] * n for row, n in zip(log_probs, data["response_lengths"])]
    data["log_probs"] = [[v + 0.05 * (j % 3) for j, v in enumerate(row)] for row in rows]
    data["ref_log_probs"] = [[v - 0.1 for v in row] for row in rows]
    data["rollout_log_probs"] = [[v + 0.02 for v in row] for row in rows]
    return data, plan, log_probs


def layout_args(layout: dict, **overrides) -> Namespace:
    from slime.config import defaults_namespace

    args = dict(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
        expert_model_parallel_size=1, sequence_parallel=False, seed=1234, lr=0.0, min_lr=0.0,
        clip_grad=1.0, weight_decay=0.0, calculate_per_token_loss=False, use_dynamic_batch_size=True,
        max_tokens_per_gpu=24, micro_batch_size=1, global_batch_size=None, num_steps_per_rollout=1,
        balance_data=True, eps_clip=0.2, eps_clip_high=0.28, use_kl_loss=True, kl_loss_coef=0.1,
        kl_loss_type="low_var_kl", entropy_coef=0.01, use_tis=True, advantage_estimator="grpo",
        hidden_dropout=0.0, attention_dropout=0.0, fence_timeout=120.0, lr_decay_style="constant",
    )
    return defaults_namespace(**{**args, **layout, **overrides})


def model_args(**overrides) -> Namespace:
    """The parser's defaults for a tiny model whose steps compare exactly across layouts and runs: a learning rate
    that moves it, no gradient clipping, weight decay or dropout, a 120 s --fence-timeout."""
    from slime.config import defaults_namespace

    args = dict(lr=1e-3, clip_grad=1e9, weight_decay=0.0, fence_timeout=120, hidden_dropout=0.0, attention_dropout=0.0)
    return defaults_namespace(**{**args, **overrides})


def loss_args(**overrides) -> Namespace:
    """The parser's defaults with the one plan the loss tests pack their micro-batches by: one step per rollout,
    a global batch of 3 samples in dynamic micro-batches of up to 64 tokens."""
    from slime.config import defaults_namespace

    args = dict(num_steps_per_rollout=1, use_dynamic_batch_size=True, max_tokens_per_gpu=64, global_batch_size=3)
    return defaults_namespace(**{**args, **overrides})


def _perturbed(values: list[list[float]], scale: float, phase: float) -> list[list[float]]:
    # Deterministic, layout-independent offsets so ratios, clipping and KL are non-trivial.
    return [[v + scale * math.sin(3.1 * i + 1.7 * j + phase) for j, v in enumerate(row)]
            for i, row in enumerate(values)]


def layout_child(rank: int, world: int, layout: dict, hf_dir: str, data: dict, modes: tuple) -> dict:
    import torch
    from transformers import AutoConfig

    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime_plugins.models.hf_weights import load_hf_weights

    args = layout_args(layout)
    init_model_parallel(args)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    model, optimizer, scheduler = build_model_and_optimizer(args, hf_config)
    load_hf_weights(model, hf_dir, hf_config)
    data = copy.deepcopy(data)
    (plan,) = plans_for_this_rank(data, args)
    log_probs = compute_log_probs(model, data, plan, args)
    mine = [row if row else [0.0] * n for row, n in zip(log_probs, data["response_lengths"])]
    data["log_probs"] = _perturbed(mine, 0.3, 0.0)
    data["ref_log_probs"] = _perturbed(mine, 0.2, 1.0)
    data["rollout_log_probs"] = _perturbed(mine, 0.5, 2.0)
    steps, step_seconds = {}, []
    for mode in modes:  # a mode may repeat (benchmarks); steps keeps its last result
        start = time.perf_counter()
        result = train_one_step(model, optimizer, scheduler, data, plan, layout_args(layout, **mode_args(mode)))
        steps[mode] = dict(loss=result.loss, grad_norm=result.grad_norm, metrics=result.metrics,
                           skipped=result.skipped, seconds=time.perf_counter() - start,
                           num_micro_batches=result.num_micro_batches)
        step_seconds.append(steps[mode]["seconds"])
    return dict(rank=rank, log_probs=log_probs, steps=steps, step_seconds=step_seconds, plan=plan.fingerprint_fields(),
                padding=plan.num_padding_micro_batches, torch_threads=torch.get_num_threads())


def mode_args(mode: str) -> dict:
    return {"per_token": dict(calculate_per_token_loss=True),
            "per_sample": dict(calculate_per_token_loss=False)}[mode]
