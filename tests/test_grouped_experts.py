"""Grouped experts (slime/models/grouped_experts.py) against megatron's SequentialMLP: the same parameters, the
same numbers on CPU (where the grouped GEMM falls back to a loop over the same expert-sorted layout); the flags
that pick them and the DeepEP fallback."""

from __future__ import annotations

import warnings

import pytest
import torch

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3_moe
from train_step_harness import make_rollout

from slime.config import defaults_namespace

pytestmark = pytest.mark.ranks


def _experts_of(model):
    from slime.models.grouped_experts import GroupedExperts

    return [m for chunk in model for m in chunk.modules() if isinstance(m, GroupedExperts)]


def _step(model, optimizer, scheduler, data, args):
    """Old log-probs, then one training step (lr 0: the weights stay) on a copy of `data`."""
    from slime.backends.megatron_utils.train_step import train_one_step
    from train_step_harness import with_policy_log_probs

    data, plan, log_probs = with_policy_log_probs(model, data, args)
    result = train_one_step(model, optimizer, scheduler, data, plan, args)
    return log_probs, result.loss, result.grad_norm


def _expert_grads(experts, x, counts, probs, out_grad):
    """Output and every gradient (input, routing weights, expert weights) of one experts module."""
    module = experts[0]
    x, probs = x.detach().requires_grad_(), probs.detach().requires_grad_()
    out, _ = module(x, counts, probs)
    return [out.detach(), *torch.autograd.grad(out, [x, probs, *module.parameters()], out_grad)]


def _hf_round_trip_error(model, hf_dir):
    """The HF export of the grouped experts' model against the checkpoint it loaded (names and values)."""
    import os

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from slime_plugins.models.hf_weights import export_hf_weights

    exported = dict(export_hf_weights(model, AutoConfig.from_pretrained(hf_dir)))
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert sorted(exported) == sorted(original)
    return max(float((t - original[n]).abs().max()) for n, t in exported.items())


