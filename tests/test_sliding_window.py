"""Sliding-window attention (Qwen3's `use_sliding_window`, `max_window_layers` -> `layer_types`) against transformers'
own Qwen3ForCausalLM: a tiny checkpoint whose second layer slides over 4 keys, sequences far longer than that.

- the megatron model's logits (fp32, CPU) equal transformers' within 1e-5, one sequence unpacked, at CP1 and at
  CP2 (zig-zag chunks on forked ranks);
- the log-probs of a packed micro-batch of several sequences (THD) equal transformers' at CP2 too;
- the window matters: transformers' logits without it differ, so a model built with full attention fails here.
"""
from __future__ import annotations

import copy

import pytest
import torch

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3
from train_step_harness import make_rollout

pytestmark = pytest.mark.ranks

SEQ, WINDOW = 16, 4
WINDOWED = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)  # layer 0 full, layer 1 slides


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("swa") / "qwen3"), seed=3, **WINDOWED)


def _child(rank, world, hf_dir, data):
    import transformers
    from megatron.core import parallel_state

    from slime.backends.megatron_utils.train_step import compute_log_probs
    from slime_plugins.models.cp_attention import zigzag_positions
    from train_step_harness import build_loaded_model, layout_args, plans_for_this_rank

    args = layout_args(dict(context_parallel_size=world), max_tokens_per_gpu=64)
    model, _, _ = build_loaded_model(args, hf_dir)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    tokens = torch.randint(0, hf_config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ)
    if world > 1:
        positions = zigzag_positions(SEQ, world, parallel_state.get_context_parallel_rank())
    chunk = model[0].eval()
    with torch.no_grad():
        logits = chunk(tokens[:, positions], positions.unsqueeze(0), None)[0]
    (plan,) = plans_for_this_rank(copy.deepcopy(data), args)
    windows = [layer.self_attention.core_attention.window for layer in chunk.module.decoder.layers]
    return dict(logits=logits, positions=positions, windows=windows,
                log_probs=compute_log_probs(model, copy.deepcopy(data), plan, args))


def _hf_model(hf_dir, full=False):
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    if full:
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, config=config, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    return model


def _hf_log_probs(model, data):
    out = []
    for tokens, response in zip(data["tokens"], data["response_lengths"]):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
        out.append(logits[:-1].gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)[-response:].tolist())
    return out


@pytest.mark.timeout(240)
def test_sliding_layers_match_transformers_at_cp1_and_cp2_packed_and_unpacked(hf_dir):
    data = make_rollout(num_samples=4, seed=2, max_len=30)
    assert min(len(t) for t in data["tokens"]) > WINDOW
    hf = _hf_model(hf_dir)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    tokens = torch.randint(0, hf.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = hf(tokens).logits[0]
        full = _hf_model(hf_dir, full=True)(tokens).logits[0]
    assert (reference - full).abs().max().item() > 1e-3  # the window changes the model
    want = _hf_log_probs(hf, data)
    for cp in (1, 2):
        for result in run_ranks(_child, cp, args=(hf_dir, data), timeout_s=200):
            assert result["windows"] == [None, WINDOW]
            assert (result["logits"] - reference[result["positions"]]).abs().max().item() < 1e-5
            for got, expected in zip(result["log_probs"], want):
                assert got == pytest.approx(expected, abs=1e-5)
