"""Model families beyond the dense Qwen3 / Llama layout, against transformers (what the embedded engine runs).

- DeepSeek-V3 multi-latent attention (megatron-core's MLA in the local spec with the project's CP/SP plugins),
  default RoPE and YaRN; GLM-4 through its --spec plug-in (post norms, q/k/v biases, half-rotary interleaved RoPE);
- the megatron model gives transformers' logits (fp32, ~1e-7) at TP2, CP2 and TP2 x CP2 and exports the HF
  tensors bit-exactly;
- the training step (packed THD micro-batches, zig-zag CP, SP) gives the single process's log-probs, loss and
  grad norm, and those log-probs are transformers';
- DeepSeek-V3's MoE layers (first layer dense, sigmoid router with e_score_correction_bias, group-limited top-k,
  routed_scaling_factor, an ungated shared expert) at TP2 x SP x EP2: weights round-trip exactly, log-probs are
  transformers', a step trains and updates the expert bias, and the pushed weights (bias included) give the
  embedded engine the trainer's log-probs; router settings megatron-core cannot match are refused.
"""
from __future__ import annotations

import json
import math
import types

import pytest
import torch

from family_push import SEQ  # the tokens forward_and_export feeds
from mp_utils import run_ranks
from slime.config import defaults_namespace
from test_train_step import assert_matches_reference, rollout  # noqa: F401 (fixture)
from tiny_models import save_tiny_deepseek_v3, save_tiny_glm4, save_tiny_glm_moe_dsa
from train_step_harness import layout_child

pytestmark = pytest.mark.ranks

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


ARCHITECTURES = {"rope": "DeepseekV3ForCausalLM", "yarn": "DeepseekV3ForCausalLM", "glm4": "Glm4ForCausalLM",
                 "glm5": "GlmMoeDsaForCausalLM"}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {"rope": save_tiny_deepseek_v3(str(root / "rope")),
            # no query compression (q_proj instead of q_a/q_b), YaRN RoPE
            "yarn": save_tiny_deepseek_v3(str(root / "yarn"), seed=1, q_lora_rank=None, rope_scaling=YARN),
            "glm4": save_tiny_glm4(str(root / "glm4")),
            # DeepSeek sparse attention: 6 of the 16 keys at most
            "glm5": save_tiny_glm_moe_dsa(str(root / "glm5"))}


def _hf_logits(hf_dir, architecture):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == architecture
    tokens = torch.randint(0, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(tokens).logits[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind, tp, cp", [("rope", 2, 1), ("rope", 1, 2), ("yarn", 2, 2), ("glm4", 2, 2),
                                          ("glm5", 2, 2)])
def test_logits_match_transformers_and_export_is_exact(family_dirs, kind, tp, cp):
    from safetensors.torch import load_file

    from family_push import check_logits_and_export, forward_and_export

    hf_dir = family_dirs[kind]
    reference = _hf_logits(hf_dir, ARCHITECTURES[kind])
    original = load_file(f"{hf_dir}/model.safetensors")
    for result in run_ranks(forward_and_export, tp * cp, args=(hf_dir, tp, cp), timeout_s=220):
        check_logits_and_export(result, reference, original)


LAYOUTS = {
    "tp2_sp_cp2": dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2),
    # without SP the RoPE key's gradient is summed over TP by the plugin (deepseek_v3._full_latent_forward)
    "tp2": dict(tensor_model_parallel_size=2),
}
_REFERENCES = {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, name", [("yarn", "tp2_sp_cp2"), ("yarn", "tp2"), ("glm4", "tp2_sp_cp2")])
def test_train_step_matches_single_process_and_transformers(family_dirs, rollout, kind, name):  # noqa: F811
    import transformers

    hf_dir = family_dirs[kind]
    modes = ("per_token", "per_sample")
    if kind not in _REFERENCES:
        (_REFERENCES[kind],) = run_ranks(layout_child, 1, args=(dict(calculate_per_token_loss=True), hf_dir,
                                                                 rollout, modes), timeout_s=120)
    reference = _REFERENCES[kind]
    layout = dict(LAYOUTS[name], calculate_per_token_loss=True)
    world = layout["tensor_model_parallel_size"] * layout.get("context_parallel_size", 1)
    results = run_ranks(layout_child, world, args=(layout, hf_dir, rollout, modes), timeout_s=220)
    assert_matches_reference(results, reference, rollout)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for tokens, response, got in zip(rollout["tokens"], rollout["response_lengths"], reference["log_probs"]):
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0].log_softmax(-1)
        want = logits[:-1].gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)[-response:]
        assert got == pytest.approx(want.tolist(), abs=1e-5)


