"""benchmarks/bench_step_gpu.py on CPU: every path the GPU call takes, at tiny shapes.

The FLOP formula against the real architecture's weights, the cycle schedule, the report lines;
`attention` end to end (and that a wrong kernel is reported); `step` under torchrun on gloo
(CP2, recompute, sync audit, profiled cycle, old and new paths equal at lr 0) and its OOM report.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from slime.utils.ports import find_free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_step_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_step_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_matmul_params_are_the_architectures_matmul_weights(bench):
    """The FLOP formula's weights equal the 2-D projection/MLP weights of the HF Qwen3 model plus the LM head."""
    from transformers import Qwen3ForCausalLM

    from slime.tools.tiny_checkpoint import TinyQwen3Spec, build_config

    shape = bench.MODELS["qwen3-0.6b"]
    config = build_config(TinyQwen3Spec(layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
                                        kv_heads=shape.kv_heads, head_dim=shape.head_dim, ffn_hidden=shape.ffn_hidden,
                                        tie_word_embeddings=True))
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    layer_weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n)
    assert shape.matmul_params() == layer_weights + shape.hidden * shape.vocab
    assert 590e6 < shape.matmul_params() < 600e6  # Qwen3-0.6B: 0.44B in the layers + the 0.16B LM head


def test_moe_matmul_params_are_the_active_weights(bench):
    """MoE: attention, the router and top-k of the experts per token (Qwen3-30B-A3B: ~3.3B active of 30.5B)."""
    from transformers import AutoModelForCausalLM

    from slime.tools.tiny_checkpoint import TinyQwen3Spec, build_config

    shape = bench.MODELS["qwen3-30b-a3b-8l"]
    config = build_config(TinyQwen3Spec(layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
                                        kv_heads=shape.kv_heads, head_dim=shape.head_dim, num_experts=shape.num_experts,
                                        moe_topk=shape.topk, moe_ffn_hidden=shape.moe_ffn_hidden))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = [p for n, p in model.named_parameters() if ".layers." in n and p.dim() >= 2]
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    total = sum(p.numel() for p in layers)
    active = total - experts + experts * shape.topk // shape.num_experts
    assert shape.matmul_params() == active + shape.hidden * shape.vocab
    import dataclasses

    assert 3.0e9 < dataclasses.replace(shape, layers=48).matmul_params() < 3.6e9  # the whole model: "A3B"


def test_latent_moe_matmul_params_are_the_active_weights(bench):
    """GLM-4.7-Flash's shape: MLA projections, the first MLP dense, then the router, top-k routed experts and the
    shared expert per token (the whole 47-layer model: ~3.3B active in the layers + the 0.3B LM head)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    for name in ("glm-4.7-flash-8l", "tiny-glm-moe-lite"):
        shape = bench.MODELS[name]
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(bench.latent_moe_config(shape))
        weights = {n: p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() >= 2}
        experts = sum(v for n, v in weights.items() if ".mlp.experts." in n)
        active = sum(weights.values()) - experts + experts * shape.topk // shape.num_experts
        assert shape.matmul_params() == active + shape.hidden * shape.vocab, name
    assert 3.0e9 < dataclasses.replace(bench.MODELS["glm-4.7-flash-8l"], layers=47).matmul_params() < 3.7e9


def test_hybrid_moe_matmul_params_are_the_active_weights(bench):
    """Qwen3.5-MoE's shape (transformers' own model): DeltaNet and gated-attention projections, the router, top-k
    experts, the shared expert and its gate; the DeltaNet's depthwise convolution is no matmul (the whole 40-layer
    model: ~2.9B active, "A3B")."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    for name in ("qwen3.5-35b-a3b-4l", "tiny-hybrid-moe"):
        shape = bench.MODELS[name]
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(bench.hybrid_config(shape))
        weights = {n: p.numel() for n, p in model.named_parameters()
                   if ".layers." in n and p.dim() >= 2 and "conv1d" not in n}
        experts = sum(v for n, v in weights.items() if ".mlp.experts." in n)
        active = sum(weights.values()) - experts + experts * shape.topk // shape.num_experts
        assert shape.matmul_params() == active + shape.hidden * shape.vocab, name
    assert 2.5e9 < dataclasses.replace(bench.MODELS["qwen3.5-35b-a3b-4l"], layers=40).matmul_params() < 3.5e9


