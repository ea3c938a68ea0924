"""The critic on 4 gloo ranks as TP2 x SP x CP2, through the trainer's own step machinery: the value model built by
its provider (value head before the DDP wrap), loaded from an HF token-classification checkpoint, gives transformers'
values on every response token (CP zig-zag slices gathered as the log-probs are); then critic steps with the
clipped value loss (train_one_step with the critic's objective) drive the values towards the returns."""
from __future__ import annotations

import copy

import pytest
import torch

from mp_utils import run_ranks
from tiny_models import tiny_qwen3_config
from train_step_harness import layout_args, make_rollout, plans_for_this_rank

pytestmark = pytest.mark.ranks

LAYOUT = dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2)
STEPS = 4


def _critic_child(rank, world, hf_dir, data):
    from transformers import AutoConfig

    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.megatron_utils.train_step import train_one_step
    from slime.backends.megatron_utils.value_head import load_value_model
    from slime.backends.megatron_utils.value_loss import compute_values, value_objective

    args = layout_args(LAYOUT, custom_model_provider_path="slime.backends.megatron_utils.value_head.value_model_provider",
                       lr=3e-4, value_clip=100.0, clip_grad=10.0)
    init_model_parallel(args)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    model, optimizer, scheduler = build_model_and_optimizer(args, hf_config)
    head_loaded = load_value_model(model, hf_dir, hf_config)
    data = copy.deepcopy(data)
    (plan,) = plans_for_this_rank(data, args)
    values = compute_values(model, data, plan, args)
    data["values"] = [row if row else [0.0] * n for row, n in zip(values, data["response_lengths"])]
    data["returns"] = [[1.0] * n for n in data["response_lengths"]]
    losses = [train_one_step(model, optimizer, scheduler, data, plan, args, objective=value_objective(args)).metrics
              for _ in range(STEPS)]
    return dict(values=values, head_loaded=head_loaded, losses=[m["value_loss"] for m in losses],
                keys=sorted(losses[0]))


@pytest.fixture(scope="module")
def critic_checkpoint(tmp_path_factory):
    from transformers import Qwen3ForTokenClassification

    torch.manual_seed(0)
    reference = Qwen3ForTokenClassification(tiny_qwen3_config(num_labels=1)).float().eval()
    torch.nn.init.normal_(reference.score.weight, std=0.5)
    path = str(tmp_path_factory.mktemp("tiny_qwen3_critic"))
    reference.save_pretrained(path, safe_serialization=True)
    return path, reference


@pytest.mark.timeout(300)
def test_critic_values_and_value_loss_steps_at_tp2_sp_cp2(critic_checkpoint):
    hf_dir, reference = critic_checkpoint
    data = make_rollout(num_samples=6, vocab=reference.config.vocab_size)
    results = run_ranks(_critic_child, 4, args=(hf_dir, data), timeout_s=240)
    with torch.no_grad():
        for i, (tokens, response) in enumerate(zip(data["tokens"], data["response_lengths"])):
            expected = reference(torch.tensor([tokens])).logits[0, :, 0]
            prompt = len(tokens) - response
            got = results[0]["values"][i]  # DP size 1: every rank holds every sample's values
            assert got == pytest.approx(expected[prompt - 1: prompt - 1 + response].tolist(), abs=1e-5)
    for result in results:
        assert result["head_loaded"] and result["keys"] == ["loss", "value_clipfrac", "value_loss", "values"]
        assert result["values"] == results[0]["values"]
        assert result["losses"] == results[0]["losses"]  # one reduced loss for all 4 ranks
    losses = results[0]["losses"]
    # the critic's steps fit the returns, every step (measured 9.4, 5.3, 2.3, 0.57)
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.2 * losses[0], losses