def test_architecture_flags_must_agree_with_the_hf_config():
    from slime.backends.megatron_utils.model import transformer_config_from_hf
    from tiny_models import tiny_deepseek_v3_config, tiny_qwen3_config

    config = transformer_config_from_hf(tiny_deepseek_v3_config(rope_scaling=YARN), defaults_namespace(
        multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8,
        v_head_dim=12, rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0))
    assert config.multi_latent_attention and config.rope_type == "yarn" and config.rotary_scaling_factor == 4.0
    with pytest.raises(ValueError, match="--kv-lora-rank=512 contradicts the HF config"):
        transformer_config_from_hf(tiny_deepseek_v3_config(), defaults_namespace(kv_lora_rank=512))
    with pytest.raises(ValueError, match="--multi-latent-attention contradicts the HF config"):
        transformer_config_from_hf(tiny_qwen3_config(), defaults_namespace(multi_latent_attention=True))
    with pytest.raises(ValueError, match="--rotary-interleaved=True contradicts"):
        transformer_config_from_hf(tiny_qwen3_config(), defaults_namespace(rotary_interleaved=True))
    deepseek_v2 = tiny_deepseek_v3_config(first_k_dense_replace=1)
    deepseek_v2.model_type = "deepseek_v2"
    with pytest.raises(ValueError, match="deepseek_v2 MoE layers .* are not mapped"):
        transformer_config_from_hf(deepseek_v2, defaults_namespace())


def test_spec_plugin_signatures_and_result_types():
    from slime.backends.megatron_utils import model as builder
    from slime_plugins.models import glm4
    from tiny_models import tiny_qwen3_config

    args = types.SimpleNamespace(spec=["slime_plugins.models.glm4", "get_glm_spec"])
    assert builder.spec_function(args, tiny_qwen3_config()) is glm4.get_glm_spec
    assert builder.spec_function(types.SimpleNamespace(spec=None), tiny_qwen3_config()) is None
    config = builder.transformer_config_from_hf(tiny_qwen3_config(), defaults_namespace())
    legacy = builder._plugin_spec(lambda a: "from fn(args)", args, config, None)
    assert legacy == "from fn(args)"
    with pytest.raises(TypeError, match="expected a megatron ModuleSpec"):
        # a one-parameter function is called as fn(args); this one returns a dict, not a spec
        builder._layer_spec(types.SimpleNamespace(spec=["slime_plugins.models.glm4", "layer_names"]),
                            tiny_qwen3_config(), config, None)


# ------------------------------------------------------------------ DeepSeek-V3 MoE layers


# The sigmoid-router MoE families: a tiny checkpoint of each by transformers' own class, with the tokenizer of the
# project's tiny checkpoint (the embedded engine serves it).
MOE_CHECKPOINTS = {"deepseek_v3": "save_tiny_deepseek_v3_moe", "glm4_moe": "save_tiny_glm4_moe",
                   "glm4_moe_lite": "save_tiny_glm4_moe_lite", "minimax_m2": "save_tiny_minimax_m2",
                   "glm_moe_dsa": "save_tiny_glm_moe_dsa"}
MOE_ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                     "glm4_moe_lite": "Glm4MoeLiteForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM",
                     "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
MOE_LAYOUTS = {
    "tp2_sp_ep2": dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2),
    "tp2_sp_cp2_ep2": dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                           expert_model_parallel_size=2),
    # upstream's plug-in path for MiniMax-M2 (the single-process reference is built without it)
    "tp2_sp_ep2_spec": dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                            spec=["slime_plugins.models.minimax_m2", "get_minimax_m2_spec"]),
    # upstream's plug-in path for GLM-5, with CP (its indexer keys all-gathered like the K/V)
    "tp2_sp_cp2_ep2_spec": dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                                expert_model_parallel_size=2,
                                spec=["slime_plugins.models.glm5.glm5", "get_glm5_spec"]),
}
MOE_TRAINING = dict(expert_tensor_parallel_size=1, calculate_per_token_loss=True, lr=1e-3,
                    moe_router_bias_update_rate=0.05)


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory):
    """family -> (checkpoint dir, rollout), made on first use."""
    import tiny_models
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint
    from tiny_models import replace_model
    from train_step_harness import make_rollout

    made = {}

    def assets(family):
        if family not in made:
            checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp(family) / "m", TinyQwen3Spec(alphabet="0123456789"))
            replace_model(checkpoint, getattr(tiny_models, MOE_CHECKPOINTS[family]))
            vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
            made[family] = str(checkpoint), make_rollout(num_samples=4, seed=2, vocab=vocab, max_len=20)
        return made[family]

    return assets


def _moe_child(rank, world, ledger_dir, hf_dir, data, layout):
    """Load, log-probs, one training step, log-probs again and the export, with every collective of the step in
    a ledger that records the whole sequence (the order proof's input)."""
    from transformers import AutoConfig

    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime_plugins.models.hf_weights import export_hf_weights
    from train_step_harness import build_loaded_model, layout_args, plans_for_this_rank, recorded_phase

    args = layout_args(layout)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    loaded = {name: tensor.clone() for name, tensor in export_hf_weights(model, hf_config)}  # views of live weights
    (plan,) = plans_for_this_rank(data, args)
    before = compute_log_probs(model, data, plan, args)
    data = dict(data, log_probs=before, ref_log_probs=before, rollout_log_probs=before)
    with recorded_phase(rank, world, ledger_dir):
        step = train_one_step(model, optimizer, scheduler, data, plan, args)
    after = compute_log_probs(model, data, plan, args)
    trained = {name: tensor.clone() for name, tensor in export_hf_weights(model, hf_config)}
    # --save / --load write and read the model's sharded state dict: the bias megatron moved is in it
    sharded = model[0].module.sharded_state_dict()
    saved = [key for key in sharded if key.endswith("router.expert_bias")]
    q_norm = sharded.get("decoder.layers.0.self_attention.q_layernorm.weight")  # (local, global) shapes
    return dict(loaded=loaded, trained=trained, before=before, after=after, skipped=step.skipped, saved=saved,
                loss=step.loss, grad_norm=step.grad_norm,
                q_norm=q_norm and (tuple(q_norm.local_shape), tuple(q_norm.global_shape)))


