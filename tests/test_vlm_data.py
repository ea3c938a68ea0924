"""Images of prompt rows (--multimodal-keys): every accepted form, the clear errors before Ray, the data source's
expanded image tokens, the processor against transformers' own, and the square-counting task's files."""
from __future__ import annotations

import base64
import io
import json

import pytest
import torch

from arg_testing import parse_error, parse_quiet  # noqa: F401 (fixture: no_real_sglang)
from arg_testing import no_real_sglang  # noqa: F401
from rollout_testing import write_jsonl
from slime.config import defaults_namespace
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.prompt_media import image_messages, parse_media_keys, row_images
from slime.utils.images import ImageInputError, canonical_image, data_uri_bytes, open_image

pytestmark = pytest.mark.timeout(180)

KEYS = '{"image": "images"}'


def png(seed: int = 0, size: tuple[int, int] = (20, 12), mode: str = "RGB") -> bytes:
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    """Qwen3.5 with its vision tower: the family the trainer builds (a Qwen2.5-VL checkpoint is refused at parse
    time by its model type before the images are looked at)."""
    from tiny_models import save_tiny_qwen3_5_vl

    return save_tiny_qwen3_5_vl(str(tmp_path_factory.mktemp("qwen3_5_vl")))


# ---------------------------------------------------------------- one image value -> one canonical image
def test_every_form_of_an_image_reads_as_the_same_canonical_image(tmp_path):
    data = png()
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    forms = [data, "pics/a.png", str(tmp_path / "pics" / "a.png"), b64, f"data:image/png;base64,{b64}",
             {"bytes": data, "path": None}, {"bytes": None, "path": "pics/a.png"}, {"type": "image", "image": b64}]
    uris = {canonical_image(form, tmp_path) for form in forms}
    assert len(uris) == 1 and data_uri_bytes(uris.pop()) == data  # an RGB image keeps its own bytes


def test_images_other_than_plain_rgb_are_stored_as_the_rgb_png_the_processor_sees():
    from PIL import Image

    rgba = png(mode="RGBA")
    uri = canonical_image(rgba)
    assert uri.startswith("data:image/png;") and data_uri_bytes(uri) != rgba
    expected = Image.open(io.BytesIO(rgba)).convert("RGB")
    assert open_image(uri).tobytes() == expected.tobytes()


@pytest.mark.parametrize("value, says", [
    ("https://example.com/a.png", "is a URL: images are not downloaded"),
    ("missing.png", "neither an image file"),
    (b"not an image at all", "cannot be decoded as an image"),
    (base64.b64encode(b"not an image").decode(), "cannot be decoded as an image"),
    ({"type": "image", "image": "a.png", "max_pixels": 4096}, "per-image sizes (max_pixels) are not supported"),
    (3, "got a int"),
])
def test_an_unusable_image_says_why(value, says, tmp_path):
    with pytest.raises(ImageInputError) as info:
        canonical_image(value, tmp_path)
    assert says in str(info.value)


def test_media_keys_placeholders_and_missing_keys():
    assert parse_media_keys({"image": "images"}).image == "images" and parse_media_keys(None) is None
    for value, says in (({"video": "clips"}, "videos are not supported"), ({"audio": "wav"}, "audio is not supported"),
                        ({"picture": "x"}, "unknown media type 'picture'"), ("images", "must be a JSON object")):
        with pytest.raises(ValueError, match=says):
            parse_media_keys(value)
    keys = parse_media_keys({"image": "images"})
    with pytest.raises(ValueError, match=r"f.jsonl:3: image key 'images' missing \(keys: \['prompt'\]\)"):
        row_images({"prompt": "x"}, keys, "f.jsonl:3", None)
    assert row_images({"images": None}, keys, "w", None) == []
    assert image_messages("a<image>b<image>", 2, "w") == [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}, {"type": "image"}]}]
    with pytest.raises(ValueError, match=r"w: the prompt has 1 <image> placeholder\(s\) for 2 image\(s\)"):
        image_messages("<image>how many?", 2, "w")


# ---------------------------------------------------------------- before Ray starts
PARSE_BASE = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
              "--train-backend-device", "cpu", "--input-key", "prompt", "--label-key", "label"]


