"""Kimi-Linear against transformers' KimiLinearForCausalLM: Kimi delta attention (KDA: the delta rule with one decay per
key channel, its short convolutions and output gate) beside multi-latent attention without RoPE, dense and MoE MLPs.

- the chunked KDA rule (kda_rule.py) is the token-by-token recurrence (fp64, packed sequences, gradients) and
  transformers' own KDA functions;
- two training steps at TP2 x SP x CP2 x EP2 equal the single process's, each pushed by the fenced weight sync to a
  running embedded engine (transformers' class: the push's checkpoint names reach its renamed forget gate and stacked
  convolutions), whose log-probs equal the trainer's (fp32, 1e-5) before the first push and after each;
  HF -> megatron -> HF is exact on every rank; the order proof holds (the KDA's CP all-gathers among the ops);
- LoRA on linear_proj (MLA's and KDA's o_proj) / linear_fc1 / linear_fc2 trains, merges and pushes;
- the released config.json spelling (linear_attn_config) is read, and what is not built is refused before Ray.
"""
from __future__ import annotations

import json

import pytest
import torch

from family_push import TP2_SP_CP2_EP2
from slime.config import defaults_namespace

pytestmark = pytest.mark.ranks


def _inputs(dtype, tokens=45, heads=3, dim=8, dim_v=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=generator, dtype=dtype)  # noqa: E731
    q, k, v = draw(1, tokens, heads, dim), draw(1, tokens, heads, dim), draw(1, tokens, heads, dim_v)
    g = -2.0 * torch.rand(1, tokens, heads, dim, generator=generator, dtype=dtype)
    beta = torch.rand(1, tokens, heads, generator=generator, dtype=dtype)
    return q, k, v, g, beta


def test_the_chunked_kda_rule_is_the_recurrence_and_transformers():
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention, \
        recurrent_kimi_delta_attention

    from slime.models.gated_delta_rule import l2norm
    from slime.models.kda_rule import chunk_kda_rule, recurrent_kda_rule

    q, k, v, g, beta = _inputs(torch.float64)
    qn, kn = l2norm(q), l2norm(k)
    initial = torch.randn(3, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 10, 33, 45])  # a chunk boundary inside each sequence, one sequence shorter than a chunk
    got, got_state = chunk_kda_rule(qn, kn, v, g, beta, cu_seqlens=cu, initial_state=initial, output_final_state=True)
    want, want_state = recurrent_kda_rule(qn, kn, v, g, beta, cu_seqlens=cu, initial_state=initial,
                                          output_final_state=True)
    assert (got - want).abs().max() < 1e-12 and (got_state - want_state).abs().max() < 1e-12
    per_head = recurrent_kda_rule(qn, kn, v, g[..., :1].expand_as(g), beta)[0]  # one decay for every channel
    assert (per_head - recurrent_kda_rule(qn, kn, v, g, beta)[0]).abs().max() > 1e-2
    # transformers' own functions (fp32 inside), one sequence
    one, _ = chunk_kda_rule(qn, kn, v, g, beta)
    for reference in (recurrent_kimi_delta_attention(q, k, v, g, beta, None, False, use_qk_l2norm_in_kernel=True)[0],
                      chunk_kimi_delta_attention(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]):
        assert (one - reference).abs().max() < 1e-5
    # gradients of every input
    leaves = [x[:, :20].clone().requires_grad_() for x in (qn, kn, v, g, beta)]
    grads = []
    for rule in (chunk_kda_rule, recurrent_kda_rule):
        out, _ = rule(*leaves)
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), leaves))
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(*grads))


MOE_TRAINING = dict(expert_tensor_parallel_size=1, calculate_per_token_loss=True, lr=1e-3,
                    moe_router_bias_update_rate=0.05)
LAYOUT = dict(MOE_TRAINING, **TP2_SP_CP2_EP2)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny Kimi-Linear with the project's tiny tokenizer, a rollout, and an embedded engine serving it."""
    from family_push import serve_tiny
    from tiny_models import save_tiny_kimi_linear

    with serve_tiny(tmp_path_factory.mktemp("kimi_served"), save_tiny_kimi_linear) as served:
        yield served


@pytest.mark.timeout(400)
def test_steps_at_tp2_sp_cp2_ep2_equal_the_single_process_and_every_push_reaches_the_engine(served, tmp_path):
    from safetensors.torch import load_file

    from family_push import check_layout_run

    # every rank exports every expert and the KDA tensors in the checkpoint's layout
    check_layout_run(tmp_path, served, MOE_TRAINING, LAYOUT, load_file(f"{served[0]}/model.safetensors"))


@pytest.mark.timeout(200)
def test_lora_trains_merges_and_pushes(served):
    from family_push import check_lora_run

    result = check_lora_run(served, ["linear_proj", "linear_fc1", "linear_fc2"])
    assert any("layers.0.self_attn.o_proj" in n for n in result["sent"])  # the KDA's o_proj is adapted too


def test_the_released_spelling_is_read_and_what_is_not_built_is_refused_before_ray(served, tmp_path):
    import re

    from slime.config.errors import ArgumentValidationError
    from slime.config.launch import check_hf_config
    from slime.models.hf_arch import hf_arch, hf_config_from_dict

    hf_dir, _, _ = served
    config = json.loads(open(f"{hf_dir}/config.json").read())
    released = {key: value for key, value in config.items()
                if key not in ("layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")}
    released["linear_attn_config"] = {"kda_layers": [1], "full_attn_layers": [2], "head_dim": 8, "num_heads": 4,
                                      "short_conv_kernel_size": 4}
    assert hf_arch(hf_config_from_dict(released)) == hf_arch(hf_config_from_dict(config))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(released))
    check_hf_config(defaults_namespace(), str(path))
    refused = [(dict(tensor_model_parallel_size=8), {}, "does not divide the 4 Kimi delta attention heads"),
               ({}, dict(mla_use_nope=False), "mla_use_nope=False"),
               ({}, dict(layer_types=["linear_attention", "sliding_attention"]),
                "sliding_attention")]
    for flags, fields, says in refused:
        path.write_text(json.dumps({**config, **fields}))
        with pytest.raises(ArgumentValidationError, match=re.escape(says)):
            check_hf_config(defaults_namespace(**flags), str(path))
