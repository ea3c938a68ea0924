"""--bf16: weights loaded after the optimizer was built survive its steps.

megatron's bf16 optimizer keeps fp32 main params, cloned from the model when it is built (before the HF
weights are loaded) and copied back into the model after every step. Unless they are refreshed from the
loaded weights, the first step replaces the HF weights by the random init (seen on one H200: the KL
to the reference reached ~5 nats within a few rollouts at lr 1e-5). One gloo rank, a tiny Qwen3.
"""
from __future__ import annotations


import pytest
import torch

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3
from slime.config import defaults_namespace

pytestmark = pytest.mark.ranks


def _load_then_step(rank: int, world: int, hf_dir: str) -> dict[str, float]:
    import transformers

    from slime.backends.megatron_utils.checkpoint import load_model_weights
    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.parallel import init_model_parallel

    args = defaults_namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                              sequence_parallel=False, seed=1234, lr=1e-3, bf16=True)
    init_model_parallel(args)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    model, optimizer, _ = build_model_and_optimizer(args, hf_config)
    init = {name: p.detach().clone() for name, p in model[0].named_parameters()}
    load_model_weights(hf_dir, model, optimizer, hf_config)
    loaded = {name: p.detach().clone() for name, p in model[0].named_parameters()}
    # A step with zero gradients: Adam moves nothing, so the model must keep the loaded weights.
    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    ok, _, _ = optimizer.step()
    after = dict(model[0].named_parameters())
    return {
        "bf16": all(p.dtype == torch.bfloat16 for p in after.values()),
        "ok": bool(ok),
        "load_changed": max(float((loaded[n].float() - init[n].float()).abs().max()) for n in init),
        "step_moved": max(float((after[n].detach().float() - loaded[n].float()).abs().max()) for n in init),
    }


@pytest.mark.timeout(120)
def test_bf16_step_keeps_the_loaded_weights(tmp_path):
    hf_dir = save_tiny_qwen3(str(tmp_path / "tiny"))
    (result,) = run_ranks(_load_then_step, 1, args=(hf_dir,), timeout_s=100)
    assert result["bf16"] and result["ok"]
    assert result["load_changed"] > 1e-2  # the HF weights differ from megatron's init
    assert result["step_moved"] == 0.0
