"""LoRA (slime/models/lora.py) on the tensor-parallel linear layers: TP2 (with and without SP) gives TP1's
log-probs, loss, gradients and merged weights; the optimizer holds the adapters only; the merged export is what
the trainer computes (a transformers model loaded with it gives the trainer's log-probs); adapters resume
exactly; the push after the first sends the adapted layers only. On routed MoE experts: EP2 (sequential experts)
gives EP1's (grouped experts) step, and the merged export is W + alpha/r B A per expert. Bad LoRA flags fail
before Ray starts; under PPO the critic's flags give it the same adapters and a value head trained in full (its
step: test_critic_ranks.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from arg_testing import no_real_sglang, parse_error, parse_quiet  # noqa: F401 (fixture)
from mp_utils import run_ranks
from slime.config.critic_role import VALUE_HEAD_PARAM, critic_args
from slime.utils.arguments import parse_args
from tiny_models import save_tiny_qwen3, save_tiny_qwen3_moe
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


def _resumes_exactly(model, optimizer, scheduler, data, plan, args, ckpt):
    """Save, take a step, load, take the step again: the same loss and adapters, bit for bit."""
    from slime.backends.megatron_utils.checkpoint import load_checkpoint, save_checkpoint
    from slime.backends.megatron_utils.train_step import train_one_step

    save_checkpoint(ckpt, 2, model, optimizer, scheduler)
    first = train_one_step(model, optimizer, scheduler, data, plan, args).loss, _full_factors(model)
    load_checkpoint(ckpt, model, optimizer, scheduler)
    again = train_one_step(model, optimizer, scheduler, data, plan, args).loss, _full_factors(model)
    return first[0] == again[0] and all(torch.equal(a, b) for name in first[1]
                                        for a, b in zip(first[1][name], again[1][name]))


def _push_subset(model, hf_config, tp):
    """The plan and the export of a push after the first: the adapted layers' (merged) weights only."""
    from slime.backends.weight_sync.plan import build_weight_sync_plan
    from slime.models.hf_weights import export_hf_weights
    from slime.models.lora import adapted_weight_names

    select = adapted_weight_names(model)
    full = build_weight_sync_plan(model, hf_config, tp_size=tp, bucket_bytes=1 << 16)
    part = build_weight_sync_plan(model, hf_config, tp_size=tp, bucket_bytes=1 << 16, select=select)
    sent = [name for name, _ in export_hf_weights(model, hf_config, select=select)]
    return dict(full=full.names(), part=part.names(), sent=sent, fraction=part.total_bytes / full.total_bytes)


def _lora_child(rank, world, layout, hf_dir, data, ckpt):
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime_plugins.models.hf_weights import export_hf_weights
    from train_step_harness import build_loaded_model, layout_args, with_policy_log_probs
    from transformers import AutoConfig

    args = layout_args({**layout, **LORA})
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    trainable = [n for n, p in model[0].module.named_parameters() if p.requires_grad]
    in_optimizer = sum(len(g["params"]) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                       for g in opt.optimizer.param_groups)
    data, plan, log_probs = with_policy_log_probs(model, data, args)
    base_before = {n: p.detach().clone() for n, p in model[0].module.named_parameters() if not p.requires_grad}
    # B starts at zero (so A gets no gradient): the second step is the one where both factors learn
    first = train_one_step(model, optimizer, scheduler, data, plan, args)
    result = train_one_step(model, optimizer, scheduler, data, plan, args)
    base_moved = [n for n, p in model[0].module.named_parameters() if not p.requires_grad
                  and not torch.equal(p.detach(), base_before[n])]
    exported = {n: t.clone() for n, t in export_hf_weights(model, AutoConfig.from_pretrained(hf_dir))}
    after = compute_log_probs(model, data, plan, args)
    from slime.backends.megatron_utils.checkpoint import save_hf_checkpoint
    from slime.backends.megatron_utils.model import lora_config

    save_hf_checkpoint(ckpt + "_hf", model, AutoConfig.from_pretrained(hf_dir), hf_dir, lora_config=lora_config(args))
    push, factors = _push_subset(model, AutoConfig.from_pretrained(hf_dir), world), _full_factors(model)
    resumed = _resumes_exactly(model, optimizer, scheduler, data, plan, args, ckpt)
    return dict(push=push, resumed=resumed, log_probs=log_probs, after=after, first_loss=first.loss, loss=result.loss, grad_norm=result.grad_norm,
                factors=factors, exported=exported if rank == 0 else None, trainable=trainable,
                in_optimizer=in_optimizer, base_moved=base_moved)