def _grouped_vs_sequential_child(rank, world, hf_dir, data):
    from train_step_harness import build_loaded_model, layout_args

    args = layout_args(dict(expert_model_parallel_size=world, moe_grouped_gemm=True, calculate_per_token_loss=True,
                            use_distributed_optimizer=True))
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    experts = _experts_of(model)
    assert len(experts) == 2 and experts[0].num_local_experts == 8 // world
    # SequentialMLP's parameter order, so DDP's buffer (and the optimizer checkpoints that follow it) is the same
    order = [name for name, _ in experts[0].named_parameters()]
    in_order = order == [f"local_experts.{i}.linear_fc{j}.weight" for i in range(8 // world) for j in (1, 2)]
    round_trip = _hf_round_trip_error(model, hf_dir)
    seen = []
    experts[0].register_forward_pre_hook(lambda mod, inputs: seen.append(inputs) if not seen else None)
    runs = {}
    for grouped in (True, False):
        for module in experts:
            module.grouped = grouped
        runs[grouped] = _step(model, optimizer, scheduler, data, args)
    x, counts, probs = (t.detach() for t in seen[0])
    n = x.shape[0]
    uneven = torch.tensor([n // 3, 0, n - n // 3 - 1, 1][: experts[0].num_local_experts - 1] + [0])  # empty experts
    uneven[-2] += n - int(uneven.sum())
    grads = {}
    for grouped in (True, False):
        experts[0].grouped = grouped
        torch.manual_seed(0)
        out_grad = torch.randn(n, x.shape[1])
        grads[grouped] = [_expert_grads(experts, x, c, probs, out_grad) for c in (counts, uneven)]
    diffs = [[(a - b).abs().max().item() for a, b in zip(g, s)] for g, s in zip(grads[True], grads[False])]
    (lp_g, loss_g, gn_g), (lp_s, loss_s, gn_s) = runs[True], runs[False]
    return dict(in_order=in_order, round_trip=round_trip, log_probs=lp_g == lp_s, loss=(loss_g, loss_s), grad_norm=(gn_g, gn_s), module_diffs=diffs,
                counts=counts.tolist(), uneven=uneven.tolist())


@pytest.mark.timeout(180)
def test_grouped_experts_give_the_sequential_numbers_on_cpu_under_ep2(tmp_path):
    """EP2 on two gloo ranks: log-probs, loss and grad norm of a step, and the experts' output and gradients
    (dispatched tokens, and a split with experts that get no token) are the sequential path's, bit for bit."""
    hf_dir = save_tiny_qwen3_moe(str(tmp_path / "moe"))
    results = run_ranks(_grouped_vs_sequential_child, 2, args=(hf_dir, make_rollout(num_samples=4, seed=5)),
                        timeout_s=150)
    for r in results:
        assert r["log_probs"], "log-probs differ between the grouped and the sequential experts"
        assert r["loss"][0] == r["loss"][1] and r["grad_norm"][0] == r["grad_norm"][1], r
        assert r["grad_norm"][0] > 0
        assert r["in_order"] and r["round_trip"] == 0.0, r
        assert 0 in r["uneven"] and max(max(d) for d in r["module_diffs"]) == 0.0, r["module_diffs"]


# ------------------------------------------------------------------ flags


def test_grouped_gemm_flag_default_follows_cuda(monkeypatch):
    from slime.backends.megatron_utils import moe
    from slime.utils.arguments import build_parser

    parser = build_parser()
    assert parser.get_default("moe_grouped_gemm") is None
    for cuda in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert moe.grouped_experts_enabled(defaults_namespace()) is cuda  # default: on CUDA only
        assert moe.grouped_experts_enabled(defaults_namespace(moe_grouped_gemm=True)) is True
        assert moe.grouped_experts_enabled(defaults_namespace(moe_grouped_gemm=False)) is False


def test_grouped_flag_picks_the_experts_module():
    from megatron.core.transformer.moe.experts import SequentialMLP

    from slime.models.local_spec import with_moe_mlp
    from slime.models.grouped_experts import GroupedExperts
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    class Config:
        num_moe_experts = 4
        add_bias_linear = False

    class Biased(Config):  # gpt-oss's experts: megatron's SequentialMLP cannot train them at EP 1
        add_bias_linear = True

    dense = get_gpt_layer_local_spec()
    chosen = {g: with_moe_mlp(dense, Config(), g).submodules.mlp.submodules.experts.module for g in (True, False)}
    assert chosen == {True: GroupedExperts, False: SequentialMLP}
    assert with_moe_mlp(dense, Biased(), False).submodules.mlp.submodules.experts.module is GroupedExperts


def test_deepep_request_falls_back_to_alltoall_with_one_warning(monkeypatch):
    from slime.backends.megatron_utils import moe

    monkeypatch.setitem(__import__("sys").modules, "deep_ep", None)  # not importable
    monkeypatch.setattr(moe, "_warned_no_deepep", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        picked = [moe.token_dispatcher(defaults_namespace(moe_token_dispatcher_type="flex", moe_enable_deepep=True)),
                  moe.token_dispatcher(defaults_namespace(moe_token_dispatcher_type="alltoall", moe_enable_deepep=True)),
                  moe.token_dispatcher(defaults_namespace(moe_token_dispatcher_type="flex"))]
    assert picked == ["alltoall"] * 3
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1 and "alltoall dispatcher instead" in texts[0]
    assert moe.token_dispatcher(defaults_namespace(moe_token_dispatcher_type="allgather")) == "allgather"
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)
    with warnings.catch_warnings(record=True):
        fields = moe.moe_config_fields(config, defaults_namespace(moe_token_dispatcher_type="flex", moe_enable_deepep=True))
    assert fields["moe_token_dispatcher_type"] == "alltoall"


# ------------------------------------------------------------------ the step's launch savings at EP1


def _launch_savings_child(rank, world, hf_dir, data):
    """One EP1 step as before the launch savings (megatron's identity re-sort, per-expert gradient adds, per-tensor
    clip norm and scale, torch's default AdamW kernel), the weights put back, then the same step with them."""
    from torch.optim import adam

    from slime.patches import megatron_core
    from slime.backends.megatron_utils.adam_kernel import adam_kernel_in_use, use_fused_adam
    from slime.backends.megatron_utils.offload import torch_optimizers
    from train_step_harness import build_loaded_model, layout_args

    from slime.backends.megatron_utils import model as model_module

    args = layout_args(dict(moe_grouped_gemm=True, calculate_per_token_loss=True, use_distributed_optimizer=True),
                       lr=1e-3, weight_decay=0.1, clip_grad=1e-3)  # a clip that scales, an update that moves
    model_module.fused_adam_chosen = lambda device: True  # as on a GPU: the model's set-up picks the fused kernel
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    built_with = adam_kernel_in_use(optimizer)
    experts = _experts_of(model)
    params = [p for chunk in model for p in chunk.parameters()]
    start = [p.detach().clone() for p in params]
    counts = {"sorts": 0, "fused_adam": 0}
    upstream_sort, fused_adam = megatron_core._UPSTREAM_SORT_CHUNKS["sort_chunks_by_idxs"], adam._fused_adam

    def counted_sort(*a, **k):
        counts["sorts"] += 1
        return upstream_sort(*a, **k)

    def counted_adam(*a, **k):
        counts["fused_adam"] += 1
        return fused_adam(*a, **k)

    megatron_core._UPSTREAM_SORT_CHUNKS["sort_chunks_by_idxs"], adam._fused_adam = counted_sort, counted_adam
    runs = {}
    for saving in (False, True):
        with torch.no_grad():
            for p, p0 in zip(params, start):
                p.copy_(p0)
        for inner in torch_optimizers(optimizer):
            inner.state.clear()
        megatron_core.apply_moe_identity_sort(enabled=saving)
        megatron_core.apply_grad_norm_without_host_sync(multi_tensor=saving)
        megatron_core.apply_batched_optimizer_copies(enabled=saving)
        megatron_core.apply_permute_without_host_sync(enabled=saving)
        for module in experts:
            module.into_main_grad = saving
        use_fused_adam(optimizer, saving)  # the CPU's fused kernel here; CUDA's on a GPU
        before = dict(counts)
        log_probs, loss, grad_norm = _step(model, optimizer, scheduler, data, args)
        runs[saving] = dict(log_probs=log_probs, loss=loss, grad_norm=grad_norm, adam=adam_kernel_in_use(optimizer),
                            weights=[p.detach().clone() for p in params],
                            added=all(e.linear_fc1.weight.grad_added_to_main_grad for m in experts
                                      for e in m.local_experts),
                            **{k: counts[k] - before[k] for k in counts})
    moved = max(float((w - p0).abs().max()) for w, p0 in zip(runs[False]["weights"], start))
    diff = max(float((a - b).abs().max()) for a, b in zip(runs[True]["weights"], runs[False]["weights"]))
    same = {k: runs[True][k] == runs[False][k] for k in ("log_probs", "loss", "grad_norm")}
    return dict(same=same, moved=moved, weight_diff=diff, grad_norm=runs[True]["grad_norm"], built_with=built_with,
                **{f"{k}_{s}": runs[s][k] for s in (False, True) for k in ("adam", "added", "sorts", "fused_adam")})


@pytest.mark.timeout(120)
def test_launch_savings_keep_the_ep1_step_numbers_on_cpu(tmp_path):
    """At EP1 the dispatcher's re-sort is the identity and is skipped, the experts' gradients go into DDP's buffer
    as one multi-tensor add, grad clipping's norm and scale are multi-tensor, the tokens are permuted without a
    host sync, the distributed optimizer's grad and param copies are batched and Adam runs torch's fused kernel:
    log-probs, loss and grad norm are the step's without them, bit for bit, and the updated weights agree to fp32
    rounding."""
    hf_dir = save_tiny_qwen3_moe(str(tmp_path / "moe"))
    (r,) = run_ranks(_launch_savings_child, 1, args=(hf_dir, make_rollout(num_samples=4, seed=7)), timeout_s=100)
    assert all(r["same"].values()), r
    assert r["grad_norm"] > 1e-3 and r["moved"] > 1e-4, r  # clipping scaled, the update moved the weights
    assert r["weight_diff"] <= 1e-6 * max(1.0, r["moved"]), r
    assert r["built_with"] == "fused" and (r["adam_False"], r["adam_True"]) == ("default", "fused"), r
    assert r["fused_adam_False"] == 0, r
    assert r["fused_adam_True"] > 0 and r["sorts_False"] > 0 and r["sorts_True"] == 0, r
    assert (r["added_False"], r["added_True"]) == (False, True), r


@pytest.mark.parametrize("with_probs", [True, False])
def test_permute_without_host_sync_matches_megatrons(with_probs):
    """The sync-free permute gives megatron's rows, routing weights and indices in the same order, and hands token
    dropping (no static size) back to megatron's own."""
    from megatron.core.transformer.moe import moe_utils

    from slime.patches import megatron_core

    gen = torch.Generator().manual_seed(3)
    num_tokens, num_experts, topk = 37, 8, 3
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    top = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.softmax(scores, dim=1) * routing_map if with_probs else None
    tokens = torch.randn(num_tokens, 16, generator=gen)
    want = moe_utils.permute(tokens, routing_map, probs=probs, num_out_tokens=num_tokens * topk)
    got = megatron_core._permute_without_host_sync(tokens, routing_map, probs=probs, num_out_tokens=num_tokens * topk)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert (got[1] is None and want[1] is None) if not with_probs else torch.equal(got[1], want[1])
    dropped = routing_map.clone()
    dropped[0] = False  # fewer routed pairs than tokens x top-k: only a synced count serves
    fallback = megatron_core._permute_without_host_sync(tokens, dropped, probs=probs,
                                                        num_out_tokens=dropped.sum())
    assert torch.equal(fallback[2], moe_utils.permute(tokens, dropped, probs=probs)[2])