def _engine_log_probs(engine, data) -> list[list[float]]:
    """The engine's own input-token log-probs (SGLang's input_token_logprobs) of each sample's response."""
    from slime.backends.embedded_engine.engine import GenerationRequest
    from slime.backends.embedded_engine.sampling import SamplingParams

    params = SamplingParams.from_request({"max_new_tokens": 0, "temperature": 1.0})
    requests = [GenerationRequest(rid=str(i), input_ids=tuple(t), params=params, return_logprob=True,
                                  logprob_start_len=0) for i, t in enumerate(data["tokens"])]
    results = engine.generate_batch(requests)
    return [[lp for lp, _ in r.input_logprobs[-n:]] for r, n in zip(results, data["response_lengths"])]


def _bias_names(hf_dir):
    """(megatron expert-bias buffers, the first MoE layer's HF routing-bias name) of a checkpoint."""
    from transformers import AutoConfig

    from slime.models import family_of
    from slime.models.moe_hf import family_moe_names

    hf_config = AutoConfig.from_pretrained(hf_dir)
    arch = family_of(hf_config).moe(hf_config)
    layers = [i for i, moe in enumerate(arch.layer_pattern) if moe]
    (bias,) = family_moe_names("mlp.router.expert_bias", f"model.layers.{layers[0]}.", None, arch)
    return [f"decoder.layers.{i}.mlp.router.expert_bias" for i in layers], bias


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family, layout", [("deepseek_v3", "tp2_sp_ep2"), ("glm4_moe", "tp2_sp_cp2_ep2"),
                                            ("glm4_moe_lite", "tp2_sp_ep2"), ("minimax_m2", "tp2_sp_ep2_spec"),
                                            ("glm_moe_dsa", "tp2_sp_cp2_ep2_spec")])
