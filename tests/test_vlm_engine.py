"""Images through the embedded engine and the rollout: SGLang's `image_data` on /generate, served by transformers'
composite class; log-probs equal transformers' own forward of the same model on the same processed inputs (fp32,
CPU), in a batch mixing images and text; the rollout sends the images and hands the trainer the pixel values."""
from __future__ import annotations

import io

import pytest
import requests
import torch

from rollout_testing import AppThread
from slime.config import defaults_namespace
from slime.rollout.train_data import samples_to_train_data
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.prompt_media import image_messages
from slime.utils.images import canonical_image
from slime.utils.security import auth_headers, current_key

pytestmark = pytest.mark.timeout(300)


def picture(seed: int, width: int, height: int) -> str:
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return canonical_image(buffer.getvalue())


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def served(request, tmp_path_factory):
    """(checkpoint, engine, server) of a tiny vision + text checkpoint served in-process."""
    import tiny_models
    from slime.backends.embedded_engine.engine import EmbeddedEngine
    from slime.backends.embedded_engine.server import build_app

    path = getattr(tiny_models, f"save_tiny_{request.param}")(str(tmp_path_factory.mktemp(request.param)), seed=1)
    engine = EmbeddedEngine(path, dtype="float32", seed=3)
    server = AppThread(build_app(engine, api_key=current_key())).start()
    yield path, engine, server
    server.stop()


