"""Vision + text checkpoints trained with their vision tower, against transformers' own composite classes (fp32, CPU).

- multimodal RoPE: the three position rows and the rotary angles equal transformers' `get_rope_index` and rotary
  embedding for Qwen2.5-VL (contiguous sections), Qwen3-VL and Qwen3.5 (interleaved); a packed micro-batch carries
  each sample's rows whole, and its CP ranks' image-feature rows gather back to the micro-batch's;
- per family (Qwen2.5-VL, Qwen3-VL with deepstack, Qwen3-VL-MoE, Qwen3.5 dense and MoE), one process: log-probs
  of a batch mixing prompts with one image, two images and none equal transformers' composite class, the gradient of every
  checkpoint tensor (the vision tower's included) equals transformers', HF -> megatron -> HF is bit-exact; the same
  log-probs with the height and width rows set to the temporal one differ by far more than the tolerance, so the
  agreement is what catches a dropped or misaligned row;
- TP2 x SP x CP2 x EP2 (Qwen3.5-MoE, Qwen3-VL-MoE with deepstack): log-probs equal the embedded engine's
  (transformers' composite class with the same images) and differ by far more with multimodal RoPE's height and width rows dropped, swapped
  or a token late in the micro-batch's rows that every CP rank indexes; one fenced step gives the single process's
  loss and grad norm, moves the vision tower, passes the order proof, and the pushed weights (vision tower
  included) give the engine the trainer's new log-probs; pushing all but the tower leaves them apart; --save /
  --load and --save-hf keep the trained tower;
- Qwen3-VL-MoE's fused experts: megatron's experts equal transformers' own in-memory gate and up halves and down
  (a swap or a transposition fails), SGLang's own loader reads the pushed tensors as the same halves, the layouts
  the shapes cannot tell are refused before Ray, and the released config's spelling builds untied.
"""
from __future__ import annotations

import random

import pytest
import torch

from mp_utils import run_ranks

pytestmark = pytest.mark.ranks

KINDS = {"qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration", "qwen3-vl": "Qwen3VLForConditionalGeneration",
         "qwen3-vl-moe": "Qwen3VLMoeForConditionalGeneration", "qwen3.5-vl": "Qwen3_5ForConditionalGeneration",
         "qwen3.5-vl-moe": "Qwen3_5MoeForConditionalGeneration"}
INTERLEAVED = {"qwen2.5-vl": False, "qwen3-vl": True, "qwen3.5-vl": True}
CHAT = "<|im_start|>user\n{images}how many?<|im_end|>\n<|im_start|>assistant\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (checkpoint dir, rollout with images), written on first use."""
    from slime.tools.tiny_vl_checkpoint import TinyVLSpec, write_tiny_vl_checkpoint

    made = {}

    def get(kind):
        if kind not in made:
            path = str(write_tiny_vl_checkpoint(tmp_path_factory.mktemp(kind.replace(".", "_")), TinyVLSpec(kind=kind)))
            made[kind] = path, image_rollout(path)
        return made[kind]

    return get


def image_rollout(hf_dir: str, seed: int = 0) -> dict:
    """A rollout batch of 4 samples: one image (two sizes), two images, none; random responses, advantages."""
    from slime.tools.square_images import draw_picture
    from slime.utils.images import canonical_image
    from slime.utils.vision_processor import load_vision_processor

    processor = load_vision_processor(hf_dir)
    rng = random.Random(seed)
    data = {key: [] for key in ("tokens", "response_lengths", "loss_masks", "advantages", "rewards",
                                "multimodal_train_inputs")}
    for sizes in ((32,), (24, 16), (), (48,)):
        images = [canonical_image(draw_picture(rng.randint(0, 3), rng, size=size)) for size in sizes]
        prompt = processor.prompt_ids(CHAT.format(images=IMAGE * len(images)), images)
        response = [rng.randrange(10, 40) for _ in range(rng.randint(3, 6))]
        reward = rng.choice([-1.0, 1.0])
        data["tokens"].append(prompt + response)
        data["response_lengths"].append(len(response))
        data["loss_masks"].append([1] * len(response))
        data["advantages"].append([reward] * len(response))
        data["rewards"].append(reward)
        data["multimodal_train_inputs"].append(processor.process(images).as_train_inputs() if images else None)
    return data


