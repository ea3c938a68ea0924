"""Padding tokens and the MoE router: packing marks them, and the router leaves them out of the expert-bias token
counts and the aux loss, so a step's bias update and aux gradient are those of its real tokens whatever the
layout pads (sequences to multiples of 2 x CP x TP, padding micro-batches for DP)."""

from __future__ import annotations

import copy

import pytest
import torch

from mp_utils import run_ranks
from tiny_models import save_tiny_glm4_moe
from train_step_harness import make_rollout

pytestmark = pytest.mark.ranks


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_glm4_moe(str(tmp_path_factory.mktemp("glm4_moe")))


def _even_lengths(data: dict) -> dict:
    """The rollout with every sequence one response token longer where it is odd: no padding at a multiple of 2."""
    data = copy.deepcopy(data)
    for i, tokens in enumerate(data["tokens"]):
        if len(tokens) % 2:
            tokens.append(tokens[-1])
            data["response_lengths"][i] += 1
            data["loss_masks"][i].append(1)
            data["advantages"][i].append(data["advantages"][i][-1])
    return data


def test_packing_marks_the_padding_of_every_cp_slice():
    """padding_mask is True exactly past each sequence's tokens, sliced like the tokens; a padding micro-batch is
    padding throughout."""
    from slime.backends.megatron_utils.data import pack_micro_batch, zigzag_gather

    data = make_rollout(num_samples=3, seed=4)
    for cp, tp in ((1, 1), (2, 2)):
        slices = [pack_micro_batch(data, (0, 1, 2), cp_size=cp, cp_rank=r, tp_size=tp, sequence_parallel=True)
                  for r in range(cp)]
        assert all(s.padding_mask.shape == s.input_ids.shape and s.padding_mask.dtype == torch.bool for s in slices)
        offsets = [0, *torch.tensor(slices[0].local_lengths).cumsum(0).tolist()]  # the same on every CP rank
        per_sequence = [zigzag_gather([s.padding_mask[0, offsets[k]: offsets[k + 1]] for s in slices])
                        for k in range(3)]
        for mask, tokens, padded in zip(per_sequence, data["tokens"], slices[0].padded_lengths):
            assert mask.tolist() == [i >= len(tokens) for i in range(padded)]
        assert sum(int(m.sum()) for m in per_sequence) > 0
    dummy = pack_micro_batch(data, (), cp_size=2, cp_rank=1, tp_size=2, sequence_parallel=True)
    assert bool(dummy.padding_mask.all())


def _padding_child(rank, world, hf_dir, data):
    """One rank, the same planned micro-batches packed twice: as they are (no padding) and padded to multiples of
    8 plus a padding micro-batch (a TP4 x SP layout's padding). Per packing: the routers' token counts, the expert
    bias after finalize_model_grads, and the router weights' gradients (policy loss and aux loss)."""
    from megatron.core.distributed import finalize_model_grads

    from slime.backends.megatron_utils.data import pack_micro_batch
    from slime.backends.megatron_utils.train_step import (
        compute_log_probs,
        policy_objective,
        run_forward_backward,
        zero_grads,
    )
    from slime.models.hf_weights import unwrap_model
    from train_step_harness import build_loaded_model, layout_args, plans_for_this_rank

    args = layout_args(dict(calculate_per_token_loss=True, expert_tensor_parallel_size=1,
                            moe_router_bias_update_rate=0.05, moe_aux_loss_coeff=0.01))
    model, optimizer, _ = build_loaded_model(args, hf_dir)
    routers = [m for m in unwrap_model(model[0]).modules() if getattr(m, "expert_bias", None) is not None]
    start = [r.expert_bias.clone() for r in routers]
    (plan,) = plans_for_this_rank(data, args)
    log_probs = compute_log_probs(model, data, plan, args)
    data = dict(data, log_probs=log_probs, ref_log_probs=log_probs, rollout_log_probs=log_probs)
    objective = policy_objective(args)

    def step(packed):
        for router, bias in zip(routers, start):
            router.expert_bias.copy_(bias)
        zero_grads(model, optimizer)
        run_forward_backward(model, packed, plan, objective)
        counts = [r.local_tokens_per_expert.clone() for r in routers]
        finalize_model_grads(list(model), None)
        return dict(counts=counts, bias=[r.expert_bias.clone() for r in routers],
                    grads=[r.weight.main_grad.clone() for r in routers],
                    padding=sum(int(b.padding_mask.sum()) for b in packed))

    def pack(sample_ids, tp_size):
        return pack_micro_batch(data, sample_ids, cp_size=1, cp_rank=0, tp_size=tp_size, sequence_parallel=True)

    bare = step([pack(mb, 1) for mb in plan.micro_batches])
    padded = step([pack(mb, 4) for mb in plan.micro_batches] + [pack((), 4)])
    return dict(bare=bare, padded=padded, start=start, topk=routers[0].topk)


