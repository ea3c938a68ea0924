"""--optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer (its state precision-aware, inside the distributed
optimizer) trains like the device optimizer and resumes exactly.

Two gloo ranks (DP 2: each optimizer holds a shard of every bucket), a tiny Qwen3 in bf16 with fp32 gradients
(upstream's launchers pass --accumulate-allreduce-grads-in-fp32), clipping and weight decay active. The offloaded run
puts half the parameters' state on host copies (--optimizer-offload-fraction 0.5: on CPU the patch in
patches/megatron_core.py gives the CPU's parameters the host copies CUDA ones get), one host optimizer per parameter
(--overlap-cpu-optimizer-d2h-h2d), the other half on the device optimizer. Each run loads the HF weights, takes
two fenced steps and saves before the second; a fresh model and optimizer then load that checkpoint and take the
second step again.
"""
from __future__ import annotations

import pytest
import torch

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3

pytestmark = pytest.mark.ranks

OFFLOAD = dict(optimizer_cpu_offload=True, use_precision_aware_optimizer=True, optimizer_offload_fraction=0.5,
               overlap_cpu_optimizer_d2h_h2d=True)


def _args(**overrides):
    from train_step_harness import layout_args

    return layout_args({}, lr=1e-2, bf16=True, use_distributed_optimizer=True, accumulate_allreduce_grads_in_fp32=True,
                       weight_decay=0.01, clip_grad=1.0, use_kl_loss=False, use_tis=False, **overrides)


def _build(args, hf_dir, hf_config):
    from slime.backends.megatron_utils.adam_kernel import use_fused_adam
    from slime.backends.megatron_utils.checkpoint import load_model_weights
    from slime.backends.megatron_utils.model import build_model_and_optimizer

    model, optimizer, scheduler = build_model_and_optimizer(args, hf_config)
    # the hybrid optimizer's AdamW runs torch's fused kernel (megatron builds it so); the device one takes the same
    # kernel here, so that the runs differ by where the state lives alone (torch's default CPU kernel rounds the
    # update differently: an fp32 ulp, now and then a bf16 one in the weights)
    use_fused_adam(optimizer, True)
    load_model_weights(hf_dir, model, optimizer, hf_config)  # the fp32 master weights follow the loaded ones
    return model, optimizer, scheduler


def _state(model, optimizer) -> dict:
    """Weights and every optimizer state tensor (master weights, moments, step), in a fixed order."""
    from slime.backends.megatron_utils.offload import torch_optimizers

    weights = [p.detach().clone() for p in model[0].parameters()]
    state = [(key, value.detach().clone()) for inner in torch_optimizers(optimizer) for group in inner.param_groups
             for p in group["params"] for key, value in sorted(inner.state[p].items()) if torch.is_tensor(value)]
    return {"weights": weights, "state": state}


def _hybrid(optimizer) -> dict:
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from slime.backends.megatron_utils.offload import torch_optimizers

    inners = list(torch_optimizers(optimizer))
    hybrid = [o for o in inners if isinstance(o, HybridDeviceOptimizer)]
    return {"hybrid": len(hybrid) == len(inners) > 0,
            "host_optimizers": sum(len(o.cpu_optimizers) for o in hybrid),
            "device_optimizer": all(o.gpu_optimizer is not None for o in hybrid),
            "host_copies": sum(len(o.gpu_params_map_cpu_copy) for o in hybrid)}


def _step(model, optimizer, scheduler, data, plan, args) -> tuple[float, float, bool]:
    from slime.backends.megatron_utils.train_step import train_one_step

    result = train_one_step(model, optimizer, scheduler, data, plan, args)
    return result.loss, result.grad_norm, result.skipped


