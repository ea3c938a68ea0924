"""Qwen3.5 and Qwen3-Next (gated DeltaNet / gated attention hybrids), dense and MoE, against transformers.

- the megatron model (both layer kinds, zero-centred norms, partial RoPE, output-gated attention; MoE with a gated
  shared expert) gives transformers' logits and the gradient of every HF tensor in fp32 for qwen3_5_text,
  qwen3_5_moe_text and qwen3_next at TP1, and for qwen3_5_text under TP2 x CP2 (DeltaNet heads split over TP,
  its recurrence across CP ranks), and exports every HF tensor bit-exactly;
- the training step on a packed batch of several sequences gives the single process's log-probs, loss and grad
  norm at TP2 x SP x CP2 x EP2 (Qwen3-Next: both layer kinds and the MoE) and PP2 (Qwen3.5);
- a composite (vision + text) checkpoint trains its text model, saves back whole, takes a push; a sample with
  images is refused unless the run trains on images (--multimodal-keys: tests/test_vlm_model.py).
Bad input before Ray: tests/test_launch_errors.py::test_hybrid_layer_stacks_are_checked_before_ray.
"""
from __future__ import annotations


import pytest
import torch

from mp_utils import run_ranks
from slime.config import defaults_namespace
from tiny_models import save_tiny_qwen3_5, save_tiny_qwen3_5_moe, save_tiny_qwen3_next

pytestmark = pytest.mark.ranks

SEQ = 16
SAVERS = {"qwen3_5": (save_tiny_qwen3_5, "Qwen3_5ForCausalLM"),
          "qwen3_5_moe": (save_tiny_qwen3_5_moe, "Qwen3_5MoeForCausalLM"),
          "qwen3_next": (save_tiny_qwen3_next, "Qwen3NextForCausalLM")}


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrids")
    return {kind: save(str(root / kind)) for kind, (save, _) in SAVERS.items()}


def _forward_and_export(rank, world, hf_dir, tp, cp, spec=None):
    import torch.distributed as dist
    import transformers
    from megatron.core import parallel_state, tensor_parallel

    from slime.backends.megatron_utils.model import build_gpt_model
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime_plugins.models.cp_attention import zigzag_positions
    from slime_plugins.models.hf_weights import export_hf_weights, load_hf_weights

    args = defaults_namespace(tensor_model_parallel_size=tp, context_parallel_size=cp, spec=spec,
                              pipeline_model_parallel_size=1, seed=5, attention_dropout=0.0, hidden_dropout=0.0)
    init_model_parallel(args)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(args, hf_config).eval()
    load_hf_weights([model], hf_dir, hf_config)
    tokens, targets = _tokens(hf_config.vocab_size)
    positions = torch.arange(SEQ)
    if cp > 1:
        positions = zigzag_positions(SEQ, cp, parallel_state.get_context_parallel_rank())
    logits = model(tokens[:, positions], positions.unsqueeze(0), None)
    kept = logits[0].detach().clone()  # the cross-entropy works in place
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                        targets[:, positions].t().contiguous()).sum()
    loss.backward()
    for name, param in model.named_parameters():  # each CP rank holds the gradient of its own tokens' loss
        dist.all_reduce(param.grad, group=parallel_state.get_context_parallel_group())
        if "q_layernorm" in name or "k_layernorm" in name:  # summed over TP by megatron's finalize_model_grads
            dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
    return dict(logits=kept, positions=positions, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                exported=dict(export_hf_weights([model], hf_config)),
                grads=dict(export_hf_weights([model], hf_config, read_param=lambda param: param.grad)))


def _tokens(vocab_size):
    tokens = torch.randint(0, vocab_size, (1, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _hf_logits_and_grads(hf_dir, architecture):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == architecture
    tokens, targets = _tokens(model.config.vocab_size)
    logits = model(tokens).logits[0]
    torch.nn.functional.cross_entropy(logits, targets[0], reduction="sum").backward()
    grads = {name: param.grad for name, param in model.named_parameters()}
    # checkpoint names (experts one by one) onto transformers' fused expert tensors, as the engine maps a push
    from slime.backends.embedded_engine.engine import checkpoint_target

    return logits.detach(), lambda name: checkpoint_target(name, grads, model.config)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind, tp, cp, spec", [
    ("qwen3_5", 1, 1, None), ("qwen3_5_moe", 1, 1, None), ("qwen3_next", 1, 1, None), ("qwen3_5", 2, 2, None),
    ("qwen3_next", 1, 1, ("slime.models.qwen3_5", "get_qwen3_5_spec")),  # upstream's --spec plug-in signature
])
def test_logits_and_grads_match_transformers_and_export_is_exact(hybrid_dirs, kind, tp, cp, spec):
    """Logits and the gradient of every HF tensor (a summed cross-entropy) equal transformers'; the export gives
    back the checkpoint."""
    from safetensors.torch import load_file

    from family_push import check_logits_and_export

    hf_dir = hybrid_dirs[kind]
    reference, reference_grads = _hf_logits_and_grads(hf_dir, SAVERS[kind][1])
    original = load_file(f"{hf_dir}/model.safetensors")
    for result in run_ranks(_forward_and_export, tp * cp, args=(hf_dir, tp, cp, spec), timeout_s=220):
        check_logits_and_export(result, reference, original)
        for name, grad in result["grads"].items():
            assert (grad - reference_grads(name)).abs().max().item() < 1e-5, name