@pytest.mark.timeout(120)
def test_padding_leaves_the_expert_bias_update_and_aux_loss_alone(hf_dir):
    """fp32: the same tokens with and without padding give the same expert counts (topk per real token), the same
    expert-bias update, and the same router gradients with the aux loss on (finite: the padding micro-batch's
    aux loss has no real token)."""
    data = _even_lengths(make_rollout(num_samples=4, seed=2, max_len=20))
    (result,) = run_ranks(_padding_child, 1, args=(hf_dir, data), timeout_s=100)
    bare, padded = result["bare"], result["padded"]
    assert bare["padding"] == 0 and padded["padding"] > 0
    real_tokens = sum(len(t) for t in data["tokens"])
    for got, want in zip(padded["counts"], bare["counts"]):
        assert int(want.sum()) == result["topk"] * real_tokens
        assert torch.equal(got, want)
    for got, want, start in zip(padded["bias"], bare["bias"], result["start"]):
        assert not torch.equal(want, start)  # the step moved it
        assert torch.equal(got, want)
    for got, want in zip(padded["grads"], bare["grads"]):
        assert bool(torch.isfinite(got).all()) and float(want.abs().max()) > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)


def _step_child(rank, world, hf_dir, data, layout):
    """One training step: loss, grad norm and this stage's expert biases by global layer number."""
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime.models.hf_weights import unwrap_model
    from train_step_harness import build_loaded_model, layout_args, plans_for_this_rank

    args = layout_args(layout)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    (plan,) = plans_for_this_rank(data, args)
    log_probs = compute_log_probs(model, data, plan, args)
    log_probs = [row if row else [0.0] * n for row, n in zip(log_probs, data["response_lengths"])]
    data = dict(data, log_probs=log_probs, ref_log_probs=log_probs, rollout_log_probs=log_probs)
    step = train_one_step(model, optimizer, scheduler, data, plan, args)
    layers = unwrap_model(model[0]).decoder.layers
    biases = {layer.layer_number: layer.mlp.router.expert_bias.clone() for layer in layers
              if getattr(getattr(layer.mlp, "router", None), "expert_bias", None) is not None}
    return dict(loss=step.loss, grad_norm=step.grad_norm, biases=biases)


@pytest.mark.timeout(200)
def test_a_later_pipeline_stage_masks_its_sequence_parallel_chunk(hf_dir):
    """PP2 x TP2 x SP (sequences padded to multiples of 4): the second stage's router gets its SP chunk of the mask,
    and every stage's bias update, the loss and the grad norm (aux loss on) equal the single process's."""
    data = make_rollout(num_samples=4, seed=2, max_len=20)
    base = dict(calculate_per_token_loss=True, expert_tensor_parallel_size=1, moe_router_bias_update_rate=0.05,
                moe_aux_loss_coeff=0.01)
    (single,) = run_ranks(_step_child, 1, args=(hf_dir, data, base), timeout_s=90)
    layout = dict(base, pipeline_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True,
                  expert_tensor_parallel_size=2, decoder_last_pipeline_num_layers=1)
    results = run_ranks(_step_child, 4, args=(hf_dir, data, layout), timeout_s=150)
    staged = {number: bias for result in results for number, bias in result["biases"].items()}
    assert sorted(staged) == sorted(single["biases"]) == [2, 3]  # layer 1 is dense; layer 3 on the second stage
    for number, bias in single["biases"].items():
        assert torch.equal(staged[number], bias)
    for result in results:
        assert result["loss"] == pytest.approx(single["loss"], abs=1e-5)
        assert result["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