def _train_save_resume(rank: int, world: int, hf_dir: str, ckpt: str) -> dict:
    import transformers

    from slime.backends.megatron_utils.checkpoint import load_checkpoint, save_checkpoint
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.distributed.instrument import instrument_collectives, uninstrument_collectives
    from slime.distributed.ledger import Ledger
    from train_step_harness import make_rollout, with_policy_log_probs

    init_model_parallel(_args())
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    ledger = Ledger(rank, world, None, keep_recent=10_000)
    instrument_collectives(ledger)
    out = {}
    try:
        for name, extra in (("device", {}), ("offload", OFFLOAD)):
            args = _args(**extra)
            model, optimizer, scheduler = _build(args, hf_dir, hf_config)
            data, plan, _ = with_policy_log_probs(model, make_rollout(4), args)
            steps, mark = [], ledger.mark()
            for i in range(2):
                if i == 1:
                    save_checkpoint(f"{ckpt}/{name}", 1, model, optimizer, scheduler)
                steps.append(_step(model, optimizer, scheduler, data, plan, args))
                if i == 0:
                    first_step_ops = [sig[1:] for sig in ledger.signature(since=mark)]
            run = {"steps": steps, "ops": first_step_ops, **_state(model, optimizer), **_hybrid(optimizer)}
            model, optimizer, scheduler = _build(args, hf_dir, hf_config)  # a new process's fresh optimizer
            load_checkpoint(f"{ckpt}/{name}", model, optimizer, scheduler)
            run["resumed_step"] = _step(model, optimizer, scheduler, data, plan, args)
            run["resumed"] = _state(model, optimizer)
            out[name] = run
    finally:
        uninstrument_collectives()
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.timeout(200)
def test_offloaded_optimizer_trains_as_the_device_one_and_resumes_exactly(tmp_path):
    hf_dir = save_tiny_qwen3(str(tmp_path / "tiny"))
    for rank, r in enumerate(run_ranks(_train_save_resume, 2, args=(hf_dir, str(tmp_path / "ckpt")), timeout_s=180)):
        device, offload = r["device"], r["offload"]
        assert not device["hybrid"] and offload["hybrid"], (rank, device, offload)
        # half the parameters on host copies, one host optimizer each; the rest on the device optimizer
        assert offload["host_optimizers"] == offload["host_copies"] > 0 and offload["device_optimizer"]
        assert all(not skipped for *_, skipped in offload["steps"])
        # the loaded weights are what the first step starts from, and every step is the device optimizer's, bit for bit
        assert offload["steps"] == device["steps"]
        assert _same(offload["weights"], device["weights"])
        assert max(float((w.float() - v.float()).abs().max())
                   for w, v in zip(offload["weights"], offload["resumed"]["weights"])) == 0.0
        # no collective of its own: a step issues the device optimizer's ops, on the same groups, in the same order
        assert offload["ops"] == device["ops"] and len(offload["ops"]) > 3
        for run in (device, offload):  # a fresh optimizer loaded from the checkpoint takes the same third step
            assert run["resumed_step"] == run["steps"][1]
            assert _same(run["resumed"]["weights"], run["weights"])
            assert [k for k, _ in run["resumed"]["state"]] == [k for k, _ in run["state"]]
            assert _same([v for _, v in run["resumed"]["state"]], [v for _, v in run["state"]])
        keys = {k for k, _ in offload["state"]}
        assert {"master_param", "exp_avg", "exp_avg_sq", "step"} <= keys, keys


# ---------------------------------------------------------------- the flags (parse_args, before Ray)
MINIMAL = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
           "--train-backend-device", "cpu"]


def _warned(argv: list[str]) -> tuple[object, list[str]]:
    import warnings

    from slime.config.errors import NotImplementedFlagWarning
    from slime.utils.arguments import parse_args

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = parse_args(MINIMAL + argv)
    return args, [str(w.message) for w in caught if issubclass(w.category, NotImplementedFlagWarning)]


def test_upstreams_offload_flags_are_taken_with_the_distributed_optimizer():
    args, warned = _warned(["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--bf16",
                            "--overlap-cpu-optimizer-d2h-h2d", "--optimizer-offload-fraction", "0.25"])
    assert warned == [] and args.not_implemented_flags == ()
    assert args.use_distributed_optimizer and args.derived_values["use_distributed_optimizer"] == "--optimizer-cpu-offload"
    assert args.optimizer_offload_fraction == 0.25


def test_offload_without_a_precision_trains_in_bf16_as_upstream_does():
    import warnings

    from slime.utils.arguments import parse_args

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = parse_args(MINIMAL + ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"])
    assert args.bf16 and args.derived_values["bf16"] == "--optimizer-cpu-offload"
    assert any("--optimizer-cpu-offload: training in bf16" in str(w.message) for w in caught)


def test_offload_flags_without_offload_warn_with_their_reason():
    args, warned = _warned(["--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d",
                            "--optimizer-offload-fraction", "0.5"])
    assert args.not_implemented_flags == ("--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d",
                                          "--optimizer-offload-fraction")
    assert "TransformerEngine's FusedAdam" in warned[0] and "the same update" in warned[0]
    assert all("only meaningful with --optimizer-cpu-offload" in w for w in warned[1:])
    assert not args.use_distributed_optimizer


def test_offload_without_precision_aware_state_is_refused_naming_the_fix(capsys):
    from arg_testing import parse_error

    err = parse_error(MINIMAL + ["--optimizer-cpu-offload", "--bf16"], capsys)
    assert "--optimizer-cpu-offload is not supported here" in err and "add --use-precision-aware-optimizer" in err
    err = parse_error(MINIMAL + ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--bf16",
                                 "--optimizer-offload-fraction", "1.5"], capsys)
    assert "--optimizer-offload-fraction must be within [0, 1], got 1.5" in err