# ----------------------------------------------------------------- position rows (no ranks)
@pytest.mark.parametrize("kind", sorted(INTERLEAVED))
def test_position_rows_and_rotary_angles_are_transformers_own(kind):
    from slime.models.mrope import angles, position_rows
    from slime.models.vision_arch import qwen_vision_arch
    from slime.tools.tiny_vl_checkpoint import TinyVLSpec, build_config, model_class

    config = build_config(TinyVLSpec(kind=kind))
    model = model_class(kind)(config).eval()
    image = config.image_token_id
    grids = torch.tensor([[1, 8, 12], [1, 6, 4], [1, 4, 4]])
    run = lambda n: [config.vision_start_token_id] + [image] * n + [config.vision_end_token_id]  # noqa: E731
    tokens = [5, 6, *run(24), 7, 8, *run(6), *run(4), 9]  # the last two images side by side
    ids = torch.tensor([tokens])
    want, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == image).int(), image_grid_thw=grids)
    rows = position_rows(tokens, grids, image, 2, length=len(tokens) + 3)
    assert torch.equal(rows[:, :len(tokens)], want[:, 0])
    assert torch.equal(rows[:, len(tokens):], (want.max() + 1 + torch.arange(3)).expand(3, -1))  # padding goes on
    assert not torch.equal(rows[1], rows[0]) and not torch.equal(rows[2], rows[1])
    rotary = model.model.language_model.rotary_emb
    cos, sin = rotary(torch.zeros(1), want)
    pairs = angles(want[:, 0], rotary.inv_freq, qwen_vision_arch(config, kind, interleaved=INTERLEAVED[kind]).rope)
    assert torch.equal(torch.cat([pairs, pairs], -1).cos(), cos[0])
    assert torch.equal(torch.cat([pairs, pairs], -1).sin(), sin[0])


def test_a_packed_micro_batch_carries_each_samples_rows_and_features_whole(checkpoints):
    """Rows of the whole micro-batch (every sequence from 0, in packed order), CP slices of the feature rows that
    gather back to the micro-batch's, the pixel values of its samples in order; a prompt whose image tokens are not
    its images' is named."""
    import transformers

    from slime.backends.megatron_utils.data import pack_micro_batch, zigzag_gather
    from slime.models.mrope import position_rows
    from slime.models.registry import language_model_config

    hf_dir, data = checkpoints("qwen3.5-vl")
    vision = getattr(language_model_config(transformers.AutoConfig.from_pretrained(hf_dir), vision=True),
                     "slime_vision_arch")
    samples = (0, 1, 2)
    parts = [pack_micro_batch(data, samples, cp_size=2, cp_rank=r, tp_size=2, sequence_parallel=True,
                              vision=vision) for r in range(2)]
    assert torch.equal(parts[0].position_rows, parts[1].position_rows)
    offset, features = 0, []
    for i, padded in zip(samples, parts[0].padded_lengths):
        grids = (data["multimodal_train_inputs"][i] or {}).get("image_grid_thw")
        prompt = data["tokens"][i][:len(data["tokens"][i]) - data["response_lengths"][i]]
        assert torch.equal(parts[0].position_rows[:, offset:offset + padded],
                           position_rows(prompt, grids, vision.image_token_id, 2, padded))
        local = [p.image_feature_index[sum(p.local_lengths[:k]): sum(p.local_lengths[:k + 1])]
                 for p in parts for k in [samples.index(i)]]
        whole = zigzag_gather(local)
        features += whole[whole >= 0].tolist()
        assert whole[:len(prompt)].ge(0).tolist() == [t == vision.image_token_id for t in prompt]
        offset += padded
    image_tokens = sum(data["tokens"][i].count(vision.image_token_id) for i in samples)
    assert features == list(range(image_tokens)) and image_tokens == 16 + 9 + 4  # 32, 24 and 16 pixels square
    inputs = [data["multimodal_train_inputs"][i] for i in samples if data["multimodal_train_inputs"][i]]
    assert torch.equal(parts[1].pixel_values, torch.cat([x["pixel_values"] for x in inputs]))
    broken = dict(data, multimodal_train_inputs=[None, *data["multimodal_train_inputs"][1:]])
    with pytest.raises(ValueError, match="sample 0: its prompt holds 16 image tokens .* its images 0"):
        pack_micro_batch(broken, samples, cp_size=1, cp_rank=0, tp_size=1, sequence_parallel=False, vision=vision)