def _hf_log_probs(hf_dir, exported, data):
    """Log-probs of the responses under a transformers model holding the exported (merged) weights (those of
    `hf_dir` itself when `exported` is None)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if exported is not None:
        missing, unexpected = model.load_state_dict(exported, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"} - set(exported), (missing, unexpected)
    out = []
    with torch.no_grad():
        for tokens, n in zip(data["tokens"], data["response_lengths"]):
            logits = model(torch.tensor([tokens])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
            out.append(lp[-n:].tolist())
    return out


def _check_peft_adapter(saved, hf_dir, merged):
    import json

    from safetensors.torch import load_file

    config = json.loads((saved / "lora_adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == LORA["lora_rank"]
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"])
    adapter = load_file(str(saved / "lora_adapter" / "adapter_model.safetensors"))
    base = load_file(f"{hf_dir}/model.safetensors")
    assert len(adapter) == 2 * 2 * 7
    scale = LORA["lora_alpha"] / LORA["lora_rank"]
    for name, a in adapter.items():
        if ".lora_A." not in name:
            continue
        module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = adapter[name.replace("lora_A", "lora_B")]
        weight = f"{module}.weight"
        assert torch.allclose(base[weight] + scale * b @ a, merged[weight], atol=1e-5), weight
    assert (saved / "model.safetensors").exists() and not (saved / "adapter_config.json").exists()


def _peft_logits_error(hf_dir, saved) -> tuple[float, float]:
    """PEFT loads the adapter onto the base: its logits against the merged model's (and the base's, which differ)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load(path):
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    ids = torch.randint(1, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged, base = load(saved)(ids).logits, load(hf_dir)(ids).logits
        adapted = PeftModel.from_pretrained(load(hf_dir), str(saved / "lora_adapter")).eval()(ids).logits
    return float((adapted - merged).abs().max()), float((base - merged).abs().max())


@pytest.mark.timeout(300)
def test_lora_tp2_sp_equals_tp1_and_merged_export_is_the_trainers_model(tmp_path):
    """TP1, TP2 and TP2 x SP, two steps from the initial adapters: the same log-probs, losses, grad norms,
    updated adapters (A and B gathered) and merged weights; only the adapters are trainable and in the optimizer, the base does not move; the
    merged HF export loaded into transformers gives the trainer's log-probs after the step, and PEFT's load of the
    exported adapter gives the merged model's logits; a checkpoint
    saved and loaded gives the next step bit for bit."""
    hf_dir = save_tiny_qwen3(str(tmp_path / "qwen3"))
    data = make_rollout(num_samples=4, seed=3)
    layouts = {"tp1": ({}, 1), "tp2": (dict(tensor_model_parallel_size=2), 2),
               "tp2_sp": (dict(tensor_model_parallel_size=2, sequence_parallel=True), 2)}
    runs = {key: run_ranks(_lora_child, world, args=(layout, hf_dir, data, str(tmp_path / key)), timeout_s=240)
            for key, (layout, world) in layouts.items()}
    ref = runs["tp1"][0]
    assert len(ref["trainable"]) == 2 * 4 * 2 and all(".lora.lora_" in n for n in ref["trainable"])
    assert ref["in_optimizer"] == len(ref["trainable"]) and ref["base_moved"] == []
    assert ref["resumed"], "--save/--load did not restore the adapters and their optimizer state"
    assert ref["grad_norm"] > 0 and ref["after"] != ref["log_probs"], "the adapters did not learn"
    assert ref["first_loss"] != ref["loss"]
    for key in ("tp2", "tp2_sp"):
        for r in runs[key]:
            assert r["in_optimizer"] == len(r["trainable"]) and r["base_moved"] == []
            assert r["resumed"], f"{key}: --save/--load did not restore the adapters and their optimizer state"
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
    for key, results in runs.items():
        push = results[0]["push"]
        adapted = {n for n in push["full"] if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj")}
        assert list(push["part"]) == push["sent"] and set(push["part"]) == adapted and len(adapted) == 2 * 7, key
        assert 0 < push["fraction"] < 1, push["fraction"]
    for key in runs:  # the PEFT adapter: PEFT's names and config; base + alpha/r * B @ A is the merged export
        _check_peft_adapter(tmp_path / f"{key}_hf", hf_dir, ref["exported"])
    peft_error, base_error = _peft_logits_error(hf_dir, tmp_path / "tp2_sp_hf")
    assert peft_error < 1e-4 < base_error, (peft_error, base_error)
    hf = _hf_log_probs(hf_dir, ref["exported"], data)
    for got, want in zip(hf, ref["after"]):
        assert torch.allclose(torch.tensor(got), torch.tensor(want[-len(got):]), atol=1e-4)


def _train_in_full_child(rank, world, hf_dir, data):
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime.models.lora import peft_unexportable
    from train_step_harness import build_loaded_model, layout_args, plans_for_this_rank
    from transformers import AutoConfig

    args = layout_args({**LORA, "only_train_params_name_list": ["output_layer"]})
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    trainable = [n for n, p in model[0].module.named_parameters() if p.requires_grad]
    in_optimizer = sum(len(g["params"]) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                       for g in opt.optimizer.param_groups)
    data = copy.deepcopy(data)
    (plan,) = plans_for_this_rank(data, args)
    rows = [row if row else [0.0] * n for row, n in zip(compute_log_probs(model, data, plan, args),
                                                        data["response_lengths"])]
    data["log_probs"] = [[v + 0.05 * (j % 3) for j, v in enumerate(row)] for row in rows]
    data["ref_log_probs"], data["rollout_log_probs"] = rows, rows
    before = {n: p.detach().clone() for n, p in model[0].module.named_parameters()}
    train_one_step(model, optimizer, scheduler, data, plan, args)
    moved = sorted(n for n, p in model[0].module.named_parameters() if not torch.equal(p.detach(), before[n]))
    return dict(trainable=trainable, in_optimizer=in_optimizer, moved=moved, reason=peft_unexportable(model),
                push=_push_subset(model, AutoConfig.from_pretrained(hf_dir), 1))


@pytest.mark.timeout(120)
def test_lora_trains_the_only_train_params_in_full_beside_the_adapters(tmp_path):
    """--enable-lora --only-train-params-name-list output_layer (PEFT's modules_to_save): the output layer is
    trainable and in the optimizer beside the adapters and moves in the first step (B is still zero there, so
    nothing else does); the push after the first sends it with the adapted layers; no PEFT adapter is written."""
    hf_dir = save_tiny_qwen3(str(tmp_path / "qwen3"))
    (r,) = run_ranks(_train_in_full_child, 1, args=(hf_dir, make_rollout(num_samples=4, seed=3)), timeout_s=100)
    adapters = [n for n in r["trainable"] if ".lora.lora_" in n]
    assert sorted(r["trainable"]) == sorted(adapters + ["output_layer.weight"]) and len(adapters) == 2 * 4 * 2
    assert r["in_optimizer"] == len(r["trainable"])
    assert "output_layer.weight" in r["moved"] and all(".lora.lora_B" in n or n == "output_layer.weight"
                                                       for n in r["moved"]), r["moved"]
    assert "lm_head.weight" in r["push"]["part"] and "model.embed_tokens.weight" not in r["push"]["part"]
    assert list(r["push"]["part"]) == r["push"]["sent"] and len(r["push"]["part"]) == 2 * 7 + 1
    assert "output_layer.weight" in r["reason"]


# ------------------------------------------------------------------ routed MoE experts

# per-token loss: EP2 is DP2 here, and only the per-token denominator is independent of the DP split
EXPERT_LORA = {**LORA, "lora_target_modules": ["linear_fc1", "linear_fc2"], "calculate_per_token_loss": True}


def _global_expert_factors(model):
    """'decoder.layers.<l>.mlp.experts.<global e>.<fc>' -> (A, B) of this rank's expert adapters (ETP 1: whole on
    the rank)."""
    from megatron.core import parallel_state

    from slime.models.lora import adapted_layers

    offset = parallel_state.get_expert_model_parallel_rank()
    factors = {}
    for name, layer in adapted_layers(model[0].module):
        prefix, local, fc = name.rpartition(".local_experts.")[0], *name.rsplit(".", 2)[-2:]
        n_local = len(model[0].module.get_submodule(f"{prefix}.local_experts"))
        key = f"{prefix}.{offset * n_local + int(local)}.{fc}"
        factors[key] = (layer.lora.lora_A.detach().clone(), layer.lora.lora_B.detach().clone())
    return factors


def _expert_lora_child(rank, world, layout, hf_dir, data, out):
    from slime.backends.megatron_utils.checkpoint import save_hf_checkpoint
    from slime.backends.megatron_utils.model import lora_config
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime_plugins.models.hf_weights import export_hf_weights
    from train_step_harness import build_loaded_model, layout_args, with_policy_log_probs
    from transformers import AutoConfig

    args = layout_args({**layout, **EXPERT_LORA})
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    trainable = [n for n, p in model[0].module.named_parameters() if p.requires_grad]
    data, plan, log_probs = with_policy_log_probs(model, data, args)
    base_before = {n: p.detach().clone() for n, p in model[0].module.named_parameters() if not p.requires_grad}
    first = train_one_step(model, optimizer, scheduler, data, plan, args)
    result = train_one_step(model, optimizer, scheduler, data, plan, args)
    base_moved = [n for n, p in model[0].module.named_parameters() if not p.requires_grad
                  and not torch.equal(p.detach(), base_before[n])]
    exported = {n: t.clone() for n, t in export_hf_weights(model, hf_config) if ".experts." in n}
    save_hf_checkpoint(out, model, hf_config, hf_dir, lora_config=lora_config(args))
    return dict(trainable=trainable, base_moved=base_moved, log_probs=log_probs, after=compute_log_probs(
        model, data, plan, args), first_loss=first.loss, loss=result.loss, grad_norm=result.grad_norm,
        factors=_global_expert_factors(model), exported=exported if rank == 0 else None,
        push=_push_subset(model, hf_config, 1))


def _expected_merged(hf_dir, factors):
    """HF expert tensors of the base checkpoint plus alpha/r * B @ A (fc1's rows are [gate; up])."""
    from safetensors.torch import load_file

    base, scale, expected = load_file(f"{hf_dir}/model.safetensors"), LORA["lora_alpha"] / LORA["lora_rank"], {}
    for key, (a, b) in factors.items():
        layer, *_, expert, fc = key.split(".")[2:]  # decoder.layers.<l>.mlp.experts.<e>.<fc>
        hf = f"model.layers.{layer}.mlp.experts.{expert}."
        delta = scale * b @ a
        if fc == "linear_fc1":
            gate, up = delta.chunk(2, dim=0)
            expected[hf + "gate_proj.weight"] = base[hf + "gate_proj.weight"] + gate
            expected[hf + "up_proj.weight"] = base[hf + "up_proj.weight"] + up
        else:
            expected[hf + "down_proj.weight"] = base[hf + "down_proj.weight"] + delta
    return expected


@pytest.mark.timeout(240)
def test_lora_on_routed_experts_ep2_equals_ep1_and_merges_per_expert(tmp_path):
    """LoRA on linear_fc1/fc2 of a Qwen3-MoE (every MLP routed): EP1 through the grouped experts and EP2 through
    megatron's SequentialMLP take the same two steps (loss, grad norm, log-probs, every expert's factors) with
    only the expert adapters trainable and the base unmoved; the merged export is the checkpoint's W + alpha/r
    B @ A for every expert, a transformers model loaded from --save-hf gives the trainer's log-probs, no PEFT
    adapter is written for experts, and the push after the first sends the expert layers only."""
    hf_dir = save_tiny_qwen3_moe(str(tmp_path / "moe"))
    data = make_rollout(num_samples=4, seed=3)
    layouts = {"ep1_grouped": (dict(moe_grouped_gemm=True), 1), "ep2": (dict(expert_model_parallel_size=2), 2)}
    runs = {key: run_ranks(_expert_lora_child, world, args=(layout, hf_dir, data, str(tmp_path / f"{key}_hf")),
                           timeout_s=200) for key, (layout, world) in layouts.items()}
    ref, ep2 = runs["ep1_grouped"][0], runs["ep2"]
    assert ref["trainable"] and all(".local_experts." in n and ".lora.lora_" in n for n in ref["trainable"])
    assert len(ref["trainable"]) == 2 * 8 * 2 * 2 and len(ep2[0]["trainable"]) == 2 * 4 * 2 * 2
    assert ref["grad_norm"] > 0 and ref["first_loss"] != ref["loss"] and ref["after"] != ref["log_probs"]
    factors = {k: v for r in ep2 for k, v in r["factors"].items()}
    assert sorted(factors) == sorted(ref["factors"])
    for r in ep2:
        assert r["base_moved"] == [] and ref["base_moved"] == []
        assert abs(r["loss"] - ref["loss"]) < 1e-5 and abs(r["grad_norm"] - ref["grad_norm"]) < 1e-5
    # EP2 is DP2: each sample's log-probs come from the rank that holds it
    ep2_rows = {key: [next(r[key][i] for r in ep2 if r[key][i]) for i in range(len(data["tokens"]))]
                for key in ("log_probs", "after")}
    for got, want in zip(ep2_rows["log_probs"] + ep2_rows["after"], ref["log_probs"] + ref["after"]):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4)
    for name, (a, b) in ref["factors"].items():
        assert b.abs().max() > 0, f"{name}: the expert's adapter did not learn"
        # Adam turns a near-zero gradient into a +-lr step: such elements may differ by a fraction of lr
        assert torch.allclose(factors[name][0], a, atol=1e-3) and torch.allclose(factors[name][1], b, atol=1e-3)
    for exported, own in ((ref["exported"], ref["factors"]), (ep2[0]["exported"], factors)):
        expected = _expected_merged(hf_dir, own)
        assert sorted(exported) == sorted(expected)
        assert max(float((exported[n] - t).abs().max()) for n, t in expected.items()) < 2e-5
    push = ep2[0]["push"]
    assert list(push["part"]) == push["sent"] and set(push["part"]) == set(expected) and 0 < push["fraction"] < 1
    assert not (tmp_path / "ep2_hf" / "lora_adapter").exists()
    hf = _hf_log_probs(str(tmp_path / "ep2_hf"), None, data)
    for got, want in zip(hf, ep2_rows["after"]):
        assert torch.allclose(torch.tensor(got), torch.tensor(want[-len(got):]), atol=1e-4)


# ------------------------------------------------------------------ flags, before Ray starts


def test_lora_flags_are_checked_before_ray(tmp_path, capsys):
    hf_dir = save_tiny_qwen3(str(tmp_path / "qwen3"))  # hidden 64, heads 4 x 16, ffn 128
    (tmp_path / "p.jsonl").write_text('{"input": "1"}\n')
    minimal = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
               "--train-backend-device", "cpu", "--hf-checkpoint", hf_dir, "--prompt-data", str(tmp_path / "p.jsonl")]
    err = parse_error(minimal + ["--enable-lora", "--lora-target-modules", "linear_qkv", "q_proj"], capsys)
    assert "--lora-target-modules q_proj names no module" in err and "linear_qkv holds q/k/v_proj" in err
    assert "--lora-rank 0: the adapter rank must be positive" in parse_error(
        minimal + ["--enable-lora", "--lora-rank", "0"], capsys)
    err = parse_error(minimal + ["--enable-lora", "--lora-rank", "65", "--lora-target-modules", "linear_fc1",
                                 "linear_proj"], capsys)
    assert "--lora-rank 65 is above the width of linear_fc1 (64" in err
    assert parse_quiet(minimal + ["--enable-lora", "--lora-rank", "64"]).lora_rank == 64
    every = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]  # the default, and PEFT's all-linear
    assert parse_quiet(minimal + ["--enable-lora"]).lora_target_modules == every
    assert parse_quiet(minimal + ["--enable-lora", "--lora-target-modules", "all-linear"]).lora_target_modules == every
    assert "pass it alone" in parse_error(minimal + ["--enable-lora", "--lora-target-modules", "all-linear",
                                                     "linear_qkv"], capsys)
    assert not parse_quiet(minimal + ["--lora-rank", "1000"]).enable_lora  # LoRA off: its flags are not checked
    with pytest.warns(UserWarning, match="--freeze-params-name-list has no effect with --enable-lora"):
        parse_args(minimal + ["--enable-lora", "--freeze-params-name-list", "embedding"])


