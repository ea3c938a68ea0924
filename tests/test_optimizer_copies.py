"""slime/patches/megatron_core.py `apply_batched_optimizer_copies`: megatron's distributed optimizer with its grad and
param copies batched computes the same step as with megatron's per-parameter loops.

Two gloo ranks (each optimizer holds a shard of every bucket, so the shard ranges are not whole parameters), a
tiny Qwen3 in bf16 (fp32 main params: the grads are cast, the params cast back). The same gradients go into DDP's
buffers before each step; the weights, the main grads the optimizer saw and the Adam state must be equal bit for
bit. The grad buffer's storage is then freed and re-allocated in place, as the colocated sleep does, and a second
step must again match: the views made once follow their storages.
"""
from __future__ import annotations

import pytest
import torch

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3

pytestmark = pytest.mark.ranks


def _fill_grads(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model[0].parameters():
        p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=gen) * 1e-2)


def _steps(model, optimizer, start: list[torch.Tensor], batched: bool) -> dict:
    from slime.patches import megatron_core
    from slime.backends.megatron_utils.offload import torch_optimizers

    megatron_core.apply_batched_optimizer_copies(enabled=batched)
    params = list(model[0].parameters())
    with torch.no_grad():
        for p, p0 in zip(params, start):
            p.copy_(p0)
    optimizer.reload_model_params()  # the fp32 main params from the restored weights
    for inner in torch_optimizers(optimizer):
        inner.state.clear()
    out = {"in_use": megatron_core.batched_optimizer_copies_in_use()}
    for step in range(2):
        if step == 1:  # the colocated sleep: grad storages freed, then re-allocated in place
            for buffer in model[0].buffers:
                storage = buffer.grad_data.untyped_storage()
                size = storage.nbytes()
                storage.resize_(0)
                storage.resize_(size)
        _fill_grads(model, seed=step)
        optimizer.step()
        out[f"main_grads_{step}"] = [p.grad.clone() for g in optimizer.optimizer.param_groups for p in g["params"]]
        out[f"weights_{step}"] = [p.detach().clone() for p in params]
        out[f"state_{step}"] = [s["exp_avg_sq"].clone() for inner in torch_optimizers(optimizer)
                                for s in inner.state.values()]
    return out


def _compare_copies(rank: int, world: int, hf_dir: str) -> dict:
    import transformers

    from slime.backends.megatron_utils.checkpoint import load_model_weights
    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.config import defaults_namespace

    args = defaults_namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                              sequence_parallel=False, seed=1234, lr=1e-2, bf16=True, use_distributed_optimizer=True,
                              clip_grad=0.0)
    init_model_parallel(args)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    model, optimizer, _ = build_model_and_optimizer(args, hf_config)
    load_model_weights(hf_dir, model, optimizer, hf_config)
    start = [p.detach().clone() for p in model[0].parameters()]
    upstream, batched = _steps(model, optimizer, start, False), _steps(model, optimizer, start, True)

    def same(key):
        return len(upstream[key]) > 0 and all(torch.equal(a, b) for a, b in zip(upstream[key], batched[key]))

    keys = [f"{kind}_{step}" for kind in ("main_grads", "weights", "state") for step in (0, 1)]
    moved = max(float((w.float() - p0.float()).abs().max()) for w, p0 in zip(batched["weights_1"], start))
    return {"same": {k: same(k) for k in keys}, "moved": moved,
            "in_use": (upstream["in_use"], batched["in_use"]),
            "bf16": all(p.dtype == torch.bfloat16 for p in model[0].parameters()),
            "main_fp32": all(p.grad.dtype == torch.float32 for g in optimizer.optimizer.param_groups
                             for p in g["params"]),
            "shards": sum(p.numel() for g in optimizer.optimizer.param_groups for p in g["params"]),
            "total": sum(p.numel() for p in model[0].parameters())}


@pytest.mark.timeout(150)
def test_batched_copies_give_the_same_bf16_step(tmp_path):
    hf_dir = save_tiny_qwen3(str(tmp_path / "tiny"))
    results = run_ranks(_compare_copies, 2, args=(hf_dir,), timeout_s=130)
    for r in results:
        assert r["in_use"] == (False, True), r
        assert r["bf16"] and r["main_fp32"], r
        assert r["shards"] < r["total"], r  # each rank's optimizer holds part of the parameters
        assert r["moved"] > 1e-3, r  # the steps changed the weights
        assert all(r["same"].values()), r["same"]