# ----------------------------------------------------------------- one process: against transformers
def _single_child(rank, world, hf_dir, data):
    """Log-probs of every response, the gradient of every HF tensor of the summed response log-probs, the export."""
    import transformers
    from megatron.core import tensor_parallel

    from slime.backends.megatron_utils.data import pack_micro_batch
    from slime.backends.megatron_utils.model import build_gpt_model
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.models.cp_attention import packed_seq_params
    from slime.models.registry import language_model_config
    from slime_plugins.models.hf_weights import export_hf_weights, load_hf_weights
    from train_step_harness import layout_args

    args = layout_args({})
    init_model_parallel(args)
    hf_config = language_model_config(transformers.AutoConfig.from_pretrained(hf_dir), vision=True)
    model = build_gpt_model(args, hf_config).eval()
    load_hf_weights([model], hf_dir, hf_config)
    loaded = {name: tensor.clone() for name, tensor in export_hf_weights([model], hf_config)}
    batch = pack_micro_batch(data, tuple(range(len(data["tokens"]))), cp_size=1, cp_rank=0, tp_size=1,
                             sequence_parallel=False, vision=model.vision_arch)
    logits = model(batch.input_ids, batch.position_ids, None, vision=batch.vision(),
                   packed_seq_params=packed_seq_params(batch.cu_seqlens, batch.padded_lengths))
    log_probs = -tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                              batch.labels.unsqueeze(1))[:, 0]
    (log_probs * batch.loss_mask).sum().backward()
    grads = dict(export_hf_weights([model], hf_config, read_param=lambda p: p.grad if p.grad is not None
                                   else torch.zeros_like(p)))
    return dict(loaded=loaded, grads=grads, log_probs=log_probs.detach(), loss_mask=batch.loss_mask,
                labels=batch.labels, cu=batch.cu_seqlens, lengths=batch.total_lengths)


def _hf_log_probs_and_grads(hf_dir, data, architecture, flatten_rows=False):
    """transformers' composite class: each sample's response log-probs and (summed over samples) the gradient of
    every parameter by its checkpoint name. `flatten_rows`: the height and width rows replaced by the temporal one
    (what a model that drops them computes)."""
    import transformers

    from slime.backends.embedded_engine.engine import checkpoint_target

    model = transformers.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == architecture
    image, out = model.config.image_token_id, []
    for tokens, response, images in zip(data["tokens"], data["response_lengths"], data["multimodal_train_inputs"]):
        ids = torch.tensor([tokens])
        inputs = {} if images is None else dict(images, mm_token_type_ids=(ids == image).int())
        if flatten_rows:
            rows, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == image).int(),
                                                 image_grid_thw=inputs.get("image_grid_thw"))
            inputs["position_ids"] = rows[:1].expand(3, -1, -1)
        with torch.set_grad_enabled(not flatten_rows):  # the flattened rows' log-probs only
            log_probs = model(input_ids=ids, **inputs).logits[0].float().log_softmax(-1)
        picked = torch.stack([log_probs[t - 1, tokens[t]] for t in range(len(tokens) - response, len(tokens))])
        if not flatten_rows:
            picked.sum().backward()
        out.append(picked.detach().tolist())
    grads = {name: param.grad if param.grad is not None else torch.zeros_like(param)
             for name, param in model.named_parameters()}
    return out, lambda name: checkpoint_target(name, grads, model.config)