def _parse_argv(checkpoint, prompts, *extra):
    return [*PARSE_BASE, "--hf-checkpoint", checkpoint, "--prompt-data", str(prompts), "--multimodal-keys", KEYS,
            "--apply-chat-template", *extra]


@pytest.mark.parametrize("row, says", [
    ({"prompt": "<image>x", "label": "1", "images": ["nowhere.png"]}, "image 0 of 'images': 'nowhere.png' is neither"),
    ({"prompt": "<image>x", "label": "1", "images": [base64.b64encode(b"junk").decode()]}, "cannot be decoded"),
    ({"prompt": "<image>x", "label": "1"}, "image key 'images' missing"),
    ({"prompt": "x", "label": "1", "images": ["ok.png"]}, "0 <image> placeholder(s) for 1 image(s)"),
    ({"prompt": "<image>x", "label": "1", "images": ["http://host/a.png"]}, "is a URL"),
])
def test_a_bad_image_row_is_named_by_file_and_line_before_ray(row, says, vl_checkpoint, tmp_path, capsys):
    (tmp_path / "ok.png").write_bytes(png())
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "<image>fine", "label": "1", "images": ["ok.png"]}, row])
    err = parse_error(_parse_argv(vl_checkpoint, prompts), capsys)
    assert f"--prompt-data: {prompts}:2: " in err and says in err and "Traceback" not in err


def test_checked_images_train_with_the_vision_tower_and_what_it_cannot_build_beside_is_refused(vl_checkpoint, tmp_path,
                                                                                               capsys):
    from slime.tools.square_images import write_task

    paths = write_task(tmp_path, n=4)
    for prompts in paths.values():
        assert parse_quiet(_parse_argv(vl_checkpoint, prompts)).multimodal_keys == {"image": "images"}
        parse_quiet(_parse_argv(vl_checkpoint, prompts, "--debug-rollout-only"))
    err = parse_error(_parse_argv(vl_checkpoint, paths["jsonl"], "--advantage-estimator", "ppo"), capsys)
    assert "--multimodal-keys with --advantage-estimator ppo: the critic is not built with a vision tower" in err
    err = parse_error([*PARSE_BASE, "--hf-checkpoint", vl_checkpoint, "--prompt-data", str(paths["jsonl"]),
                       "--multimodal-keys", '{"video": "clips"}', "--apply-chat-template"], capsys)
    assert "videos are not supported" in err
    err = parse_error(_parse_argv(vl_checkpoint, paths["jsonl"])[:-1], capsys)
    assert "--multimodal-keys needs --apply-chat-template" in err


def test_a_text_checkpoint_is_refused_for_images(tmp_path, capsys):
    from slime.tools.square_images import write_task
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

    text_model = write_tiny_checkpoint(tmp_path / "text", TinyQwen3Spec(layers=1, alphabet="0123456789"))
    err = parse_error(_parse_argv(str(text_model), write_task(tmp_path, n=2)["jsonl"]), capsys)
    assert "is not a vision + text checkpoint" in err


# ---------------------------------------------------------------- the data source
def test_the_data_source_expands_each_images_tokens_from_parquet_and_jsonl(vl_checkpoint, tmp_path):
    from slime.tools.square_images import write_task
    from slime.utils.vision_processor import load_vision_processor

    paths = write_task(tmp_path, n=6, size=40)
    processor = load_vision_processor(vl_checkpoint)
    loaded = {}
    for kind, path in paths.items():
        args = defaults_namespace(prompt_data=str(path), hf_checkpoint=vl_checkpoint, input_key="prompt",
                                  label_key="label", apply_chat_template=True, multimodal_keys={"image": "images"},
                                  n_samples_per_prompt=2, rollout_max_context_len=None)
        loaded[kind] = RolloutDataSource(args).dataset.samples
    assert [s.multimodal_inputs for s in loaded["parquet"]] == [s.multimodal_inputs for s in loaded["jsonl"]]
    for sample in loaded["parquet"]:
        (image,) = sample.multimodal_inputs["images"]
        processed = processor.process([image])
        # 40 x 40 pixels -> a 10 x 10 patch grid (4-pixel patches), merged 2 x 2: 25 image tokens
        assert processed.image_grid_thw.tolist() == [[1, 10, 10]]
        assert sample.tokens.count(processor.image_token_id) == 25
        assert sample.tokens == processor(text=sample.prompt, images=[image])["input_ids"][0]
        assert sample.prompt.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>how many")


