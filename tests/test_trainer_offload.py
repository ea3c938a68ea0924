"""Colocate sleep/wake of the trainer's memory on a real megatron model (one CPU rank).

Sleep must free the device storage of parameters, gradient buffers and optimizer state, serve the
parameters' values from the host copy while asleep, and wake must restore the state bit-exactly:
a step after a sleep/wake equals, bit for bit, the same step of a model that never slept.
"""
from __future__ import annotations

import copy

import pytest

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3
from train_step_harness import layout_args, make_rollout

pytestmark = pytest.mark.ranks


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("tiny_qwen3_offload")))


def _state_bytes(model, optimizer) -> dict[str, bytes]:
    """Every parameter and optimizer-state tensor, as raw bytes keyed by a stable name."""
    from slime.backends.megatron_utils.offload import torch_optimizers

    state = {f"param/{n}": p.detach().clone().numpy().tobytes() for chunk in model for n, p in chunk.named_parameters()}
    for i, inner in enumerate(torch_optimizers(optimizer)):
        for j, group in enumerate(inner.param_groups):
            for k, param in enumerate(group["params"]):
                state[f"main/{i}.{j}.{k}"] = param.detach().clone().numpy().tobytes()
                for key, value in inner.state.get(param, {}).items():
                    if hasattr(value, "numpy"):
                        state[f"opt/{i}.{j}.{k}.{key}"] = value.detach().clone().numpy().tobytes()
    return state


def _optimizer_state(optimizer) -> list:
    from slime.backends.megatron_utils.offload import torch_optimizers

    return [v for inner in torch_optimizers(optimizer) for state in inner.state.values()
            for v in state.values() if hasattr(v, "untyped_storage")]


def _offload_child(rank: int, world: int, hf_dir: str, sleep_between: bool, distributed_optimizer: bool) -> dict:
    from transformers import AutoConfig

    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.offload import TrainerMemory
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from train_step_harness import plans_for_this_rank
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime_plugins.models.hf_weights import load_hf_weights

    args = layout_args({}, lr=1e-3, use_distributed_optimizer=distributed_optimizer, use_tis=False, use_kl_loss=False)
    init_model_parallel(args)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    model, optimizer, scheduler = build_model_and_optimizer(args, hf_config)
    load_hf_weights(model, hf_dir, hf_config)
    data = make_rollout(num_samples=6, seed=0)
    (plan,) = plans_for_this_rank(data, args)
    data["log_probs"] = compute_log_probs(model, data, plan, args)
    memory = TrainerMemory(model, optimizer)  # built before the optimizer has state, as the actor builds it
    first = train_one_step(model, optimizer, scheduler, copy.deepcopy(data), plan, args)
    out: dict = {"first": (first.loss, first.grad_norm)}
    if sleep_between:
        before = _state_bytes(model, optimizer)
        params = [p for chunk in model for p in chunk.parameters()]
        report = memory.sleep()
        out["freed"] = all(t.untyped_storage().nbytes() == 0 for t in params + _optimizer_state(optimizer))
        out["read_while_asleep"] = all(
            memory.read_param(p).numpy().tobytes() == before[f"param/{n}"]
            for chunk in model for n, p in chunk.named_parameters())
        out["kept_bytes"], out["discarded_bytes"] = report.kept_bytes, report.discarded_bytes
        memory.wake()
        out["restored"] = _state_bytes(model, optimizer) == before
        out["state_entries"] = len(before)
    second = train_one_step(model, optimizer, scheduler, copy.deepcopy(data), plan, args)
    out["second"] = (second.loss, second.grad_norm)
    out["after"] = _state_bytes(model, optimizer)
    return out


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["optimizer", "distributed_optimizer"])
def test_sleep_frees_state_and_wake_restores_it_bit_exactly(tiny_hf_dir, distributed_optimizer):
    (slept,) = run_ranks(_offload_child, 1, args=(tiny_hf_dir, True, distributed_optimizer), timeout_s=180)
    (never,) = run_ranks(_offload_child, 1, args=(tiny_hf_dir, False, distributed_optimizer), timeout_s=180)
    assert slept["freed"], "a parameter storage still holds memory while asleep"
    assert slept["read_while_asleep"], "read_param did not serve the parameters' values from the host copy"
    assert slept["kept_bytes"] > 0 and slept["discarded_bytes"] > 0  # params + Adam state kept, grads dropped
    assert any(k.startswith("opt/") for k in slept["after"]), "the optimizer had no state to keep"
    assert slept["restored"], "wake did not restore parameters and optimizer state bit-exactly"
    assert slept["first"] == never["first"]
    assert slept["second"] == never["second"], "the step after sleep/wake differs from the step without it"
    assert slept["after"] == never["after"]


def test_read_param_refuses_a_tensor_that_was_not_offloaded(tiny_hf_dir):
    import torch

    from slime.backends.megatron_utils.offload import TrainerMemory

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters())
    memory = TrainerMemory([model], optimizer)
    memory.sleep()
    with pytest.raises(KeyError, match="not offloaded"):
        memory.read_param(torch.zeros(3))
    memory.wake()
    memory.sleep()
    with pytest.raises(RuntimeError, match="already asleep"):
        memory.sleep()