def _responses(result, data) -> list[list[float]]:
    """Each sample's response log-probs from the packed single-process output."""
    out = []
    for k, (total, response) in enumerate(zip(data["tokens"], data["response_lengths"])):
        start = int(result["cu"][k]) + len(total) - response - 1
        out.append(result["log_probs"][start:start + response].tolist())
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_log_probs_and_gradients_with_images_equal_transformers_and_export_is_exact(checkpoints, kind):
    from safetensors.torch import load_file

    hf_dir, data = checkpoints(kind)
    (result,) = run_ranks(_single_child, 1, args=(hf_dir, data), timeout_s=280)
    reference, reference_grads = _hf_log_probs_and_grads(hf_dir, data, KINDS[kind])
    got = _responses(result, data)
    assert max(abs(a - b) for x, y in zip(got, reference) for a, b in zip(x, y)) < TOLERANCE
    flattened, _ = _hf_log_probs_and_grads(hf_dir, data, KINDS[kind], flatten_rows=True)
    assert max(abs(a - b) for x, y in zip(flattened, reference) for a, b in zip(x, y)) > 10 * TOLERANCE
    original = load_file(f"{hf_dir}/model.safetensors")
    assert sorted(result["loaded"]) == sorted(original)
    assert all(torch.equal(result["loaded"][name], original[name]) for name in original)
    tower = [name for name in original if "visual." in name]
    assert tower and all(result["grads"][name].abs().sum() > 0 for name in tower if "deepstack" not in name)
    for name, grad in result["grads"].items():
        assert (grad - reference_grads(name)).abs().max().item() < TOLERANCE, name


# ----------------------------------------------------------------- TP2 x SP x CP2: the fenced step and the push
TP2_SP_CP2_EP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                      expert_model_parallel_size=2, expert_tensor_parallel_size=1)
# Qwen3-VL-MoE's text layers are Qwen3-VL's attention with fused experts: its run covers Qwen3-VL's deepstack too
LAYOUTS = {"qwen3.5-vl-moe": TP2_SP_CP2_EP2, "qwen3-vl-moe": TP2_SP_CP2_EP2}
TRAINING = dict(calculate_per_token_loss=True, lr=1e-3, max_tokens_per_gpu=96)
SAVED_KIND = "qwen3.5-vl-moe"  # --save / --load / --save-hf once: the tower is saved the same way in every family


def _step_child(rank, world, ledger_dir, hf_dir, data, layout, save_dir=None, mutate_rows=False):
    """Load, log-probs, one recorded training step, log-probs again and the export (as test_model_families'
    MoE child), with the vision tower trained; `save_dir`: then --save (reloaded into a fresh model, exported
    again) and --save-hf; `mutate_rows`: also the loaded model's log-probs with each of BROKEN_ROWS."""
    import transformers

    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime.models.registry import language_model_config
    from slime_plugins.models.hf_weights import export_hf_weights, load_hf_weights
    from train_step_harness import layout_args, plans_for_this_rank, recorded_phase

    args = layout_args(layout)
    init_model_parallel(args)
    hf_config = language_model_config(transformers.AutoConfig.from_pretrained(hf_dir), vision=True)
    model, optimizer, scheduler = build_model_and_optimizer(args, hf_config)
    load_hf_weights(model, hf_dir, hf_config)
    (plan,) = plans_for_this_rank(data, args)
    before = compute_log_probs(model, data, plan, args)
    broken = {name: _log_probs_with_rows(model, data, plan, args, change) for name, change in BROKEN_ROWS.items()
              } if mutate_rows else {}
    data = dict(data, log_probs=before, ref_log_probs=before, rollout_log_probs=before)
    with recorded_phase(rank, world, ledger_dir):
        step = train_one_step(model, optimizer, scheduler, data, plan, args)
    after = compute_log_probs(model, data, plan, args)
    trained = {name: tensor.clone() for name, tensor in export_hf_weights(model, hf_config)}
    reloaded = None
    if save_dir is not None:
        from slime.backends.megatron_utils.checkpoint import load_checkpoint, save_checkpoint, save_hf_checkpoint

        save_checkpoint(f"{save_dir}/megatron", 1, model, optimizer, scheduler)
        save_hf_checkpoint(f"{save_dir}/hf", model, hf_config, hf_dir)
        fresh, fresh_optimizer, fresh_scheduler = build_model_and_optimizer(args, hf_config)
        load_checkpoint(f"{save_dir}/megatron", fresh, fresh_optimizer, fresh_scheduler)
        reloaded = {name: tensor.clone() for name, tensor in export_hf_weights(fresh, hf_config)}
    return dict(before=before, after=after, trained=trained, loss=step.loss, grad_norm=step.grad_norm,
                skipped=step.skipped, micro_batches=plan.num_micro_batches, reloaded=reloaded, broken=broken)