def _post(server, body: dict):
    response = requests.post(f"http://127.0.0.1:{server.port}/generate", json=body, headers=auth_headers(), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _reference_logprobs(model, vision, prompt_ids, output_ids, processed):
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    inputs = {}
    if processed is not None:
        inputs = dict(pixel_values=processed.pixel_values, image_grid_thw=processed.image_grid_thw,
                      mm_token_type_ids=(ids == vision.image_token_id).int())
    with torch.no_grad():
        logprobs = model(input_ids=ids, **inputs).logits[0].float().log_softmax(-1)
    start = len(prompt_ids)
    return [logprobs[start - 1 + j, token].item() for j, token in enumerate(output_ids)]


def test_generate_with_images_equals_transformers_forward(served):
    """Three concurrent requests batch together (left padding): one image by text, two images by token ids with
    one placeholder each (the engine expands them, as SGLang does), and text alone."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForImageTextToText

    path, engine, server = served
    vision = engine.vision
    render = lambda prompt, n: vision.tokenizer.apply_chat_template(  # noqa: E731
        image_messages(prompt, n, "test"), tokenize=False, add_generation_prompt=True)
    one, two = [picture(1, 30, 45)], [picture(2, 64, 20), picture(3, 16, 16)]
    params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    bodies = [
        {"text": render("<image>how many?", 1), "image_data": one[0]},
        {"input_ids": vision.tokenizer(render("<image> and <image>?", 2))["input_ids"], "image_data": two},
        {"text": "12 apples"},
    ]
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda b: _post(server, {**b, "sampling_params": params, "return_logprob": True}),
                                bodies))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [vision.prompt_ids(render("<image>how many?", 1), one), vision.prompt_ids(render("<image> and <image>?", 2), two),
               vision.tokenizer("12 apples")["input_ids"]]
    for reply, prompt, images in zip(replies, prompts, (one, two, None)):
        meta = reply["meta_info"]
        output = [entry[1] for entry in meta["output_token_logprobs"]]
        assert meta["prompt_tokens"] == len(prompt) and len(output) == 6
        assert vision.image_token_id not in output  # a generated image token would be a text token to the engine
        processed = vision.process(images) if images else None
        expected = _reference_logprobs(model, vision, prompt, output, processed)
        assert [entry[0] for entry in meta["output_token_logprobs"]] == pytest.approx(expected, abs=1e-5)
        if images:  # the images matter: another picture gives other log-probs for the same tokens
            other = vision.process([picture(9, 24, 24)] * len(images))
            prompt_other = vision.expand_runs(prompt, other)
            moved = _reference_logprobs(model, vision, prompt_other, output, other)
            assert max(abs(a - b) for a, b in zip(moved, expected)) > 1e-3


def test_image_requests_the_engine_cannot_serve_are_clear_errors(served):
    path, engine, server = served
    prompt = engine.vision.tokenizer.apply_chat_template(image_messages("<image>x", 1, "t"), tokenize=False,
                                                         add_generation_prompt=True)
    base = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}
    for image_data, says in (("https://host/a.png", "is a URL"), ([picture(1, 8, 8)] * 2, "1 image-token run(s) for 2")):
        response = requests.post(f"http://127.0.0.1:{server.port}/generate", json={**base, "image_data": image_data},
                                 headers=auth_headers(), timeout=60)
        assert response.status_code == 400 and says in response.json()["error"]["message"], response.text


def test_the_rollout_sends_images_and_hands_the_trainer_their_pixel_values(served, tmp_path):
    from slime.rollout.sglang_rollout import GenerateState, generate_rollout
    from slime.tools.square_images import write_task
    from slime.utils.misc import SingletonMeta

    path, engine, server = served
    SingletonMeta._instances.pop(GenerateState, None)
    prompts = write_task(tmp_path, n=4, size=40)["parquet"]
    args = defaults_namespace(
        prompt_data=str(prompts), hf_checkpoint=path, input_key="prompt", label_key="label", apply_chat_template=True,
        multimodal_keys={"image": "images"}, rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=3,
        rollout_temperature=1.0, sglang_router_ip="127.0.0.1", sglang_router_port=server.port,
        custom_rm_path="examples.square_count_reward.reward", debug_rollout_only=True, rollout_max_context_len=None)
    try:
        output = generate_rollout(args, 0, RolloutDataSource(args))
    finally:
        SingletonMeta._instances.pop(GenerateState, None)
    samples = [sample for group in output.samples for sample in group]
    data = samples_to_train_data(args, output.samples)
    assert len(data["multimodal_train_inputs"]) == len(samples) == 4
    for group in output.samples:
        first, second = group
        # a prompt's samples share one processed copy (carried once through Ray) and one id
        assert first.multimodal_train_inputs["pixel_values"] is second.multimodal_train_inputs["pixel_values"]
        assert first.multimodal_train_input_id == second.multimodal_train_input_id
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    for sample, inputs in zip(samples, data["multimodal_train_inputs"]):
        processed = engine.vision.process(sample.multimodal_inputs["images"])
        assert torch.equal(inputs["pixel_values"], processed.pixel_values)
        assert inputs["image_grid_thw"].tolist() == [[1, 10, 10]]
        prompt = sample.tokens[:len(sample.tokens) - sample.response_length]
        assert prompt.count(engine.vision.image_token_id) == 25 and 0.0 <= sample.reward <= 1.0
        # the engine saw the pictures: its log-probs are those of the model given these pixel values
        expected = _reference_logprobs(model, engine.vision, prompt, sample.tokens[len(prompt):], processed)
        assert sample.rollout_log_probs == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_a_push_by_checkpoint_names_reaches_the_composite_class(moe, tmp_path):
    """Served with images, a Qwen3.5 checkpoint is the composite class, whose text tensors keep
    `model.language_model.` (MoE experts fused): the trainer's pushed names (the checkpoint's) still reach them."""
    import transformers
    from safetensors.torch import load_file

    from slime.backends.embedded_engine.engine import checkpoint_target
    from tiny_models import save_tiny_qwen3_5_composite

    first, other = (save_tiny_qwen3_5_composite(str(tmp_path / str(seed)), seed=seed, moe=moe) for seed in (0, 1))
    engine = transformers.AutoModelForImageTextToText.from_pretrained(first, dtype=torch.float32).eval()
    pushed = {name: tensor for name, tensor in load_file(f"{other}/model.safetensors").items()
              if not name.startswith("model.visual.")}
    state = engine.state_dict()
    with torch.no_grad():
        for name, tensor in pushed.items():
            checkpoint_target(name, state, engine.config).copy_(tensor)
    tokens = torch.randint(0, engine.config.get_text_config().vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    want = transformers.AutoModelForImageTextToText.from_pretrained(other, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(engine(input_ids=tokens).logits, want(input_ids=tokens).logits)
