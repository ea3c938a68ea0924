"""LoRA (slime/models/lora.py) on the tensor-parallel linear layers: TP2 (with and without SP) gives TP1's
log-probs, loss, gradients and merged weights; the optimizer holds the adapters only; the merged export is what
the trainer computes (a transformers model loaded with it gives the trainer's log-probs)."""

from __future__ import annotations

import copy

import pytest
import torch

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3
from train_step_harness import make_rollout

pytestmark = pytest.mark.ranks

LORA = dict(enable_lora=True, lora_target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
            lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lr=0.05)


def _full_factors(model):
    """name -> (full A, full B) of every adapter, gathered over TP (the split factor's partition dim)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from slime.models.lora import adapted_layers

    tp = parallel_state.get_tensor_model_parallel_world_size()
    factors = {}
    for name, layer in adapted_layers(model[0].module):
        full = []
        for param in (layer.lora.lora_A, layer.lora.lora_B):
            value = param.detach()
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                shards = [torch.empty_like(value) for _ in range(tp)]
                dist.all_gather(shards, value.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
                value = torch.cat(shards, dim=param.partition_dim)
            full.append(value.clone())
        factors[name] = tuple(full)
    return factors


def _lora_child(rank, world, layout, hf_dir, data):
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime_plugins.models.hf_weights import export_hf_weights
    from train_step_harness import build_loaded_model, layout_args, plans_for_this_rank
    from transformers import AutoConfig

    args = layout_args({**layout, **LORA})
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    trainable = [n for n, p in model[0].module.named_parameters() if p.requires_grad]
    in_optimizer = sum(len(g["params"]) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                       for g in opt.optimizer.param_groups)
    data = copy.deepcopy(data)
    (plan,) = plans_for_this_rank(data, args)
    log_probs = compute_log_probs(model, data, plan, args)
    rows = [row if row else [0.0] * n for row, n in zip(log_probs, data["response_lengths"])]
    data["log_probs"] = [[v + 0.05 * (j % 3) for j, v in enumerate(row)] for row in rows]
    data["ref_log_probs"] = [[v - 0.1 for v in row] for row in rows]
    data["rollout_log_probs"] = [[v + 0.02 for v in row] for row in rows]
    base_before = {n: p.detach().clone() for n, p in model[0].module.named_parameters() if not p.requires_grad}
    # B starts at zero (so A gets no gradient): the second step is the one where both factors learn
    first = train_one_step(model, optimizer, scheduler, data, plan, args)
    result = train_one_step(model, optimizer, scheduler, data, plan, args)
    base_moved = [n for n, p in model[0].module.named_parameters() if not p.requires_grad
                  and not torch.equal(p.detach(), base_before[n])]
    exported = {n: t.clone() for n, t in export_hf_weights(model, AutoConfig.from_pretrained(hf_dir))}
    after = compute_log_probs(model, data, plan, args)
    return dict(log_probs=log_probs, after=after, first_loss=first.loss, loss=result.loss, grad_norm=result.grad_norm,
                factors=_full_factors(model), exported=exported if rank == 0 else None, trainable=trainable,
                in_optimizer=in_optimizer, base_moved=base_moved)


def _hf_log_probs(hf_dir, exported, data):
    """Log-probs of the responses under a transformers model holding the exported (merged) weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(exported, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(exported), (missing, unexpected)
    out = []
    with torch.no_grad():
        for tokens, n in zip(data["tokens"], data["response_lengths"]):
            logits = model(torch.tensor([tokens])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
            out.append(lp[-n:].tolist())
    return out


@pytest.mark.timeout(300)
def test_lora_tp2_sp_equals_tp1_and_merged_export_is_the_trainers_model(tmp_path):
    """TP1, TP2 and TP2 x SP, two steps from the initial adapters: the same log-probs, losses, grad norms,
    updated adapters (A and B gathered) and merged weights; only the adapters are trainable and in the optimizer, the base does not move; the
    merged HF export loaded into transformers gives the trainer's log-probs after the step."""
    hf_dir = save_tiny_qwen3(str(tmp_path / "qwen3"))
    data = make_rollout(num_samples=4, seed=3)
    layouts = {"tp1": ({}, 1), "tp2": (dict(tensor_model_parallel_size=2), 2),
               "tp2_sp": (dict(tensor_model_parallel_size=2, sequence_parallel=True), 2)}
    runs = {key: run_ranks(_lora_child, world, args=(layout, hf_dir, data), timeout_s=240)
            for key, (layout, world) in layouts.items()}
    ref = runs["tp1"][0]
    assert len(ref["trainable"]) == 2 * 4 * 2 and all(".lora.lora_" in n for n in ref["trainable"])
    assert ref["in_optimizer"] == len(ref["trainable"]) and ref["base_moved"] == []
    assert ref["grad_norm"] > 0 and ref["after"] != ref["log_probs"], "the adapters did not learn"
    assert ref["first_loss"] != ref["loss"]
    for key in ("tp2", "tp2_sp"):
        for r in runs[key]:
            assert r["in_optimizer"] == len(r["trainable"]) and r["base_moved"] == []
            assert abs(r["loss"] - ref["loss"]) < 1e-5 and abs(r["grad_norm"] - ref["grad_norm"]) < 1e-5, key
            for got, want in zip(r["log_probs"] + r["after"], ref["log_probs"] + ref["after"]):
                assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4), key
            for name, (a, b) in ref["factors"].items():
                assert torch.allclose(r["factors"][name][0], a, atol=2e-5), (key, name, "A")
                if "linear_fc1" not in name:  # a TP shard of fc1 holds [gate_r; up_r]: the merged export checks it
                    assert torch.allclose(r["factors"][name][1], b, atol=2e-5), (key, name, "B")
        exported = runs[key][0]["exported"]
        assert sorted(exported) == sorted(ref["exported"])
        assert max(float((exported[n] - t).abs().max()) for n, t in ref["exported"].items()) < 2e-5, key
    hf = _hf_log_probs(hf_dir, ref["exported"], data)
    for got, want in zip(hf, ref["after"]):
        assert torch.allclose(torch.tensor(got), torch.tensor(want[-len(got):]), atol=1e-4)