# What a trainer that loses or shifts multimodal RoPE's rows anywhere between the packer and the rotary table would
# compute (the rows of the whole micro-batch, as every CP rank holds them)
BROKEN_ROWS = {"height and width rows dropped": lambda rows: rows[:1].expand(3, -1),
               "height and width rows swapped": lambda rows: rows[[0, 2, 1]],
               "rows a token late": lambda rows: torch.cat([rows[:, :1], rows[:, :-1]], dim=1)}


def _log_probs_with_rows(model, data, plan, args, change):
    """compute_log_probs with every packed micro-batch's position rows changed by `change`."""
    import dataclasses

    from slime.backends.megatron_utils import train_step

    real = train_step.pack_micro_batch

    def packed(*a, **k):
        batch = real(*a, **k)
        return dataclasses.replace(batch, position_rows=change(batch.position_rows).contiguous())

    train_step.pack_micro_batch = packed
    try:
        return train_step.compute_log_probs(model, data, plan, args)
    finally:
        train_step.pack_micro_batch = real


def _engine_log_probs(engine, data) -> list[list[float]]:
    """The embedded engine's prompt log-probs of each sample's response, with the sample's images."""
    from slime.backends.embedded_engine.engine import GenerationRequest
    from slime.backends.embedded_engine.sampling import SamplingParams
    from slime.utils.vision_processor import ProcessedImages

    params = SamplingParams.from_request({"max_new_tokens": 0, "temperature": 1.0})
    requests = [GenerationRequest(rid=str(i), input_ids=tuple(tokens), params=params, return_logprob=True,
                                  logprob_start_len=0, images=ProcessedImages(**images) if images else None)
                for i, (tokens, images) in enumerate(zip(data["tokens"], data["multimodal_train_inputs"]))]
    results = engine.generate_batch(requests)
    return [[lp for lp, _ in r.input_logprobs[-n:]] for r, n in zip(results, data["response_lengths"])]


