"""gpt-oss against transformers' GptOssForCausalLM: attention sinks, alternating sliding (window 4) and full layers,
YaRN RoPE, experts with biases and the clamped gate (swiglu_limit 2, swiglu_alpha 1.5), the router with a bias.

- MXFP4: the dequantisation is transformers' own, and the format's definition on hand-made bytes;
- the megatron model's logits equal transformers' (fp32, 1e-5) and the export gives back the checkpoint bit for bit
  (the stacked experts' layout of a bf16 checkpoint; logits at TP2 x CP2 and from the MXFP4 checkpoint at CP2 were
  measured too, ~3e-7; the layout run below covers both);
- two training steps at TP2 x SP x CP2 x EP2 from the MXFP4 checkpoint equal the single process's, each pushed by
  the fenced weight sync to a running embedded engine (transformers' class), which gives the trainer's log-probs
  before the first push and after each; every rank's export is transformers' dequantised model under the bf16
  names; the recorded collectives of steps and pushes pass the order proof;
- what gpt-oss cannot run under is refused before Ray starts, naming the fix; save-hf writes a loadable bf16 config.
"""
from __future__ import annotations

import json

import pytest
import torch

from family_push import SEQ, TP2_SP_CP2_EP2  # SEQ: the tokens forward_and_export feeds
from mp_utils import run_ranks
from slime.config import defaults_namespace

pytestmark = pytest.mark.ranks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tiny_models import save_tiny_gpt_oss

    root = tmp_path_factory.mktemp("gpt_oss")
    return {"bf16": save_tiny_gpt_oss(str(root / "bf16")), "mxfp4": save_tiny_gpt_oss(str(root / "mxfp4"), seed=1,
                                                                                       mxfp4=True)}


def test_mxfp4_dequantisation_is_the_format_and_transformers_own():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from slime.models.mxfp4 import dequantize, dequantized_weight

    # one block: bytes 0x21 (codes 1, 2: 0.5, 1.0), 0xF7 (7, 15: 6.0, -6.0), then zeros; scale 2^(125 - 127)
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0], blocks[0, 1] = 0x21, 0xF7
    values = dequantize(blocks, torch.tensor([125], dtype=torch.uint8), torch.float32)
    assert values[:4].tolist() == [0.125, 0.25, 1.5, -1.5] and values[4:].abs().sum() == 0
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8, generator=generator)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequantized_weight(blocks, scales, torch.float32), want)
    assert torch.equal(dequantized_weight(blocks, scales), convert_moe_packed_tensors(blocks, scales))  # bf16


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind, tp, cp", [("bf16", 1, 1)])  # MXFP4 at TP2 x SP x CP2 x EP2: the steps' test
def test_logits_match_transformers_and_export_is_exact(checkpoints, kind, tp, cp):
    import transformers
    from safetensors.torch import load_file

    from family_push import check_logits_and_export, forward_and_export

    hf_dir = checkpoints[kind]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "GptOssForCausalLM"
    tokens = torch.randint(0, hf.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = hf(tokens).logits[0]
    # the MXFP4 checkpoint is exported as transformers holds it once dequantised: the bf16 checkpoint's names
    original = load_file(f"{hf_dir}/model.safetensors") if kind == "bf16" else hf.state_dict()
    if kind == "mxfp4":
        assert any(name.endswith("gate_up_proj_blocks") for name in load_file(f"{hf_dir}/model.safetensors"))
    for result in run_ranks(forward_and_export, tp * cp, args=(hf_dir, tp, cp, dict(expert_tensor_parallel_size=1)),
                            timeout_s=220):
        check_logits_and_export(result, reference, original)


def test_the_sinks_and_the_window_change_the_attention():
    """The sink attention is the softmax with one more column per head, windowed: checked on a hand computation
    (so neither a dropped sink nor a dropped window could pass the transformers comparison by chance)."""
    from slime.models.attention_sinks import sink_chunk_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4), torch.randn(5, 1, 4), torch.randn(5, 1, 4)  # queries at positions 2-4
    sinks = torch.tensor([0.7, -1.3])
    out = sink_chunk_attention(q, k, v, sinks, 2, 2, scale=0.5, dropout_p=0.0)
    for t in range(3):
        for h in range(2):
            keys = [j for j in range(5) if 0 <= t + 2 - j < 2]  # itself and the one before
            logits = torch.stack([0.5 * q[t, h] @ k[j, 0] for j in keys])
            weights = logits.exp() / (logits.exp().sum() + sinks[h].exp())
            want = sum(w * v[j, 0] for w, j in zip(weights, keys))
            assert torch.allclose(out[t, h], want, atol=1e-6)


# ------------------------------------------------------------------ training steps and pushes


