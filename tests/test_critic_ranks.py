"""The critic on 4 gloo ranks as TP2 x SP x CP2, through the trainer's own step machinery: the value model built by
its provider (value head before the DDP wrap), loaded from an HF token-classification checkpoint, gives transformers'
values on every response token (CP zig-zag slices gathered as the log-probs are); then critic steps with the
clipped value loss (train_one_step with the critic's objective) drive the values towards the returns; the trained
critic saved and loaded into a fresh one gives the same values and the same next step. With --enable-lora (TP2 x SP),
the critic the driver's flags build trains its adapters and value head only, and resumes them exactly."""
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


def _critic_child(rank, world, hf_dir, data, ckpt_dir):
    from transformers import AutoConfig

    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.megatron_utils.train_step import train_one_step
    from slime.backends.megatron_utils.value_head import load_value_model
    from slime.backends.megatron_utils.value_loss import compute_values, value_objective

    args = layout_args(LAYOUT, custom_model_provider_path="slime.backends.megatron_utils.value_head.value_model_provider",
                       lr=3e-4, value_clip=100.0, clip_grad=10.0, advantage_estimator="ppo")
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
                keys=sorted(losses[0]), **_round_trip(args, hf_config, model, optimizer, scheduler, data, plan,
                                                      ckpt_dir))


def _round_trip(args, hf_config, model, optimizer, scheduler, data, plan, ckpt_dir):
    """The trained critic saved (weights, head, optimizer) and loaded into a fresh one: the same values, and the
    same next step."""
    from slime.backends.megatron_utils.checkpoint import load_checkpoint, save_checkpoint
    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.train_step import train_one_step
    from slime.backends.megatron_utils.value_loss import compute_values, value_objective

    save_checkpoint(ckpt_dir, 7, model, optimizer, scheduler)
    saved_values = compute_values(model, data, plan, args)
    fresh, fresh_optimizer, fresh_scheduler = build_model_and_optimizer(args, hf_config)
    iteration = load_checkpoint(ckpt_dir, fresh, fresh_optimizer, fresh_scheduler)
    loaded_values = compute_values(fresh, data, plan, args)
    steps = [train_one_step(m, o, s, data, plan, args, objective=value_objective(args)).metrics["value_loss"]
             for m, o, s in ((model, optimizer, scheduler), (fresh, fresh_optimizer, fresh_scheduler))]
    return dict(iteration=iteration, saved_values=saved_values, loaded_values=loaded_values, next_steps=steps)


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
def test_critic_values_and_value_loss_steps_at_tp2_sp_cp2(critic_checkpoint, tmp_path):
    hf_dir, reference = critic_checkpoint
    data = make_rollout(num_samples=6, vocab=reference.config.vocab_size)
    results = run_ranks(_critic_child, 4, args=(hf_dir, data, str(tmp_path / "critic")), timeout_s=240)
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

    # saved and loaded critic state is identical: the values, and the next step (weights + Adam state)
    for result in results:
        assert result["iteration"] == 7
        assert result["loaded_values"] == result["saved_values"]
        assert result["next_steps"][1] == result["next_steps"][0]


# ------------------------------------------------------------------ LoRA on the critic

LORA_LAYOUT = dict(tensor_model_parallel_size=2, sequence_parallel=True)


def _lora_critic_args():
    """The critic's flags as the driver derives them (critic_role.critic_args) from a LoRA run's."""
    from slime.config.critic_role import critic_args
    from test_lora import LORA

    run = layout_args({**LORA_LAYOUT, **LORA}, advantage_estimator="ppo", actor_num_gpus_per_node=2, use_critic=True,
                      value_clip=100.0,
                      clip_grad=10.0, lr=3e-4, critic_lr=None,
                      lr_warmup_iters=0, critic_lr_warmup_iters=None, critic_load=None, critic_save=None, load=None,
                      save=None, only_train_params_name_list=None, critic_overrides={})
    return critic_args(run)


def _lora_critic_child(rank, world, hf_dir, data, ckpt_dir):
    from transformers import AutoConfig

    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.megatron_utils.train_step import train_one_step
    from slime.backends.megatron_utils.value_head import load_value_model
    from slime.backends.megatron_utils.value_loss import compute_values, value_objective

    args = _lora_critic_args()
    init_model_parallel(args)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    model, optimizer, scheduler = build_model_and_optimizer(args, hf_config)
    load_value_model(model, hf_dir, hf_config)
    optimizer.reload_model_params()
    named = dict(model[0].module.named_parameters())
    trainable = sorted(n for n, p in named.items() if p.requires_grad)
    in_optimizer = sum(len(g["params"]) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                       for g in opt.optimizer.param_groups)
    data = copy.deepcopy(data)
    (plan,) = plans_for_this_rank(data, args)
    values = compute_values(model, data, plan, args)
    data["values"] = [row if row else [0.0] * n for row, n in zip(values, data["response_lengths"])]
    data["returns"] = [[1.0] * n for n in data["response_lengths"]]
    before = {n: p.detach().clone() for n, p in named.items()}
    # B starts at zero, so A gets no gradient in the first step: the second is the one where every factor moves
    losses = [train_one_step(model, optimizer, scheduler, data, plan, args, objective=value_objective(args)).metrics
              ["value_loss"] for _ in range(2)]
    moved = sorted(n for n, p in named.items() if not torch.equal(p.detach(), before[n]))
    return dict(trainable=trainable, in_optimizer=in_optimizer, moved=moved, losses=losses,
                train_in_full=args.only_train_params_name_list,
                **_round_trip(args, hf_config, model, optimizer, scheduler, data, plan, ckpt_dir))


@pytest.mark.timeout(240)
def test_a_lora_critic_trains_its_adapters_and_its_value_head_only(critic_checkpoint, tmp_path):
    """--enable-lora under ppo: the critic, built from the run's flags as the driver does, at TP2 x SP, has adapters
    on the actor's target modules and its value head trainable and in its optimizer, nothing else; two critic
    steps move exactly those (the head and B in the first, A in the second) and lower the value loss; saved and
    loaded into a fresh LoRA critic (--save/--load: <save>/critic), it gives the same values and next step."""
    from slime.config.critic_role import VALUE_HEAD_PARAM

    hf_dir, reference = critic_checkpoint
    data = make_rollout(num_samples=4, vocab=reference.config.vocab_size)
    results = run_ranks(_lora_critic_child, 2, args=(hf_dir, data, str(tmp_path / "critic")), timeout_s=200)
    for result in results:
        assert result["train_in_full"] == [VALUE_HEAD_PARAM]
        adapters = [n for n in result["trainable"] if ".lora.lora_" in n]
        assert len(adapters) == 2 * 4 * 2 and result["trainable"] == sorted(adapters + ["output_layer.weight"])
        assert result["in_optimizer"] == len(result["trainable"])
        assert result["moved"] == result["trainable"], "a frozen base weight moved, or an adapter did not"
        assert result["losses"] == results[0]["losses"] and result["losses"][1] < result["losses"][0]
        assert result["iteration"] == 7 and result["loaded_values"] == result["saved_values"]
        assert result["next_steps"][1] == result["next_steps"][0]