def test_compressed_matmul_params_are_the_active_weights(bench):
    """DeepSeek-V4's shape (transformers' own model): the attention projections, each kind's compressor and indexer
    projections, the hyper-connection mixers and final collapse, the router, top-k experts and the shared expert (the
    compressors' position biases are no matmul); its attention FLOPs count each query's window and compressed keys."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    for name in ("deepseek-v4-flash-4l", "tiny-deepseek-v4"):
        shape = bench.MODELS[name]
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(bench.compressed_config(shape))
        weights = {n: p.numel() for n, p in model.named_parameters()
                   if (".layers." in n or ".hc_head." in n) and p.dim() >= 2 and "position_bias" not in n}
        experts = sum(v for n, v in weights.items() if ".mlp.experts." in n)
        active = sum(weights.values()) - experts + experts * shape.topk // shape.num_experts
        assert shape.matmul_params() == active + shape.hidden * shape.vocab, name
    tiny = bench.MODELS["tiny-deepseek-v4"]  # window 6, a CSA key per 2 tokens (top-3), an HCA key per 4
    window = sum(min(6, t + 1) for t in range(10))
    csa, hca = sum(min(3, (t + 1) // 2) for t in range(10)), sum((t + 1) // 4 for t in range(10))
    indexer = 2 * 4 * 16 * sum((t + 1) // 2 for t in range(10))
    assert tiny._compressed_attention_flops(10) == 4 * 4 * 32 * (3 * window + csa + hca) + indexer
    assert 10e9 < dataclasses.replace(bench.MODELS["deepseek-v4-flash-4l"], layers=43, attention_kinds=("csa",) * 43,
                                      num_experts=256).matmul_params() < 16e9  # V4-Flash: "13B activated"


def test_sink_moe_matmul_params_and_sliding_flops(bench):
    """gpt-oss's shape (transformers' own model): attention, the router and top-k of the fused experts (biases and
    sinks are no matmul; gpt-oss-20b: "3.6B active"); a sliding layer's query sees only its window."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    for name in ("gpt-oss-20b-4l", "tiny-gpt-oss"):
        shape = bench.MODELS[name]
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(bench.sink_moe_config(shape))
        weights = {n: p.numel() for n, p in model.named_parameters()
                   if ".layers." in n and p.dim() >= 2 and not n.endswith("_bias")}
        experts = sum(v for n, v in weights.items() if ".mlp.experts." in n)
        active = sum(weights.values()) - experts + experts * shape.topk // shape.num_experts
        assert shape.matmul_params() == active + shape.hidden * shape.vocab, name
        assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert 3.0e9 < dataclasses.replace(bench.MODELS["gpt-oss-20b-4l"], layers=24).matmul_params() < 4.2e9
    tiny = bench.MODELS["tiny-gpt-oss"]  # layer 0 sliding (window 4), layer 1 full
    attention = 2 * 4 * 16 * 10 ** 2 + 4 * 4 * 16 * sum(min(4, t + 1) for t in range(10))
    assert tiny.forward_flops([10]) == 2 * tiny.matmul_params() * 10 + attention


def test_forward_flops_count_causal_attention_per_sequence(bench):
    shape = bench.ModelShape(layers=2, hidden=8, heads=4, kv_heads=2, head_dim=4, ffn_hidden=16, vocab=32)
    matmul = 2 * (8 * (4 + 4) * 4 + 4 * 4 * 8 + 3 * 8 * 16) + 8 * 32
    assert shape.matmul_params() == matmul
    attention = 2 * 2 * 4 * 4 * (10 ** 2 + 6 ** 2)  # 2 * layers * hq * d * L^2 per sequence
    assert shape.forward_flops([10, 6]) == 2 * matmul * 16 + attention
    assert bench.attention_flops(8, 4, 4, cp_size=2) == 3.5 * 2 * 64 * 4 * 4 / 2