MOE_TRAINING = dict(expert_tensor_parallel_size=1, calculate_per_token_loss=True, lr=1e-3)
LAYOUT = dict(MOE_TRAINING, **TP2_SP_CP2_EP2)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny MXFP4 gpt-oss with the project's tiny tokenizer, a rollout, and an embedded engine serving it."""
    from family_push import serve_tiny
    from tiny_models import save_tiny_gpt_oss

    save = lambda path, **ids: save_tiny_gpt_oss(path, seed=2, mxfp4=True, **ids)  # noqa: E731
    with serve_tiny(tmp_path_factory.mktemp("gpt_oss_served"), save) as served:
        yield served


@pytest.mark.timeout(400)
def test_steps_at_tp2_sp_cp2_ep2_equal_the_single_process_and_every_push_reaches_the_engine(served, tmp_path):
    import transformers

    from family_push import check_layout_run

    want = transformers.AutoModelForCausalLM.from_pretrained(served[0], dtype=torch.float32).state_dict()
    # every rank exports every expert (EP all-gather), stacked as transformers holds them
    check_layout_run(tmp_path, served, MOE_TRAINING, LAYOUT, want)


# ------------------------------------------------------------------ before Ray


def test_what_gpt_oss_cannot_run_under_is_refused_before_ray(checkpoints, tmp_path):
    import re

    from slime.config.errors import ArgumentValidationError
    from slime.config.launch import check_hf_config

    flags = lambda **given: defaults_namespace(**{"expert_tensor_parallel_size": 1, **given})  # noqa: E731
    config = f"{checkpoints['bf16']}/config.json"
    check_hf_config(flags(), config)
    for given, says in [(dict(add_bias_linear=False), "--disable-bias-linear: gpt-oss's attention, router and experts"),
                        (dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=2),
                         "pass --expert-tensor-parallel-size 1"),
                        (dict(rotary_scaling_factor=32.0), "yarn rope factor = 4.0")]:
        with pytest.raises(ArgumentValidationError, match=re.escape(says)):
            check_hf_config(flags(**given), config)
    mxfp4 = f"{checkpoints['mxfp4']}/config.json"
    check_hf_config(flags(rollout_backend="embedded"), mxfp4)
    with pytest.raises(ArgumentValidationError, match="python -m slime.tools.dequantize_mxfp4 SRC DST"):
        check_hf_config(flags(rollout_backend="sglang"), mxfp4)
    fp8 = dict(json.loads(open(config).read()), quantization_config={"quant_method": "fp8"})
    (tmp_path / "config.json").write_text(json.dumps(fp8))
    with pytest.raises(ArgumentValidationError, match=r"quantized weights \(fp8\)"):
        check_hf_config(flags(), str(tmp_path / "config.json"))


def test_the_bf16_checkpoint_of_an_mxfp4_one_is_transformers_dequantised_model(checkpoints, tmp_path):
    """python -m slime.tools.dequantize_mxfp4 (for SGLang), and save-hf's config of an MXFP4 source."""
    import transformers

    from slime.models.mxfp4 import dequantised_config
    from slime.tools.dequantize_mxfp4 import main

    main([checkpoints["mxfp4"], str(tmp_path / "bf16")])
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config
    source = json.loads(open(f"{checkpoints['mxfp4']}/config.json").read())
    assert dequantised_config(source) == config and "quantization_config" in source
    load = lambda path: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()  # noqa: E731
    want, got = load(checkpoints["mxfp4"]), load(str(tmp_path / "bf16"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.timeout(200)
def test_lora_on_every_linear_layer_trains_merges_and_pushes(served):
    """LoRA on q/k/v, o (with their biases) and the experts' fc1 / fc2, from the MXFP4 checkpoint: the stacked
    experts export merged, the push after the first plans the adapted layers (the stacked experts among them) and
    sends them."""
    from family_push import check_lora_run

    result = check_lora_run(served, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in result["sent"])


def test_a_config_without_the_gate_fields_gets_the_released_experts_gate():
    """transformers releases before the `swiglu_alpha` / `swiglu_limit` fields fixed the gate in their experts: such
    a config must build the values transformers' own defaults now name, not fail or take others."""
    from types import SimpleNamespace

    from transformers import GptOssConfig

    from slime.models.gpt_oss import gpt_oss_config_fields

    released = GptOssConfig()
    older = gpt_oss_config_fields(SimpleNamespace())  # what such a release's GptOssConfig carries of the two
    assert older["activation_func"].alpha == released.swiglu_alpha
    assert older["activation_func_clamp_value"] == released.swiglu_limit
    given = gpt_oss_config_fields(SimpleNamespace(swiglu_limit=2.0, swiglu_alpha=1.5))
    assert (given["activation_func"].alpha, given["activation_func_clamp_value"]) == (1.5, 2.0)