def _max_gap(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


@pytest.mark.timeout(420)
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_step_under_tp2_sp_cp2_matches_the_single_process_and_the_pushed_engine(checkpoints, kind, tmp_path):
    from safetensors.torch import load_file

    from slime.backends.embedded_engine.engine import EmbeddedEngine
    from slime.backends.sglang_utils.tensor_digest import tensor_digests
    from slime.distributed.order_proof import check_order, read_sequences

    hf_dir, data = checkpoints(kind)
    results = run_ranks(_step_child, 4, args=(str(tmp_path / "layout"), hf_dir, data,
                                              dict(LAYOUTS[kind], **TRAINING), None, True), timeout_s=400)
    report = check_order(read_sequences(str(tmp_path / "layout")))
    assert report.ok, report.format()
    saves = kind == SAVED_KIND
    (single,) = run_ranks(_step_child, 1, args=(str(tmp_path / "single"), hf_dir, data, TRAINING,
                                                str(tmp_path / "saved") if saves else None), timeout_s=300)
    result = results[0]
    assert result["micro_batches"] > 1 and not result["skipped"]  # dynamic batches of whole samples
    assert result["loss"] == pytest.approx(single["loss"], abs=1e-5)
    assert result["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
    engine = EmbeddedEngine(hf_dir, dtype="float32")
    loaded = _engine_log_probs(engine, data)
    assert _max_gap(result["before"], loaded) < TOLERANCE
    # multimodal RoPE's rows dropped or misaligned anywhere on the way to the CP ranks' rotary tables is caught
    assert set(result["broken"]) == set(BROKEN_ROWS)
    for broken, log_probs in result["broken"].items():
        assert _max_gap(log_probs, loaded) > 100 * TOLERANCE, broken
    assert _max_gap(result["after"], single["after"]) < TOLERANCE
    tower = {name: t for name, t in result["trained"].items() if "visual." in name}
    assert any(not torch.equal(t, engine.get_weight(name)) for name, t in tower.items())  # the step moved it
    engine.update_weights([(n, t) for n, t in result["trained"].items() if n not in tower], "v2")
    assert _max_gap(result["after"], _engine_log_probs(engine, data)) > 100 * TOLERANCE  # the stale tower shows
    engine.update_weights(list(tower.items()), "v3")
    assert _max_gap(result["after"], _engine_log_probs(engine, data)) < TOLERANCE
    # what the weight-sync proof compares: the engine's digest of every tensor it serves (Qwen3-VL-MoE's fused experts
    # through transformers' transposed in-memory ones) equals the pushed tensor's
    names = sorted(result["trained"])
    served = engine.weight_checksums()
    assert set(served) == set(names)
    assert [served[n] for n in names] == tensor_digests([result["trained"][n] for n in names])
    if not saves:
        return
    # --save / --load and --save-hf keep the trained tower: a fresh model reloads it, the saved HF checkpoint is
    # complete and serves the trained log-probs with images
    assert sorted(single["reloaded"]) == sorted(single["trained"])
    assert all(torch.equal(single["reloaded"][n], t) for n, t in single["trained"].items())
    saved = load_file(str(tmp_path / "saved" / "hf" / "model.safetensors"))
    assert sorted(saved) == sorted(single["trained"])
    assert all(torch.equal(saved[n], t) for n, t in single["trained"].items())
    served = EmbeddedEngine(str(tmp_path / "saved" / "hf"), dtype="float32")
    assert served.vision is not None
    assert _max_gap(single["after"], _engine_log_probs(served, data)) < TOLERANCE


@pytest.mark.timeout(300)
def test_upstreams_freeze_flag_freezes_the_tower_alone(checkpoints, tmp_path):
    """--freeze-params-name-list visual (upstream's flag, a regex on parameter names): the step trains the text model
    and leaves every tensor of the tower as loaded."""
    from safetensors.torch import load_file

    hf_dir, data = checkpoints("qwen3-vl")
    (result,) = run_ranks(_step_child, 1, args=(str(tmp_path), hf_dir, data,
                                                dict(TRAINING, freeze_params_name_list=["visual"])), timeout_s=280)
    original = load_file(f"{hf_dir}/model.safetensors")
    assert not result["skipped"]
    tower = [name for name in original if name.startswith("model.visual.")]
    assert tower and all(torch.equal(result["trained"][name], original[name]) for name in tower)
    assert not torch.equal(result["trained"]["lm_head.weight"], original["lm_head.weight"])


# ----------------------------------------------------------------- Qwen3-VL-MoE's fused experts
def test_fused_experts_map_onto_transformers_own_gate_and_up(checkpoints):
    """megatron's fc1 of expert e (at expert-TP 1) is transformers' in-memory gate_up_proj[e], gate rows first (what
    its experts' forward chunks into gate and up), fc2 its down_proj[e]; at expert-TP 2 rank r holds [gate_r; up_r];
    every way back gives the file's row. A mapping that swapped gate and up, interleaved them or read a row
    untransposed fails here (the tiny checkpoint's expert tensors are not square, so a transposition cannot pass)."""
    import transformers
    from safetensors.torch import load_file

    from slime.models.qwen3_vl_moe import stacked_experts

    hf_dir, _ = checkpoints("qwen3-vl-moe")
    model = transformers.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    memory, stored = model.state_dict(), load_file(f"{hf_dir}/model.safetensors")
    config, prefix = model.config.text_config, "model.language_model.layers.1."
    width = config.moe_intermediate_size
    for expert in range(config.num_experts):
        for fc, fused in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
            for etp in (1, 2):
                names, to_megatron, to_hf = stacked_experts(f"mlp.experts.local_experts.{expert}.{fc}.weight",
                                                            prefix, etp, config)
                assert names == (f"{prefix}mlp.experts.{fused}",)
                row = stored[names[0]][expert]
                megatron = to_megatron([row])
                assert torch.equal(to_hf(megatron)[0], row)
                in_memory = memory[names[0]][expert]
                if fc == "linear_fc2" or etp == 1:
                    assert torch.equal(megatron, in_memory)
                    continue
                gate, up = in_memory[:width], in_memory[width:]
                for rank, shard in enumerate(megatron.chunk(etp)):
                    assert torch.equal(shard, torch.cat([gate.chunk(etp)[rank], up.chunk(etp)[rank]]))


def test_expert_layouts_that_cannot_be_told_apart_are_refused_before_ray(checkpoints, tmp_path):
    """The released layout passes; a checkpoint as transformers 5 saves it (its in-memory layout) and sizes that
    make the fused tensors square are refused naming why; another vision + text MoE (GLM-4.6V) stays refused."""
    import json
    import shutil

    import transformers

    from slime.config import defaults_namespace
    from slime.config.errors import ArgumentValidationError
    from slime.config.launch import check_hf_config

    def check(path):
        check_hf_config(defaults_namespace(hf_checkpoint=str(path)), f"{path}/config.json")

    hf_dir, _ = checkpoints("qwen3-vl-moe")
    check(hf_dir)
    resaved = tmp_path / "transformers_layout"
    transformers.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).save_pretrained(resaved)
    with pytest.raises(ArgumentValidationError, match=r"gate_up_proj is stored \[4, 48, 64\], transformers' in-memory"):
        check(resaved)
    config = json.loads((resaved / "config.json").read_text())
    for name, edit in (("square", {"moe_intermediate_size": 32}), ("glm", None)):
        (tmp_path / name).mkdir()
        shutil.copy(f"{hf_dir}/model.safetensors", tmp_path / name)
        changed = dict(config, text_config=dict(config["text_config"], **edit)) if edit else dict(config,
                                                                                                 model_type="glm4v_moe")
        (tmp_path / name / "config.json").write_text(json.dumps(changed))
    with pytest.raises(ArgumentValidationError, match="make the fused expert tensors square"):
        check(tmp_path / "square")
    with pytest.raises(ArgumentValidationError, match="'glm4v_moe', which no model family here builds"):
        check(tmp_path / "glm")


def test_the_released_config_spelling_builds_untied_as_transformers_does(checkpoints, tmp_path):
    """Qwen's released config.json leaves text_config.tie_word_embeddings out (the class default: True) beside an
    untied outer one, spells the experts num_experts and says norm_topk_prob: it passes the check before Ray, and
    the text model is built untied, as transformers' composite class ties by the outer one."""
    import json
    import shutil

    import transformers

    from slime.config import defaults_namespace
    from slime.config.launch import check_hf_config
    from slime.models.registry import language_model_config

    hf_dir, _ = checkpoints("qwen3-vl-moe")
    config = json.loads(open(f"{hf_dir}/config.json").read())
    text = {k: v for k, v in config["text_config"].items() if k not in ("tie_word_embeddings", "num_local_experts")}
    config["text_config"] = dict(text, num_experts=4, norm_topk_prob=True)
    shutil.copy(f"{hf_dir}/model.safetensors", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_hf_config(defaults_namespace(hf_checkpoint=str(tmp_path)), str(tmp_path / "config.json"))
    whole = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert whole.text_config.tie_word_embeddings and not whole.tie_word_embeddings  # as transformers reads it
    built = language_model_config(whole, vision=True)
    assert not built.tie_word_embeddings and built.num_experts == 4


def _sglang_qwen3_vl_moe_loader():
    """SGLang's own Qwen3VLMoeForConditionalGeneration.load_weights and load_fused_expert_weights (the newest supported
    release's file, read by path: SGLang does not import here), with its layer and MoE helpers as plain stand-ins."""
    import ast
    import re
    import textwrap
    import types

    from sglang_files import sglang_root, supported_versions

    path = sglang_root(supported_versions()[1]) / "sglang" / "srt" / "models" / "qwen3_vl_moe.py"
    tree = ast.parse(path.read_text())
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                 and node.name == "load_fused_expert_weights"]
    functions += [node for cls in tree.body if isinstance(cls, ast.ClassDef)
                  and cls.name == "Qwen3VLMoeForConditionalGeneration"
                  for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "load_weights"]
    assert len(functions) == 2, path
    namespace = dict(torch=torch, logger=types.SimpleNamespace(warning=lambda *a: None),
                     FusedMoE=types.SimpleNamespace(make_expert_params_mapping=lambda **k: []),
                     get_layer_id=lambda name: int(m.group(1)) if (m := re.search(r"layers\.(\d+)\.", name)) else None,
                     default_weight_loader=lambda param, weight: None, Iterable=list, Tuple=tuple)
    exec(compile(ast.Module(body=[ast.parse(textwrap.dedent(ast.get_source_segment(path.read_text(), f))).body[0]
                                  for f in functions], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["load_weights"]


def test_sglangs_loader_reads_the_pushed_fused_experts_as_transformers_gate_up_and_down(checkpoints):
    """The pushed fused experts (the checkpoint's names and layout) through SGLang's own Qwen3-VL-MoE loader: each
    expert's w1 / w3 (gate / up) and w2 shards are transformers' in-memory gate and up halves and down_proj."""
    import types

    import transformers
    from safetensors.torch import load_file

    hf_dir, _ = checkpoints("qwen3-vl-moe")
    memory = transformers.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    pushed = {n: t for n, t in load_file(f"{hf_dir}/model.safetensors").items() if ".mlp.experts." in n}
    loaded = {}

    def weight_loader(param, weight, name, shard_id, expert_id):
        loaded[(name, shard_id, expert_id)] = weight.clone()

    experts = 4
    params = {f"model.layers.{layer}.mlp.experts.{w}": types.SimpleNamespace(weight_loader=weight_loader)
              for layer in (0, 1) for w in ("w13_weight", "w2_weight")}
    sglang_model = types.SimpleNamespace(config=types.SimpleNamespace(num_experts=experts, encoder_only=False,
                                                                      language_only=False),
                                         named_parameters=lambda: params.items())
    _sglang_qwen3_vl_moe_loader()(sglang_model, list(pushed.items()))
    assert len(loaded) == 2 * 3 * experts
    width = memory["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape[1] // 2
    for layer in (0, 1):
        gate_up = memory[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"]
        down = memory[f"model.language_model.layers.{layer}.mlp.experts.down_proj"]
        prefix = f"model.layers.{layer}.mlp.experts."
        for e in range(experts):
            assert torch.equal(loaded[(prefix + "w13_weight", "w1", e)], gate_up[e, :width])
            assert torch.equal(loaded[(prefix + "w13_weight", "w3", e)], gate_up[e, width:])
            assert torch.equal(loaded[(prefix + "w2_weight", "w2", e)], down[e])


def test_the_embedded_engine_serves_the_fused_experts_in_the_checkpoints_layout(checkpoints):
    """get_weight of a fused expert tensor is the checkpoint's ([E, H, 2I], a view of transformers' [E, 2I, H]), and
    /update_weights_from_disk writes each tensor back through the same view."""
    from safetensors.torch import load_file

    from slime.backends.embedded_engine.engine import EmbeddedEngine

    hf_dir, _ = checkpoints("qwen3-vl-moe")
    stored = load_file(f"{hf_dir}/model.safetensors")
    engine = EmbeddedEngine(hf_dir, dtype="float32")
    fused = [name for name in stored if ".mlp.experts." in name]
    assert fused and all(torch.equal(engine.get_weight(name), stored[name]) for name in fused)
    with torch.no_grad():
        for param in engine.model.parameters():
            param.zero_()
    assert engine.update_weights_from_disk(hf_dir, "v2") == len(engine.model.state_dict())
    assert all(torch.equal(engine.get_weight(name), tensor) for name, tensor in stored.items())