def test_moe_family_round_trips_trains_and_pushes_under_ep(moe_assets, family, layout, tmp_path):
    """HF -> megatron -> HF bit-exact under TP2 x SP x EP2 (x CP2), the engine's (transformers') log-probs, one
    fenced step whose recorded collectives pass the order proof and that moves the routing bias, and a push that
    gives the engine the trainer's new log-probs. For the newer families the step equals the single process's."""
    from safetensors.torch import load_file

    from slime.backends.embedded_engine.engine import EmbeddedEngine, GenerationRequest
    from slime.backends.embedded_engine.sampling import SamplingParams
    from slime.distributed.order_proof import check_order, read_sequences

    hf_dir, data = moe_assets(family)
    layout = dict(MOE_LAYOUTS[layout], **MOE_TRAINING)
    world = layout["tensor_model_parallel_size"] * layout.get("context_parallel_size", 1)
    results = run_ranks(_moe_child, world, args=(str(tmp_path), hf_dir, data, layout), timeout_s=280)
    report = check_order(read_sequences(str(tmp_path)))
    assert report.ok, report.format()
    original = load_file(f"{hf_dir}/model.safetensors")
    engine = EmbeddedEngine(hf_dir)
    assert type(engine.model).__name__ == MOE_ARCHITECTURES[family]
    for result in results:  # every rank exports every expert (EP all-gather), bias included
        assert sorted(result["loaded"]) == sorted(original)
        assert all(torch.equal(result["loaded"][name], original[name]) for name in original)
    tolerance = 1e-5 if family == "deepseek_v3" else 1e-6
    for got, want in zip(results[0]["before"], _engine_log_probs(engine, data)):
        assert got == pytest.approx(want, abs=tolerance)
    result = results[0]
    saved, bias = _bias_names(hf_dir)
    assert not result["skipped"] and result["after"] != result["before"]
    assert result["saved"] == saved
    if family == "minimax_m2":  # its whole-projection q norm is saved split over TP, like the projection rows
        assert result["q_norm"] == ((32,), (64,))
    assert not torch.equal(result["trained"][bias], original[bias])  # aux-loss-free balancing moved it
    if family != "deepseek_v3":  # the single process's step (DeepSeek-V3's layouts: test_train_step_matches_...)
        (single,) = run_ranks(_moe_child, 1, args=(str(tmp_path / "single"), hf_dir, data, MOE_TRAINING),
                              timeout_s=200)
        assert result["loss"] == pytest.approx(single["loss"], abs=1e-5)
        assert result["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
        # the same token counts per expert: the router leaves the layout's padding (to multiples of 2 x CP x TP
        # here, of 2 in the single process) out of them
        assert torch.equal(result["trained"][bias], single["trained"][bias])
    engine.update_weights([(n, t) for n, t in result["trained"].items() if not n.endswith("correction_bias")], "v2")
    stale = _engine_log_probs(engine, data)  # the old bias routes some tokens elsewhere
    assert max(abs(a - b) for x, y in zip(stale, result["after"]) for a, b in zip(x, y)) > 1e-3
    engine.update_weights(list(result["trained"].items()), "v3")
    assert torch.equal(engine.get_weight(bias), result["trained"][bias])
    for got, want in zip(result["after"], _engine_log_probs(engine, data)):
        assert got == pytest.approx(want, abs=tolerance)
    params = SamplingParams.from_request({"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True})
    (generated,) = engine.generate_batch([GenerationRequest(rid="g", input_ids=(3, 4, 5), params=params)])
    assert len(generated.output_ids) == 4


def _deepseek_v3_config(**overrides):
    """DeepSeek-V3-671B's MoE fields (no weights): 61 layers, 3 dense, 256 experts in 8 groups, top-8 of 4."""
    from tiny_models import tiny_deepseek_v3_config

    fields = dict(num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256, num_experts_per_tok=8,
                  moe_intermediate_size=2048, n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                  norm_topk_prob=True)
    fields.update(overrides)
    return tiny_deepseek_v3_config(**fields)


def _moe_flags(**flags):
    return defaults_namespace(**{"expert_model_parallel_size": 1, "pipeline_model_parallel_size": 1, **flags})


def test_deepseek_v3_moe_config_maps_and_upstream_flags_must_agree():
    from slime.backends.megatron_utils.moe import MoEConfigError, moe_config_fields

    upstream = dict(num_experts=256, moe_layer_freq="[0]*3+[1]*58", moe_ffn_hidden_size=2048, moe_router_topk=8,
                    moe_shared_expert_intermediate_size=2048, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_router_num_groups=8,
                    moe_router_group_topk=4, moe_router_bias_update_rate=0.0, moe_router_dtype="fp32")
    with pytest.warns(UserWarning, match="--moe-router-pre-softmax has no effect with the sigmoid router"):
        fields = moe_config_fields(_deepseek_v3_config(), _moe_flags(**upstream, moe_router_pre_softmax=True))
    assert fields["moe_layer_freq"] == [0] * 3 + [1] * 58 and fields["num_moe_experts"] == 256
    assert (fields["moe_router_score_function"], fields["moe_router_enable_expert_bias"],
            fields["moe_router_pre_softmax"]) == ("sigmoid", True, False)
    assert (fields["moe_router_num_groups"], fields["moe_router_group_topk"]) == (8, 4)
    assert fields["moe_router_topk_scaling_factor"] == 2.5 and fields["moe_router_bias_update_rate"] == 0.0
    assert fields["moe_shared_expert_intermediate_size"] == 2048 and not fields["moe_shared_expert_gate"]
    # without flags the HF config decides alike
    assert moe_config_fields(_deepseek_v3_config(), _moe_flags()) | {"moe_router_dtype": "fp32",
                                                                    "moe_router_bias_update_rate": 0.0} == fields
    contradictions = [
        (dict(moe_router_score_function="softmax"), "--moe-router-score-function softmax does not match"),
        (dict(moe_router_topk_scaling_factor=1.0), "--moe-router-topk-scaling-factor 1.0 does not match"),
        (dict(moe_router_num_groups=4), "--moe-router-num-groups 4 does not match"),
        (dict(moe_router_group_topk=2), "--moe-router-group-topk 2 does not match"),
        (dict(moe_layer_freq="[0]*1+[1]*60"), "--moe-layer-freq [0]*1+[1]*60 does not match"),
        (dict(moe_shared_expert_intermediate_size=4096), "--moe-shared-expert-intermediate-size 4096 does not"),
        (dict(moe_shared_expert_gate=True), "the HF checkpoint has none"),
    ]
    for flags, message in contradictions:
        with pytest.raises(MoEConfigError) as info:
            moe_config_fields(_deepseek_v3_config(), _moe_flags(**flags))
        assert message in str(info.value)


def test_router_settings_megatron_cannot_match_are_refused():
    from slime.backends.megatron_utils.moe import MoEConfigError, moe_config_fields
    from tiny_models import tiny_qwen3_config

    refused = [
        (dict(topk_group=2), "agree only when num_experts_per_tok // topk_group == 2"),
        (dict(norm_topk_prob=False), "megatron's sigmoid router renormalises the top-k weights exactly when k > 1"),
        (dict(n_group=3), "the experts must split into n_group equal groups"),
        (dict(scoring_func="softmax"), "only the sigmoid router with e_score_correction_bias"),
    ]
    for overrides, message in refused:
        with pytest.raises(ValueError, match=message):
            moe_config_fields(_deepseek_v3_config(**overrides), _moe_flags())
    # every group selected is plain top-k, whatever the per-group score
    fields = moe_config_fields(_deepseek_v3_config(n_group=8, topk_group=8), _moe_flags())
    assert fields["moe_router_num_groups"] is None and fields["moe_router_group_topk"] is None
    # the Qwen-MoE softmax router has no bias, scale or groups: those flags are refused there
    qwen = tiny_qwen3_config(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    qwen.model_type = "qwen3_moe"
    for flags, message in [(dict(moe_router_enable_expert_bias=True), "the HF model has no tensor for"),
                           (dict(moe_router_score_function="sigmoid"), "(score_function=softmax)"),
                           (dict(moe_router_num_groups=2, moe_router_group_topk=1), "(num_groups=1)")]:
        with pytest.raises(MoEConfigError) as info:
            moe_config_fields(qwen, _moe_flags(**flags))
        assert message in str(info.value)


def test_glm_and_minimax_configs_map_and_upstream_flags_must_agree():
    """GLM-4.5-Air's, GLM-4.7-Flash's and MiniMax-M2's MoE and attention fields (configs only, no weights) against
    upstream's launcher flags: agreeing flags pass, each contradiction or unmatched router setting is refused."""
    from transformers import Glm4MoeConfig, Glm4MoeLiteConfig, MiniMaxM2Config

    from slime.backends.megatron_utils.model import transformer_config_from_hf
    from slime.backends.megatron_utils.moe import MoEConfigError, moe_config_fields

    glm45 = Glm4MoeConfig(num_hidden_layers=46, n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408,
                          first_k_dense_replace=1, attention_bias=True, routed_scaling_factor=1.0)
    fields = moe_config_fields(glm45, _moe_flags(num_experts=128, moe_layer_freq="[0]*1+[1]*45", moe_router_topk=8,
                                                 moe_shared_expert_intermediate_size=1408,
                                                 moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True))
    assert fields["moe_layer_freq"] == [0] + [1] * 45 and fields["moe_router_topk_scaling_factor"] is None
    config = transformer_config_from_hf(glm45, defaults_namespace(add_qkv_bias=True, rotary_percent=0.5))
    assert config.add_qkv_bias and not config.qk_layernorm and not config.rotary_interleaved
    with pytest.raises(ValueError, match="--rotary-percent=1.0 contradicts the HF config"):
        transformer_config_from_hf(glm45, defaults_namespace(rotary_percent=1.0))
    with pytest.raises(ValueError, match="--qk-layernorm=True contradicts"):
        transformer_config_from_hf(glm45, defaults_namespace(qk_layernorm=True))
    with pytest.raises(MoEConfigError, match="--moe-layer-freq .* does not match"):
        moe_config_fields(glm45, _moe_flags(moe_layer_freq="[1]*46"))
    with pytest.raises(ValueError, match="set n_group to a divisor of 128"):
        moe_config_fields(Glm4MoeConfig(n_routed_experts=128, n_group=6, topk_group=1), _moe_flags())

    lite = Glm4MoeLiteConfig(num_hidden_layers=47)  # GLM-4.7-Flash's shape
    with pytest.warns(UserWarning, match="--add-qkv-bias has no effect with multi-latent attention"):
        config = transformer_config_from_hf(lite, defaults_namespace(
            multi_latent_attention=True, add_qkv_bias=True, q_lora_rank=768, kv_lora_rank=512, qk_head_dim=192,
            qk_pos_emb_head_dim=64, v_head_dim=256, qk_layernorm=True, num_experts=64, moe_router_topk=4,
            moe_layer_freq="[0]*1+[1]*46", moe_shared_expert_intermediate_size=1536, moe_ffn_hidden_size=1536,
            expert_model_parallel_size=1, pipeline_model_parallel_size=1))
    assert config.multi_latent_attention and config.moe_router_topk_scaling_factor == pytest.approx(1.8)
    with pytest.raises(ValueError, match="--v-head-dim=128 contradicts"):
        transformer_config_from_hf(lite, defaults_namespace(v_head_dim=128))

    minimax = MiniMaxM2Config(num_hidden_layers=62, rotary_dim=64)
    fields = moe_config_fields(minimax, _moe_flags(num_experts=256, moe_layer_freq="[1]*62", moe_router_topk=8,
                                                   moe_ffn_hidden_size=1536, moe_router_enable_expert_bias=True))
    assert (fields["num_moe_experts"], fields["moe_router_enable_expert_bias"]) == (256, True)
    assert fields["moe_shared_expert_intermediate_size"] is None and fields["moe_router_num_groups"] is None
    for flags, message in [(dict(moe_shared_expert_intermediate_size=1536), "does not match"),
                           (dict(moe_router_topk_scaling_factor=2.5), "does not match"),
                           (dict(expert_model_parallel_size=3), "does not divide the checkpoint's 256 experts")]:
        with pytest.raises(MoEConfigError, match=message):
            moe_config_fields(minimax, _moe_flags(**flags))
    with pytest.raises(ValueError, match="renormalises the top-k weights exactly when k > 1"):
        moe_config_fields(MiniMaxM2Config(num_experts_per_tok=1), _moe_flags())
    config = transformer_config_from_hf(minimax, defaults_namespace(qk_layernorm=True, rotary_percent=0.5))
    assert config.qk_layernorm and config.kv_channels == 128
    # upstream's --spec names the family's own spec: MoE layers with the whole-projection q/k norms
    from slime.backends.megatron_utils.model import spec_function
    from slime.models import minimax_m2

    function = spec_function(types.SimpleNamespace(spec=["slime_plugins.models.minimax_m2", "get_minimax_m2_spec"]),
                             minimax)
    assert function is minimax_m2.get_minimax_m2_spec
    attention = function(defaults_namespace(), config, None).submodules.self_attention.submodules
    assert attention.q_layernorm.module is minimax_m2.FullWidthRMSNorm
    assert attention.k_layernorm.params == {"heads": "key"}


def test_glm5_config_maps_upstream_flags_and_refuses_what_is_not_built(tmp_path):
    """GLM-5-744B's config (no weights) against upstream's launcher flags; the indexer's top-k is clamped to the
    sequence at run time (transformers and megatron-core do the same); the settings not built here are refused,
    before Ray starts where config.json says so."""
    from transformers import GlmMoeDsaConfig

    from slime.backends.megatron_utils.model import transformer_config_from_hf
    from slime.backends.megatron_utils.moe import moe_config_fields
    from slime.config.checks.linear_attention import check_linear_attention
    from slime.config.errors import ArgumentValidationError
    from slime.config.launch import check_hf_config
    from slime.models.sparse_attention import LightningIndexer

    glm5 = GlmMoeDsaConfig()  # GLM-5's released shape: 78 layers, 3 dense, 256 experts top-8
    config = transformer_config_from_hf(glm5, defaults_namespace(
        multi_latent_attention=True, q_lora_rank=2048, kv_lora_rank=512, qk_head_dim=192, qk_pos_emb_head_dim=64,
        v_head_dim=256, qk_layernorm=True, num_experts=256, moe_router_topk=8, moe_layer_freq="[0]*3+[1]*75",
        moe_shared_expert_intermediate_size=2048, moe_ffn_hidden_size=2048, moe_router_topk_scaling_factor=2.5,
        expert_model_parallel_size=1, pipeline_model_parallel_size=1))
    assert (config.dsa_indexer_topk, config.dsa_indexer_n_heads, config.dsa_indexer_head_dim) == (2048, 32, 128)
    assert config.multi_latent_attention and config.experimental_attention_variant is None
    with pytest.raises(ValueError, match="--qk-head-dim=256 contradicts"):
        transformer_config_from_hf(glm5, defaults_namespace(qk_head_dim=256))
    with pytest.raises(ValueError, match="set n_group to a divisor of 256"):
        moe_config_fields(GlmMoeDsaConfig(n_group=3, topk_group=1), _moe_flags())
    with pytest.raises(ValueError, match="YaRN RoPE is not mapped"):
        transformer_config_from_hf(GlmMoeDsaConfig(rope_parameters=dict(YARN, rope_theta=10000.0)),
                                   defaults_namespace())
    # GLM-5.2's shared indexer layers: each built in its source's pipeline stage and recompute group
    shared = GlmMoeDsaConfig(num_hidden_layers=6, index_topk_pattern="FSSFFS")
    (tmp_path / "config.json").write_text(shared.to_json_string())
    args = defaults_namespace()
    check_hf_config(args, str(tmp_path / "config.json"))
    args.pipeline_model_parallel_size = 2  # stages 0-2 and 3-5: layer 5 reuses layer 4's choice
    check_hf_config(args, str(tmp_path / "config.json"))
    args.pipeline_model_parallel_size, args.decoder_first_pipeline_num_layers = 2, 2  # layer 2's source 0: away
    with pytest.raises(ArgumentValidationError, match=r"shared indexer layer 2 reuses layer 0's .* pipeline stage"):
        check_hf_config(args, str(tmp_path / "config.json"))
    args.pipeline_model_parallel_size, args.decoder_first_pipeline_num_layers = 1, None
    args.recompute_granularity, args.recompute_method, args.recompute_num_layers = "full", "uniform", 3
    check_hf_config(args, str(tmp_path / "config.json"))
    args.recompute_num_layers = 2  # layers 2-3: layer 2 recomputed without layer 0
    with pytest.raises(ArgumentValidationError, match="recompute-granularity full group"):
        check_hf_config(args, str(tmp_path / "config.json"))
    args.recompute_granularity = None
    (tmp_path / "config.json").write_text(GlmMoeDsaConfig(num_hidden_layers=2, indexer_types=["shared", "full"])
                                          .to_json_string())
    with pytest.raises(ArgumentValidationError, match="starts with 'shared'"):
        check_hf_config(args, str(tmp_path / "config.json"))
    # megatron's name for the attention variant agrees with GLM-5's config and contradicts any other
    args.experimental_attention_variant = "dsa"
    check_linear_attention(args, glm5.to_dict(), "config.json")
    with pytest.raises(ArgumentValidationError, match="has no DeepSeek sparse attention indexer"):
        check_linear_attention(args, {"model_type": "qwen3"}, "config.json")

    # index_topk above the sequence: every causal key is kept (the top-k clamped to the keys there are)
    indexer = LightningIndexer(types.SimpleNamespace(
        dsa_indexer_n_heads=2, dsa_indexer_head_dim=8, dsa_indexer_topk=64, qk_pos_emb_head_dim=4,
        rotary_base=10000.0, q_lora_rank=8, hidden_size=8, params_dtype=torch.float32))
    q, weights, k = indexer.queries_and_keys(torch.randn(5, 8), torch.randn(5, 8), torch.arange(5))
    assert torch.equal(indexer.select(q, weights, k, torch.arange(5)), torch.ones(5, 5, dtype=torch.bool).tril())
    assert not any(p.requires_grad for p in indexer.parameters())  # transformers' indexer has no gradient
    indexer.topk = 2
    assert indexer.select(q, weights, k, torch.arange(5)).sum(-1).tolist() == [1, 2, 2, 2, 2]


# ------------------------------------------------------------------ PP and routing replay of the sigmoid routers


def _pp_replay_child(rank, world, hf_dir, data, layout):
    """Log-probs with the given routes replayed and with every route shifted, then one training step that
    replays them too."""
    import base64

    import numpy as np

    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime_plugins.models.hf_weights import unwrap_model
    from train_step_harness import build_loaded_model, layout_args, plans_for_this_rank

    args = layout_args(layout, use_rollout_routing_replay=True)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    (plan,) = plans_for_this_rank(data, args)
    replayed = compute_log_probs(model, data, plan, args)
    shifted = dict(data, rollout_routed_experts=[  # every token through other experts
        base64.b64encode(((np.frombuffer(base64.b64decode(r), dtype=np.int32) + 3) % 8).astype(np.int32).tobytes())
        .decode() for r in data["rollout_routed_experts"]])
    shifted = compute_log_probs(model, shifted, plan, args)
    step = train_one_step(model, optimizer, scheduler, data, plan, args)
    layers = len(unwrap_model(model[0]).decoder.layers)  # this stage's
    return dict(replayed=replayed, shifted=shifted, loss=step.loss, grad_norm=step.grad_norm, skipped=step.skipped,
                layers=layers)


def _pp_stages(family: str) -> tuple[int, int]:
    """Layers of each of the two stages (the tiny MiniMax-M2 has 2 layers, the others 3; GLM-5's shared indexer
    layer 2 stays with its source, layer 1)."""
    return {"minimax_m2": (1, 1), "glm_moe_dsa": (1, 2)}.get(family, (2, 1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["glm4_moe", "glm4_moe_lite", "minimax_m2", "glm_moe_dsa"])
def test_sigmoid_router_family_replays_routes_and_trains_at_pp2(moe_assets, family):
    """transformers' own routes replayed (--use-rollout-routing-replay) give transformers' log-probs, shifted routes
    do not; at PP2 (each stage its own dense / MoE layers) the replayed log-probs, the loss and the grad norm of a
    step that replays them equal the single process's."""
    from test_moe import _hf_log_probs, _hf_routes
    from test_train_step import merged_log_probs

    hf_dir, data = moe_assets(family)
    want = _hf_log_probs(hf_dir, data)
    data = dict(data, rollout_routed_experts=_hf_routes(hf_dir, data), log_probs=want, ref_log_probs=want,
                rollout_log_probs=want)
    (single,) = run_ranks(_pp_replay_child, 1, args=(hf_dir, data, MOE_TRAINING), timeout_s=200)
    for got, ref in zip(single["replayed"], want):
        assert got == pytest.approx(ref, abs=1e-5)
    assert max(abs(a - b) for x, y in zip(single["shifted"], want) for a, b in zip(x, y)) > 1e-2
    stages = _pp_stages(family)
    layout = dict(pipeline_model_parallel_size=2, decoder_last_pipeline_num_layers=stages[1], **MOE_TRAINING)
    results = run_ranks(_pp_replay_child, 2, args=(hf_dir, data, layout), timeout_s=250)
    assert tuple(r["layers"] for r in results) == stages
    for got, ref in zip(merged_log_probs([dict(log_probs=r["replayed"]) for r in results], len(want)), want):
        assert got == pytest.approx(ref, abs=1e-5)
    assert not single["skipped"] and single["grad_norm"] > 0
    for result in results:
        assert result["loss"] == pytest.approx(single["loss"], abs=1e-5)
        assert result["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)


def _gradients_child(rank, world, hf_dir):
    """The HF-named gradients of the summed next-token log-probs of one sequence (the gradient put in place of
    each weight, then exported as the weights are)."""
    import transformers

    from slime.backends.megatron_utils.model import build_gpt_model
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime_plugins.models.hf_weights import export_hf_weights, load_hf_weights

    args = defaults_namespace(tensor_model_parallel_size=1, context_parallel_size=1,
                              pipeline_model_parallel_size=1, seed=5, attention_dropout=0.0, hidden_dropout=0.0)
    init_model_parallel(args)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(args, hf_config)
    load_hf_weights([model], hf_dir, hf_config)
    tokens = torch.randint(0, hf_config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    logits = model(tokens, torch.arange(SEQ).unsqueeze(0), None)[0].float()
    logits.log_softmax(-1)[:-1].gather(-1, tokens[0, 1:, None]).sum().backward()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.grad if param.grad is not None else torch.full_like(param, float("nan")))
    return {name: tensor.clone() for name, tensor in export_hf_weights([model], hf_config)}


@pytest.mark.timeout(120)
def test_glm5_gradients_match_transformers(family_dirs):
    """The backward through the sparse attention (and the MoE) is transformers': every gradient equal in fp32; the
    indexer has none on either side."""
    import transformers

    hf_dir = family_dirs["glm5"]
    (grads,) = run_ranks(_gradients_child, 1, args=(hf_dir,), timeout_s=100)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokens = torch.randint(0, hf.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    hf(tokens).logits[0].log_softmax(-1)[:-1].gather(-1, tokens[0, 1:, None]).sum().backward()
    compared = 0
    for name, param in hf.named_parameters():
        if ".indexer." in name:
            assert param.grad is None and grads[name].isnan().all()
        elif name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            # fused in transformers' memory ([gate; up] rows per expert), one tensor per projection in checkpoints
            prefix, fused = name.rsplit(".", 1)
            parts = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
            for expert, grad in enumerate(param.grad):
                want = torch.cat([grads[f"{prefix}.{expert}.{part}.weight"] for part in parts])
                assert (want - grad).abs().max().item() < 1e-5, (name, expert)
            compared += 1
        else:
            assert (grads[name] - param.grad).abs().max().item() < 1e-5, name
            compared += 1
    assert compared == sum(".indexer." not in name for name, _ in hf.named_parameters())


# ------------------------------------------------------------------ the DSA indexer's KL loss (megatron-core's)


def test_indexer_kl_loss_equals_a_plain_computation():
    """--dsa-indexer-loss-coeff's KL: the heads' summed attention probabilities, renormalised, against the indexer's
    softmax over the causal keys (or the kept ones), meaned over queries; the gradient reaches the scores only."""
    from slime.models.indexer_loss import indexer_kl

    torch.manual_seed(0)
    q, k = torch.randn(3, 2, 4), torch.randn(5, 2, 4)  # queries at positions 2-4 of a 5-key sequence
    scores = torch.randn(3, 5, requires_grad=True)
    causal = torch.arange(5)[None, :] <= torch.arange(2, 5)[:, None]
    kept = causal & (torch.rand(3, 5) > 0.3) | torch.eye(5, dtype=torch.bool)[2:]
    for mask in (causal, kept):
        loss = indexer_kl([scores[:1], scores[1:]], [q[:1], q[1:]], [k, k], [mask[:1], mask[1:]], 0.5, None)
        want = 0.0
        for t in range(3):
            keys = mask[t].nonzero().flatten().tolist()
            probs = [[math.exp(0.5 * float(q[t, h] @ k[s, h])) for s in keys] for h in range(2)]
            target = [sum(p[i] / sum(p) for p in probs) / 2 for i in range(len(keys))]
            norm = sum(math.exp(float(scores[t, s])) for s in keys)
            want += sum(p * (math.log(p) - (float(scores[t, s]) - math.log(norm))) for p, s in zip(target, keys)) / 3
        assert loss.item() == pytest.approx(want, abs=1e-5)
    loss.backward()
    assert scores.grad.abs().sum() > 0 and not q.requires_grad


def _indexer_loss_child(rank, world, hf_dir, data, coeff, layout=None, ledger_dir=None):
    """The indexer's weights before and after one step with --dsa-indexer-loss-coeff `coeff`, and the step's
    metrics; with `ledger_dir`, the step's collectives in a ledger (the order proof's input)."""
    import contextlib

    from slime.backends.megatron_utils.train_step import train_one_step
    from slime.distributed.instrument import instrument_collectives, uninstrument_collectives
    from slime.distributed.ledger import Ledger
    from train_step_harness import build_loaded_model, layout_args, plans_for_this_rank

    args = layout_args(dict(layout or {}, **MOE_TRAINING), dsa_indexer_loss_coeff=coeff,
                       dsa_indexer_use_sparse_loss=layout is not None)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    indexer = lambda: {n: p.detach().clone() for n, p in model[0].named_parameters() if ".indexer." in n}  # noqa: E731
    before = indexer()
    (plan,) = plans_for_this_rank(data, args)
    ledger = Ledger(rank, world, ledger_dir, record_sequence=True) if ledger_dir else None
    if ledger:
        instrument_collectives(ledger)
    try:
        with ledger.phase("actor_train") if ledger else contextlib.nullcontext():
            step = train_one_step(model, optimizer, scheduler, data, plan, args)
    finally:
        if ledger:
            uninstrument_collectives()
            ledger.close()
    return dict(before=before, after=indexer(), metrics=step.metrics, skipped=step.skipped)


@pytest.mark.timeout(200)
def test_indexer_loss_trains_the_indexer_only_when_asked(moe_assets, tmp_path):
    """With --dsa-indexer-loss-coeff the full layers' indexers move and the step logs `indexer_loss`; without it
    they stay as loaded (transformers' frozen indexer) and no such metric is logged."""
    from test_moe import _hf_log_probs

    hf_dir, data = moe_assets("glm_moe_dsa")
    want = _hf_log_probs(hf_dir, data)
    data = dict(data, log_probs=want, ref_log_probs=want, rollout_log_probs=want)
    for coeff in (1.0, 0.0):  # 0: the flag's default, the indexer frozen
        (result,) = run_ranks(_indexer_loss_child, 1, args=(hf_dir, data, coeff), timeout_s=90)
        assert not result["skipped"]
        assert sorted(result["before"]) and all(".layers.2." not in n for n in result["before"])  # layer 2: shared
        moved = [n for n in result["before"] if not torch.equal(result["before"][n], result["after"][n])]
        if coeff:
            assert sorted(moved) == sorted(result["before"])  # every indexer parameter of the full layers
            assert result["metrics"]["indexer_loss"] > 0
        else:
            assert moved == [] and "indexer_loss" not in result["metrics"]
    # TP2 x SP x CP2 x EP2 with the sparse loss: the heads' sum over TP and the keys' gradient over CP run in the
    # ledger's order proof, every rank logs the same reduced loss and moves its (TP-replicated) indexer alike
    from slime.distributed.order_proof import check_order, read_sequences

    results = run_ranks(_indexer_loss_child, 4, args=(hf_dir, data, 1.0, MOE_LAYOUTS["tp2_sp_cp2_ep2"],
                                                      str(tmp_path)), timeout_s=120)
    report = check_order(read_sequences(str(tmp_path)))
    assert report.ok, report.format()
    assert len({r["metrics"]["indexer_loss"] for r in results}) == 1 and results[0]["metrics"]["indexer_loss"] > 0
    for result in results:
        assert all(not torch.equal(result["before"][n], result["after"][n]) for n in result["before"])
        assert all(torch.equal(result["after"][n], results[0]["after"][n]) for n in result["after"])