def test_cycle_schedule_warms_each_path_then_rotates(bench):
    assert bench.cycle_schedule(("new", "old"), 2) == [
        ("warmup", "new"), ("warmup", "old"), ("timed", "new"), ("timed", "old"), ("timed", "old"), ("timed", "new")]


def test_step_flags_parse_as_on_a_gpu_machine(bench, tmp_path, monkeypatch):
    """What parse_args decides from CUDA being present (bf16, the engine kind) must not refuse the run."""
    from slime.utils.arguments import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for model in ("tiny", "tiny-gpt-oss"):
        ckpt = bench.write_config_checkpoint(str(tmp_path / model), bench.MODELS[model])
        opts, rest = bench.parse_step(["--model", model, "--max-tokens-per-gpu", "256"])
        args = parse_args(bench.step_argv(opts, 1, rest, ckpt))
        assert args.bf16 and args.rollout_backend == "embedded" and args.max_tokens_per_gpu == 256


def test_sync_sites_count_synchronising_warnings_by_line(bench):
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for line in (12, 12, 30):
            warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning, "/a/embeddings/rope_utils.py", line)
        warnings.warn_explicit("something else", UserWarning, "/a/b/c.py", 1)
    assert bench.sync_sites(records) == {"embeddings/rope_utils.py:12": 2, "embeddings/rope_utils.py:30": 1}


def _summary(**extra):
    path = dict(cycles=2, step_s=2.0, tflops_per_gpu=300.0, tokens_per_s_per_gpu=1000.0, peak_gib=40.0,
                static_gib=10.0, only_warmup=False, loss=0.5, grad_norm=2.0)
    return {"model": "qwen3-4b", "world": 1, "tp": 1, "cp": 1, "max_tokens_per_gpu": 16384,
            "recompute": ["full", "uniform", 1], "tokens": 60000, "samples": 4, "device_memory_gib": 139.8,
            "paths": {"new": path, "old": {**path, "step_s": 4.0, "peak_gib": 50.0, "grad_norm": 2.002}}, **extra}


def test_summary_lines_give_ratio_memory_per_32k_and_fit(bench):
    ratio, memory, parity, fit = bench.summary_lines(_summary())
    assert ratio.startswith("RATIO step qwen3-4b") and "new/old speed = 2.00x" in ratio
    assert "old loss 0.5 grad norm 2.002 (rel diff to the first 0.0e+00 / 1.0e-03)" in parity
    assert "new peak 40.0 GiB (static 10.0, above static 30.0 = 60.0 per 32k tokens)" in memory
    assert fit.endswith("new fits; old fits; peak 50.0 GiB of 139.8 GiB")
    counted = bench.summary_lines({**_summary(), "params": 4_051_000_000, "trained_params": 28_600_000})[1]
    assert counted.endswith("; parameters 4.051 B, trained 28.6 M")  # LoRA: the share the optimizer trains
    failed = bench.summary_lines({**_summary(failure="OOM in the warmup cycle of the old path: x"),
                                  "paths": {}})[2]
    assert "no cycle finished; then OOM in the warmup cycle of the old path" in failed


def test_summary_ratio_names_each_path_against_the_next(bench):
    summary = _summary()
    summary["paths"]["fused"] = {**summary["paths"]["new"], "step_s": 1.0}
    assert "fused/new speed = 2.00x; new/old speed = 2.00x" in bench.summary_lines(summary)[0]


def test_profile_kinds_of_the_kernels_a_step_launches(bench):
    assert bench.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert bench.kernel_kind("nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT") == "gemm"
    assert bench.kernel_kind("triton_red_fused__to_copy_amax_mul_0") == "compiled (triton)"
    assert bench.kernel_kind("void at::native::elementwise_kernel<128, 2>") == "elementwise / other"


def test_attention_command_measures_both_paths_and_agrees(bench, tmp_path, capsys):
    out = tmp_path / "attention.json"
    rc = bench.main(["attention", "--device", "cpu", "--tokens", "64", "--shapes", "4:2:16", "--reps", "1",
                     "--results-json", str(out)])
    assert rc == 0, capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [r["cp"] for r in results] == [1, 2]
    for r in results:
        assert r["new"]["ms"] > 0 and r["old"]["ms"] > 0 and max(r["rel_error"].values()) < 1e-5
        assert r["new_path_syncs"] == {} and r["new_path_kernels"]
    assert capsys.readouterr().out.count("RATIO attention") == 2