def test_lora_on_experts_is_checked_and_a_critic_gets_adapters_before_ray(tmp_path, capsys):
    hf_dir = save_tiny_qwen3_moe(str(tmp_path / "moe"))  # hidden 64, routed experts' ffn 32
    (tmp_path / "p.jsonl").write_text('{"input": "1"}\n')
    minimal = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "2",
               "--train-backend-device", "cpu", "--hf-checkpoint", hf_dir, "--prompt-data", str(tmp_path / "p.jsonl"),
               "--enable-lora"]
    err = parse_error(minimal + ["--lora-rank", "33", "--lora-target-modules", "linear_fc2"], capsys)
    assert "--lora-rank 33 is above the width of linear_fc2 (32" in err
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    err = parse_error(minimal + tp2 + ["--lora-rank", "4"], capsys)
    assert "pass --expert-tensor-parallel-size 1 (it is 2" in err and "linear_fc1 linear_fc2" in err
    parsed = parse_quiet(minimal + tp2 + ["--lora-rank", "4", "--expert-tensor-parallel-size", "1"])
    assert parsed.enable_lora and parsed.expert_tensor_parallel_size == 1
    assert parse_quiet(minimal + tp2 + ["--lora-target-modules", "linear_qkv", "linear_proj"]).enable_lora
    # the PPO critic gets the actor's adapters, its value head trained in full beside them (and beside the list's)
    ppo = minimal + ["--advantage-estimator", "ppo", "--critic-load", hf_dir, "--lora-rank", "4"]
    critic = critic_args(parse_quiet(ppo))
    assert critic.enable_lora and critic.lora_rank == 4 and critic.only_train_params_name_list == [VALUE_HEAD_PARAM]
    critic = critic_args(parse_quiet(ppo + ["--only-train-params-name-list", "embedding"]))
    assert critic.only_train_params_name_list == ["embedding", VALUE_HEAD_PARAM]
    full = [flag for flag in ppo if flag != "--enable-lora"]  # without LoRA the head trains as everything does
    assert critic_args(parse_quiet(full)).only_train_params_name_list is None
    assert critic_args(parse_quiet(full + ["--only-train-params-name-list", "embedding"])
                       ).only_train_params_name_list == ["embedding", VALUE_HEAD_PARAM]