def test_over_long_image_prompts_are_skipped_and_counted(vl_checkpoint, tmp_path):
    from slime.tools.square_images import write_task

    path = write_task(tmp_path, n=3, size=64)["jsonl"]  # 64 x 64: 64 image tokens, ~90 in all
    args = defaults_namespace(prompt_data=str(path), hf_checkpoint=vl_checkpoint, input_key="prompt",
                              label_key="label", apply_chat_template=True, multimodal_keys={"image": "images"},
                              rollout_max_prompt_len=80, rollout_max_context_len=None)
    with pytest.raises(ValueError, match="all 3 prompts of .* are longer than 80 tokens"):
        RolloutDataSource(args)


# ---------------------------------------------------------------- the processor is transformers' own computation
@pytest.mark.parametrize("kind", ["qwen2.5-vl", "qwen3-vl"])
def test_the_processor_equals_transformers_processor(kind, tmp_path, monkeypatch):
    """transformers' Qwen2.5-VL / Qwen3-VL processor classes need torchvision for their video processor, which the
    CPU machines lack: the check of that one argument is relaxed here, and everything else is theirs."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer, processing_utils

    from slime.tools.tiny_vl_checkpoint import TinyVLSpec, write_tiny_vl_checkpoint
    from slime.utils.vision_processor import load_vision_processor

    path = str(write_tiny_vl_checkpoint(tmp_path / kind, TinyVLSpec(kind=kind)))
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(processing_utils.ProcessorMixin, "check_argument_for_proper_class",
                        lambda self, name, arg: None if name == "video_processor" and arg is None
                        else check(self, name, arg))
    processor_class = {"qwen2.5-vl": transformers.Qwen2_5_VLProcessor, "qwen3-vl": transformers.Qwen3VLProcessor}[kind]
    tokenizer = AutoTokenizer.from_pretrained(path)
    theirs = processor_class(image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=tokenizer,
                             video_processor=None, chat_template=tokenizer.chat_template)
    images = [canonical_image(png(seed, size)) for seed, size in enumerate([(45, 30), (20, 70), (9, 9), (200, 90)])]
    text = tokenizer.apply_chat_template(image_messages("<image>a<image><image>b<image>how many?", 4, "w"),
                                         tokenize=False, add_generation_prompt=True)
    reference = theirs(text=[text], images=[open_image(uri) for uri in images], return_tensors="pt")
    ours = load_vision_processor(path)
    processed = ours.process(images)
    assert ours.prompt_ids(text, images) == reference["input_ids"][0].tolist()
    assert torch.equal(processed.pixel_values, reference["pixel_values"])
    assert torch.equal(processed.image_grid_thw, reference["image_grid_thw"])
    assert processed.image_grid_thw.tolist()[3] == [1, 10, 22]  # 200 x 90 resized to 88 x 40, within 64 x 64 pixels


# ---------------------------------------------------------------- the square-counting task
def test_the_square_task_is_deterministic_and_its_labels_count_the_red_squares(tmp_path):
    from PIL import Image

    from examples.square_count_reward import square_count_reward
    from slime.tools.square_images import TARGET, make_rows, write_task

    first, second = write_task(tmp_path / "a", n=10, seed=3), write_task(tmp_path / "b", n=10, seed=3)
    for kind in ("parquet", "jsonl"):
        assert first[kind].read_bytes() == second[kind].read_bytes()
    rows = [json.loads(line) for line in first["jsonl"].read_text().splitlines()]
    assert sorted({row["label"] for row in rows}) == ["0", "1", "2", "3", "4"]
    for row in make_rows(10, seed=3):
        pixels = torch.tensor(list(Image.open(io.BytesIO(row["images"][0])).convert("RGB").tobytes())).view(-1, 3)
        red = int((pixels == torch.tensor(TARGET)).all(dim=1).sum())
        assert red == 25 * int(row["label"])  # 5 x 5 squares, none overlapping
    assert square_count_reward("3 squares", "3") == 1.0 and square_count_reward("2", "3") == pytest.approx(2 / 3)
    assert square_count_reward("none", "3") == 0.0