def test_attention_command_fails_loudly_on_a_wrong_kernel(bench, tmp_path, capsys, monkeypatch):
    from slime_plugins.models import cp_attention

    monkeypatch.setattr(cp_attention, "attend_causal",
                        lambda q, k, v, plan, *, scale, dropout_p: cp_attention.attend_masked(
                            q, k, v, plan, scale=scale * 1.5, dropout_p=dropout_p))
    rc = bench.main(["attention", "--device", "cpu", "--tokens", "64", "--shapes", "4:2:16", "--reps", "1"])
    assert rc == 1 and "MISMATCH" in capsys.readouterr().out


def _run_step(tmp_path: Path, nproc: int, extra: list[str], env_extra: dict[str, str] | None = None,
              model: str = "tiny"):
    torchrun = Path(sys.executable).with_name("torchrun")
    results = tmp_path / "step.json"
    cmd = [str(torchrun), "--nproc-per-node", str(nproc), "--master-port", str(find_free_port()), str(BENCH), "step",
           "--model", model, "--num-samples", "4", "--min-tokens", "40", "--max-tokens", "96", "--cycles", "1",
           "--max-tokens-per-gpu", "256", "--checkpoint-dir", str(tmp_path / "ckpt"),
           "--ledger-dir", str(tmp_path / "ledger"), "--results-json", str(results), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    return proc, (json.loads(results.read_text()) if results.exists() else None)


@pytest.mark.timeout(240)
def test_step_command_runs_both_paths_on_cp2_with_audit_and_profile(tmp_path):
    proc, report = _run_step(tmp_path, 2, ["--paths", "new", "old", "--context-parallel-size", "2", "--lr", "0",
                                           "--sync-audit", "--profile",
                                           "--recompute-granularity", "full", "--recompute-method", "uniform",
                                           "--recompute-num-layers", "1"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary, cycles = report["summary"], report["cycles"]
    assert [(c["kind"], c["path"]) for c in cycles] == [("warmup", "new"), ("warmup", "old"),
                                                       ("timed", "new"), ("timed", "old")]
    assert summary["cp"] == 2 and summary["attention_modules"] == 2 and summary["step_model_flops"] > 0
    assert set(summary["paths"]) == {"new", "old"} and "syncs_new" in summary and "profile_new" in summary
    assert all(math.isfinite(c["loss"]) and c["grad_norm"] > 0 and c["tflops_per_gpu"] > 0 for c in cycles)
    in_use = {c["path"]: c["in_use"] for c in cycles}
    on_cpu = {"fused_kernels": "eager", "adam": "default", "optimizer": ["AdamW"], "moe_identity_sort_skipped": True,
              "batched_optimizer_copies": True, "permute_without_host_sync": True, "gated_deltanet_kernel": "auto"}
    assert in_use == {"new": {"thd_rope": "patched", "kernels": ["causal"], **on_cpu},
                      "old": {"thd_rope": "megatron", "kernels": ["masked"], **on_cpu}}
    # lr 0: the weights never change, so the two paths must compute the same step
    new, old = (next(c for c in cycles if c["path"] == p) for p in ("new", "old"))
    assert new["loss"] == pytest.approx(old["loss"], rel=1e-5, abs=1e-7)
    assert new["grad_norm"] == pytest.approx(old["grad_norm"], rel=1e-5)
    for tag in ("RATIO step tiny world2 tp1 cp2", "MEMORY step", "FIT step", "SYNC tiny new", "PROFILE tiny new"):
        assert tag in proc.stdout


@pytest.mark.timeout(200)
def test_step_command_reports_an_out_of_memory_cycle(tmp_path):
    """On the DeepSeek-V4 shape (the GPU figure's model, tiny here), with the offloaded optimizer's step
    (run_step_bench_gpu.sh's moeoffload flags): its warm-up cycles train, then the OOM report."""
    offload = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d"]
    proc, report = _run_step(tmp_path, 1, ["--paths", "new", "old", "--profile-warmup", *offload],
                             {"BENCH_STEP_INJECT_OOM_AT": "2"}, model="tiny-deepseek-v4")
    assert proc.returncode != 0
    assert all(c["in_use"]["optimizer"] == ["HybridDeviceOptimizer"] and math.isfinite(c["loss"]) and c["grad_norm"] > 0
               and c["host_peak_gib"] > 0 for c in report["cycles"]), report["cycles"]
    # the first warm-up cycle ran under cProfile, and only the first
    assert proc.stdout.count("WARMUP_PROFILE new: wall ") == 1 and "WARMUP_PROFILE old" not in proc.stdout
    assert "OOM rank=0" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FIT step tiny-deepseek-v4" in proc.stdout and "then OOM in the timed cycle of the new path" in proc.stdout
    assert [c["kind"] for c in report["cycles"]] == ["warmup", "warmup"]
    assert all(math.isfinite(c["loss"]) and c["grad_norm"] > 0 and c["tflops_per_gpu"] > 0 for c in report["cycles"])
    assert report["summary"]["attention_modules"] == 0 and report["summary"]["shape"]["hc_mult"] == 3
    assert report["summary"]["failure"].startswith("OOM in the timed cycle of the new path at benchmarks/bench_step_gpu.py:")


def test_a_path_may_name_the_deltanet_kernel(bench):
    opts, _ = bench.parse_step(["--paths", "fused", "fused@compiled", "grouped@fla-dqkwg"])
    assert opts.paths == ("fused", "fused@compiled", "grouped@fla-dqkwg")
    for bad in ("fused@triton", "fast", "fused@"):
        with pytest.raises(SystemExit):
            bench.parse_step(["--paths", bad])
    summary = _summary()
    summary["paths"] = {"new": summary["paths"]["new"], "new@compiled": {**summary["paths"]["new"], "step_s": 6.0}}
    assert "new/new@compiled speed = 3.00x" in bench.summary_lines(summary)[0]


def test_vision_flops_count_the_towers_weights(bench):
    """The tower's weights per patch and per merged token are transformers' Qwen3_5VisionModel's matmul weights."""
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    shape = bench.MODELS["qwen3.5-vl-4b-8l"]
    v = shape.vision
    config = Qwen3_5VisionConfig(out_hidden_size=shape.hidden)
    assert (config.depth, config.hidden_size, config.intermediate_size, config.patch_size) == \
        (v.depth, v.hidden, v.intermediate, v.patch)
    with torch.device("meta"):
        tower = Qwen3_5VisionModel(config)
    weights = {n: p.numel() for n, p in tower.named_parameters() if p.dim() >= 2 and "pos_embed" not in n}
    per_patch, per_token = v.matmul_params(shape.hidden)
    assert per_patch + per_token == sum(weights.values())
    assert per_token == sum(n for name, n in weights.items() if name.startswith("merger."))
    # a 1024 x 1024 image: 4096 patches, 1024 image tokens; attention within the image on top of the weights
    assert v.forward_flops([1024], shape.hidden) > 2 * (per_patch * 4096 + per_token * 1024)


@pytest.mark.timeout(240)
def test_step_command_runs_a_vision_model_and_times_its_tower(tmp_path):
    """A Qwen3.5-VL-shaped step (the tiny shape): --multimodal-keys parses against the written checkpoint, the
    step trains with images, the tower is timed alone and its share of the step reported."""
    proc, report = _run_step(tmp_path, 1, ["--model", "tiny-hybrid-vl", "--paths", "new", "--image-size", "16",
                                           "--images-per-sample", "2"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = report["summary"]
    vision = summary["vision"]
    assert vision["images"] == 8 and vision["image_tokens"] == 8 * 4 and vision["patches"] == 8 * 16
    assert 0 < vision["tower_s"] < vision["step_s"] and vision["share"] == pytest.approx(
        vision["tower_s"] / vision["step_s"])
    assert all(math.isfinite(c["loss"]) and c["grad_norm"] > 0 for c in report["cycles"])
    assert "VISION tiny-hybrid-vl: the tower" in proc.stdout and "RATIO step tiny-hybrid-vl" in proc.stdout