LAYOUTS = {
    # the experts over the 2 ranks of DP x CP
    "tp2_sp_cp2_ep2": dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                           expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    "pp2": dict(pipeline_model_parallel_size=2),
}
_REFERENCES = {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, name", [("qwen3_next", "tp2_sp_cp2_ep2"), ("qwen3_5", "pp2")])
def test_train_step_matches_the_single_process(hybrid_dirs, kind, name):
    """A packed batch of 6 sequences (dynamic batching, several micro-batches): TP1 x CP1 and TP2 x SP x CP2 with
    the experts over EP2 (or PP2, each stage building its own layers of both kinds) give the same log-probs, loss
    and grad norm (fp32), with DeltaNet heads over TP and its recurrence across CP."""
    from test_train_step import assert_matches_reference
    from train_step_harness import layout_child, make_rollout

    data = make_rollout(num_samples=6, seed=0)
    modes = ("per_token", "per_sample")
    if kind not in _REFERENCES:
        (_REFERENCES[kind],) = run_ranks(layout_child, 1, args=(dict(calculate_per_token_loss=True), hybrid_dirs[kind],
                                                                data, modes), timeout_s=120)
    layout = dict(LAYOUTS[name], calculate_per_token_loss=True)
    world = (layout.get("tensor_model_parallel_size", 1) * layout.get("context_parallel_size", 1)
             * layout.get("pipeline_model_parallel_size", 1))
    results = run_ranks(layout_child, world, args=(layout, hybrid_dirs[kind], data, modes), timeout_s=220)
    assert_matches_reference(results, _REFERENCES[kind], data)


def _composite_child(rank, world, hf_dir, out_dir):
    import transformers

    from slime.backends.megatron_utils.checkpoint import save_hf_checkpoint
    from slime.backends.megatron_utils.model import build_gpt_model
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.models.registry import language_model_config
    from slime_plugins.models.hf_weights import export_hf_weights, load_hf_weights

    args = defaults_namespace(tensor_model_parallel_size=1, context_parallel_size=1,
                              pipeline_model_parallel_size=1, seed=5, attention_dropout=0.0, hidden_dropout=0.0)
    init_model_parallel(args)
    hf_config = language_model_config(transformers.AutoConfig.from_pretrained(hf_dir))
    model = build_gpt_model(args, hf_config).eval()
    load_hf_weights([model], hf_dir, hf_config)
    tokens = torch.randint(0, hf_config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ).unsqueeze(0), None)[0]
    save_hf_checkpoint(out_dir, [model], hf_config, hf_dir)
    return dict(logits=logits, model_type=hf_config.model_type, exported=dict(export_hf_weights([model], hf_config)))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("moe, text_type, engine_class", [(False, "qwen3_5_text", "Qwen3_5ForCausalLM"),
                                                          (True, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")])
def test_composite_checkpoint_trains_its_text_model_saves_it_whole_and_pushes_to_the_engine(tmp_path, moe, text_type,
                                                                                             engine_class):
    """A Qwen3_5(Moe)ForConditionalGeneration checkpoint: the text model is built from text_config and gives the
    engine's model's logits (transformers serves it as Qwen3_5(Moe)ForCausalLM); --save-hf writes back every tensor,
    the vision tower's carried through, bit-exactly; a push under the checkpoint's names reaches the engine."""
    import transformers
    from safetensors.torch import load_file

    from slime.backends.embedded_engine.engine import checkpoint_target
    from tiny_models import save_tiny_qwen3_5_composite

    hf_dir, other = (save_tiny_qwen3_5_composite(str(tmp_path / name), seed=seed, moe=moe)
                     for name, seed in (("composite", 0), ("other", 1)))
    (result,) = run_ranks(_composite_child, 1, args=(hf_dir, str(tmp_path / "saved")), timeout_s=200)
    assert result["model_type"] == text_type
    original = load_file(f"{hf_dir}/model.safetensors")
    assert any(name.startswith("model.visual.") for name in original)
    assert not any(name.startswith("model.visual.") for name in result["exported"])
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(saved) == sorted(original)
    assert all(torch.equal(saved[name], original[name]) for name in original)

    engine = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(engine).__name__ == engine_class
    tokens = torch.randint(0, engine.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (result["logits"] - engine(tokens).logits[0]).abs().max().item() < 1e-5
    # the push: the other checkpoint's text weights, by the names the trainer exports
    pushed = load_file(f"{other}/model.safetensors")
    state = engine.state_dict()
    with torch.no_grad():
        for name in result["exported"]:
            checkpoint_target(name, state, engine.config).copy_(pushed[name])
        want = transformers.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()(tokens).logits
        assert torch.equal(engine(tokens).logits, want)


def test_a_sample_with_images_is_refused_before_any_engine_sees_it_unless_the_run_trains_on_images():
    from slime.config import defaults_namespace
    from slime.rollout.sglang_rollout import check_sample_media
    from slime.utils.types import Sample

    args = defaults_namespace()
    check_sample_media(args, Sample(index=3, prompt="123"))  # text passes
    with pytest.raises(ValueError, match="sample 3 carries multimodal inputs \\(images\\).*builds the vision tower "
                                         "only for a run with --multimodal-keys"):
        check_sample_media(args, Sample(index=3, prompt="123", multimodal_inputs={"images": ["x.png"]}))
    check_sample_media(defaults_namespace(multimodal_keys={"image": "images"}),  # the trainer takes them
                       Sample(index=3, prompt="123", multimodal_inputs={"images": ["x.png"]}))
    check_sample_media(defaults_namespace(debug_rollout_only=True),  # a run that does not train takes them
                       Sample(index=3, prompt="123", multimodal_inputs={"images": ["x.png"]}))
    with pytest.raises(ValueError, match="sample 3 carries videos: only images are supported"):
        check_sample_media(defaults_namespace(debug_rollout_only=True),
                           Sample(index=3, prompt="123", multimodal_inputs={"videos": ["x.mp4"]}))